"""Med-RwR's query semantic reward (the Med-RwR paper, sec. 3.2.2), text half:

    sigma_q_text = |S_Q ∩ S_G| / |S_Q| + |S_K ∩ S_G| / |S_K|                                   (Eqn. 1)

S_Q, S_K and S_G are the sets of medical concepts MedCAT finds in the generated queries, the retrieved information
and the ground-truth content. A ratio whose set is empty is 0 (a rollout that never queried, or whose retrieval
returned nothing, earns nothing for that term), so sigma_q_text lies in [0, 2].

Concepts come from the MedCAT pack built from HPO by :mod:`tasks.medcat_pack` (UMLS CUIs, HPO ids for terms without
one). Where mentions overlap only the longest counts ("prolonged bleeding after dental extraction" is one concept,
not also "prolonged"): that is what MedCAT's ``show_nested_entities=False`` promises, but MedCAT 2.9's regex
tokenizer leaves an entity's last token out of the overlap check, so nested mentions come through, and they are
filtered here by character span.

- Q: every ``query`` of the trajectory's turns; their concept sets are united (the same as concatenating the queries,
  except that no concept is matched across the boundary of two queries).
- K: the ``text`` of every chunk retrieved in any turn (each chunk id once).
- G, the ground-truth content. The paper does not spell it out beyond "ground truth content"; its tasks are exam
  questions with a ground-truth answer and an explanation, and its knowledge base (ExpKB, appendix C.1) is extracted
  from those very explanations. So G is, united:
    * the gold answer as text: for multiple choice the gold option's text (the letter alone names no concept), for
      open-ended tasks the answer;
    * the task's ``references`` (accepted answer texts, e.g. the disease's name variants);
    * ``metadata["explanation"]`` where a task carries one (benchmarks such as MedMCQA do);
    * the knowledge-base document of the answer, ``metadata["kb_doc_id"]``, all its chunks: the explanation
      counterpart of the HPO world (the disease's phenotypes, inheritance and key definitions; for a warm-up task the
      term's definition and synonyms). Without it G would be a disease name, in which HPO finds almost no concept, and
      the reward would be 0 for every rollout.
  A query naming the patient's phenotypes, or the phenotypes that set the answer apart, and retrieval of the
  answer's own document score high; retrieving a distractor disease scores by the phenotypes it shares.

The image half, sigma_q_image = cos(f_image(i), f_text(t)) with BiomedCLIP (Eqn. 2), is a separate reward registered
as ``query_semantic_image`` returning the component ``query_semantic_image``; its t is :func:`query_text`. The paper's
w_q * sigma_q = w_q * (text + image) is then two config entries with the same weight:

    - {name: query_semantic_text, weight: 0.4, args: {kb: hpo}}
    - {name: query_semantic_image, weight: 0.4, args: {clip: <BiomedCLIP dir, null for the tiny one>}}
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from actors.trajectory import Trajectory
from rewards.registry import register_reward

os.environ.setdefault("MEDCAT_DISABLE_VERSION_CHECK", "true")  # MedCAT asks PyPI for updates on import otherwise

TEXT_COMPONENT = "query_semantic_text"
IMAGE_COMPONENT = "query_semantic_image"


def overlap_ratio(found: set[str] | frozenset[str], gold: set[str] | frozenset[str]) -> float:
    """|found ∩ gold| / |found|, and 0 for an empty ``found``."""
    return len(found & gold) / len(found) if found else 0.0


def text_query_semantic(s_q: set[str] | frozenset[str], s_k: set[str] | frozenset[str],
                        s_g: set[str] | frozenset[str]) -> float:
    """Eqn. 1: |S_Q ∩ S_G| / |S_Q| + |S_K ∩ S_G| / |S_K|, an empty S_Q or S_K contributing 0."""
    return overlap_ratio(s_q, s_g) + overlap_ratio(s_k, s_g)


def queries(traj: Trajectory) -> list[str]:
    """The trajectory's queries, in turn order (turns without a non-empty ``query`` are tool calls or the like)."""
    return [t["query"] for t in traj.turns if isinstance(t.get("query"), str) and t["query"].strip()]


def query_text(traj: Trajectory) -> str:
    """All queries of a trajectory as one text, one per line: the t of the image half (Eqn. 2)."""
    return "\n".join(queries(traj))


def retrieved_texts(traj: Trajectory) -> list[str]:
    """The text of every chunk retrieved in the trajectory, each chunk (by id, else by text) once, in turn order."""
    seen, texts = set(), []
    for turn in traj.turns:
        for chunk in turn.get("chunks") or []:
            key = chunk.get("id") or chunk.get("text")
            if chunk.get("text") and key not in seen:
                seen.add(key)
                texts.append(chunk["text"])
    return texts


def gold_answer_text(task: dict) -> str:
    """The gold answer as text: the gold option's text for multiple choice, else the answer itself."""
    options, answer = task.get("options"), task.get("answer") or ""
    if options:
        return options.get(answer.strip().upper(), options.get(answer, answer))
    return answer


def ground_truth_texts(task: dict, kb_document: str | None = None) -> list[str]:
    """The texts whose concepts form S_G (see the module docstring): gold answer text, references, the task's
    explanation if any, and the answer's knowledge-base document when given."""
    metadata = task.get("metadata") or {}
    texts = [gold_answer_text(task), *task.get("references", [])]
    if isinstance(metadata.get("explanation"), str):
        texts.append(metadata["explanation"])
    if kb_document:
        texts.append(kb_document)
    return [t for t in dict.fromkeys(texts) if t and t.strip()]


class ConceptRecogniser:
    """MedCAT over a model pack: the set of concepts (CUIs) in a text, longest mention first where mentions overlap.

    Results are memoised per text (LRU, ``cache_size`` texts): the same gold document, retrieved chunk and query
    recur across the rollouts of a group and across steps. Calls are serialised by a lock (MedCAT's pipeline keeps
    per-document state).
    """

    def __init__(self, pack: str | os.PathLike | None = None, cache_size: int = 50_000):
        from tasks.medcat_pack import load_medcat_pack
        self.cat = load_medcat_pack(pack)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._lock = threading.Lock()

    def concepts(self, text: str) -> frozenset[str]:
        if not text or not text.strip():
            return frozenset()
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
            found = self._longest_mentions(self.cat.get_entities(text)["entities"].values())
            self._cache[text] = found
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return found

    def concepts_of(self, texts: Iterable[str]) -> frozenset[str]:
        """The union of the concept sets of several texts."""
        found: set[str] = set()
        for text in texts:
            found |= self.concepts(text)
        return frozenset(found)

    @staticmethod
    def _longest_mentions(entities: Iterable[dict]) -> frozenset[str]:
        """CUIs of the mentions that no longer (then earlier) mention overlaps, by character span."""
        kept: list[tuple[int, int]] = []
        cuis = set()
        for ent in sorted(entities, key=lambda e: (-(e["end"] - e["start"]), e["start"])):
            if all(ent["end"] <= s or ent["start"] >= e for s, e in kept):
                kept.append((ent["start"], ent["end"]))
                cuis.add(ent["cui"])
        return frozenset(cuis)


def load_recogniser(pack: str | os.PathLike | None = None, cache_size: int = 50_000) -> ConceptRecogniser:
    """One recogniser per pack and process, shared by every reward that asks for it (None: the default HPO pack)."""
    return _recogniser(str(pack) if pack else None, cache_size)


@lru_cache(maxsize=None)
def _recogniser(pack: str | None, cache_size: int) -> ConceptRecogniser:
    return ConceptRecogniser(pack, cache_size)


class KnowledgeBaseDocuments:
    """doc_id -> the document's text (its chunks in file order, joined by newlines) of a chunks JSONL (fields id,
    doc_id, text), or of the HPO world's knowledge base for ``kb="hpo"``. Read on first use."""

    def __init__(self, kb: str | os.PathLike):
        self.kb = kb
        self._docs: dict[str, str] | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        from indexing.retrieval_index import resolve_corpus
        return resolve_corpus(self.kb)

    def __getitem__(self, doc_id: str) -> str:
        with self._lock:
            if self._docs is None:
                self._docs = self._read(self.path)
        if doc_id not in self._docs:
            raise KeyError(f"knowledge-base document {doc_id!r} (the task's metadata.kb_doc_id) is not in {self.kb}; "
                           "give the reward the knowledge base the tasks were built with (args.kb)")
        return self._docs[doc_id]

    @staticmethod
    def _read(path: Path) -> dict[str, str]:
        parts: dict[str, list[str]] = {}
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        chunk = json.loads(line)
                        parts.setdefault(chunk["doc_id"], []).append(chunk["text"])
                    except (ValueError, KeyError, TypeError) as e:
                        raise ValueError(f"{path}:{lineno}: not a chunk with doc_id and text ({e})") from None
        return {doc_id: "\n".join(texts) for doc_id, texts in parts.items()}


@register_reward(TEXT_COMPONENT)
class QuerySemanticText:
    """sigma_q_text (Eqn. 1) per trajectory, as component ``query_semantic_text``, in [0, 2].

    Args (config ``args``):
        pack: a MedCAT model pack directory; None: the HPO pack, built on first use
            (:func:`tasks.medcat_pack.ensure_medcat_pack`).
        kb: the knowledge base whose document ``metadata.kb_doc_id`` names joins G: a chunks JSONL or "hpo" (the HPO
            world's); None leaves knowledge-base documents out of G.
        cache_size: texts whose concept sets are memoised.
    """

    def __init__(self, pack: str | None = None, kb: str | None = "hpo", cache_size: int = 50_000):
        self.recogniser = load_recogniser(pack, cache_size)
        self.kb = KnowledgeBaseDocuments(kb) if kb else None

    def concept_sets(self, traj: Trajectory) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """(S_Q, S_K, S_G) of one trajectory."""
        task = traj.task
        doc_id = (task.get("metadata") or {}).get("kb_doc_id")
        kb_document = self.kb[doc_id] if self.kb is not None and doc_id else None
        return (self.recogniser.concepts_of(queries(traj)),
                self.recogniser.concepts_of(retrieved_texts(traj)),
                self.recogniser.concepts_of(ground_truth_texts(task, kb_document)))

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        return {TEXT_COMPONENT: [text_query_semantic(*self.concept_sets(t)) if queries(t) or retrieved_texts(t)
                                 else 0.0 for t in trajectories]}


def image_query_cosine(image_embedding, text_embedding) -> float:
    """Eqn. 2: f_image(i) . f_text(t) / (||f_image(i)|| ||f_text(t)||); 0 when either embedding is zero."""
    import numpy as np
    i, t = np.asarray(image_embedding, dtype=np.float64), np.asarray(text_embedding, dtype=np.float64)
    norms = np.linalg.norm(i) * np.linalg.norm(t)
    return float(i @ t / norms) if norms > 0 else 0.0


@register_reward(IMAGE_COMPONENT)
class QuerySemanticImage:
    """sigma_q_image (Eqn. 2) per trajectory, as component ``query_semantic_image``, in [-1, 1]: the BiomedCLIP
    cosine between the task's image (its first, as the paper's questions have one) and the trajectory's queries
    (:func:`query_text`). A rollout that never queried, or a task without an image, scores 0 (as an empty S_Q does in
    Eqn. 1).

    Args (config ``args``):
        clip: a local BiomedCLIP open_clip directory (real weights); None: the tiny BiomedCLIP-architecture model
            (:func:`indexing.biomedclip.load_biomedclip`), meaningless similarities but the same computation.
        cache_size: image embeddings memoised by path (a group's rollouts share their task's image).
    """

    def __init__(self, clip: str | None = None, cache_size: int = 4096):
        from indexing.biomedclip import load_biomedclip
        self.model = load_biomedclip(clip)
        self.cache_size = cache_size
        self._images: OrderedDict[str, object] = OrderedDict()

    def image_embeddings(self, paths: list[str]) -> dict:
        """path -> embedding, embedding (in one batch) only the paths not cached yet."""
        from PIL import Image
        missing = [p for p in dict.fromkeys(paths) if p not in self._images]
        if missing:
            images = []
            for path in missing:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            for path, row in zip(missing, self.model.embed_images(images)):
                self._images[path] = row
        found = {}
        for path in paths:
            self._images.move_to_end(path)
            found[path] = self._images[path]
        while len(self._images) > self.cache_size:
            self._images.popitem(last=False)
        return found

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        scored = [i for i, t in enumerate(trajectories) if query_text(t) and t.task.get("images")]
        scores = [0.0] * len(trajectories)
        if scored:
            images = self.image_embeddings([trajectories[i].task["images"][0] for i in scored])
            texts = self.model.embed_texts([query_text(trajectories[i]) for i in scored])
            for i, text in zip(scored, texts):
                scores[i] = image_query_cosine(images[trajectories[i].task["images"][0]], text)
        return {IMAGE_COMPONENT: scores}
