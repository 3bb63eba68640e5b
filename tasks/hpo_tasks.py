"""Rare-disease diagnosis and phenotype-definition tasks built from the HPO snapshot.

- Diagnosis, multiple choice: k phenotypes of a disease -> pick it among 4 options (A-D). Distractors share phenotypes
  with the answer (ranked by Jaccard similarity of phenotype sets) but none is annotated with every phenotype shown,
  so exactly one option fits and the knowledge base can tell them apart. Strata: ``k_stratum`` easy (k = 5-6) or
  hard (k = 2-3), ``distractor_stratum`` near (among the most similar diseases) or far (less similar, still sharing).
- Diagnosis, open-ended: the same cases; the answer is the disease name, references its name variants.
- Warm-up: a definition of an HPO phenotype -> pick its term name among 4 (distractors are ontology siblings/cousins).

Diseases are split into train and test before any question is made; each split draws answers and distractors only
from its own diseases, so no test disease name appears anywhere in training. Warm-up terms are split the same way as
answers (their distractors may be any term). Shown phenotypes are
observed ones (frequency unknown or >= 30%) whose names share no word with the disease name, so the name cannot be
matched by string overlap. Everything is drawn from ``random.Random`` seeded by strings: same seed, same tasks.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix

from tasks.hpo import Disease, Term
from tasks.knowledge_base import KnowledgeBase, name_key, name_variants
from tasks.schema import Message, Task, option_listing

LETTERS = "ABCD"
K_STRATA = {"easy": (5, 6), "hard": (2, 3)}
DISTRACTOR_STRATA = ("near", "far")
NEAR_POOL = 8  # "near" distractors come from the NEAR_POOL most similar candidates, "far" ones from the next FAR_POOL
FAR_POOL = 40
MIN_CLUES = max(max(K_STRATA.values()))
MIN_CLUE_FREQUENCY = 0.3
MAX_NAME_WORDS = 8
_NAME_STOPWORDS = frozenset(
    "syndrome disease disorder type with and the due form congenital familial deficiency autosomal dominant recessive "
    "linked early late onset infantile juvenile adult primary secondary abnormal abnormality".split()
)

SYSTEM_PROMPT = (
    "Answer the medical question. Think inside <think></think>. To look up knowledge, write <query>search "
    "terms</query>; results come back inside <retrieve></retrieve>. Give the final answer as <answer>X</answer>, "
    "where X is {what}."
)
_ANSWER_KINDS = {"letter": "the option letter", "disease": "the disease name",
                 "ranked": "up to three disease names, most likely first, separated by semicolons"}


def system_message(answer_kind: str) -> Message:
    """The shared system prompt; ``answer_kind`` is 'letter' (multiple choice), 'disease' (open-ended) or 'ranked'
    (open-ended, a ranked list of up to three names: graded top-1 / top-3)."""
    return Message(role="system", content=SYSTEM_PROMPT.format(what=_ANSWER_KINDS[answer_kind]))


@dataclass(frozen=True)
class DiagnosisCase:
    """One diagnosis question before rendering: the answer, the phenotypes shown and the distractors."""

    disease: Disease
    clues: list[str]
    k_stratum: str
    distractors: list[Disease]
    distractor_jaccard: list[float]
    distractor_stratum: str
    answer_letter: str


@dataclass(frozen=True)
class _PoolIndex:
    """One split's diseases (id order) as a binary disease x phenotype matrix, for Jaccard similarity."""

    diseases: list[Disease]
    row: dict[str, int]
    column: dict[str, int]
    matrix: csr_matrix
    sizes: np.ndarray


class HPOTaskBuilder:
    """Selects eligible diseases and terms, splits them by seed, and renders tasks in the shared schema."""

    def __init__(self, kb: KnowledgeBase, seed: int = 0, test_fraction: float = 0.2):
        self.kb = kb
        self.terms = kb.snapshot.terms
        self.seed = seed
        self.features = {d.id: set(kb.features(d)) for d in kb.snapshot.diseases.values()}
        self.clues: dict[str, list[str]] = {}
        seen_names: set[str] = set()  # of a name shared by several diseases, the best-annotated one is kept
        for d in sorted(kb.snapshot.diseases.values(), key=lambda d: (-len(self.features[d.id]), d.id)):
            clues = self._clue_candidates(d)
            keys = {name_key(n) for n in name_variants(d)}
            if len(clues) >= MIN_CLUES and _decent_name(d.name) and not keys & seen_names:
                self.clues[d.id] = clues
                seen_names |= keys
        diseases = [kb.snapshot.diseases[i] for i in sorted(self.clues)]
        self.disease_split = _split(diseases, test_fraction, random.Random(f"{seed}:split:diseases"))
        self._pool_index = {s: self.pool_index(pool) for s, pool in self.disease_split.items()}
        self._explained: dict[str, set[str]] = {}
        self.children: dict[str, list[str]] = {}
        for t in self.terms.values():
            for p in t.parents:
                self.children.setdefault(p, []).append(t.id)
        terms = [t for t in self.terms.values() if self._warmup_eligible(t)]
        self.term_split = _split(terms, test_fraction, random.Random(f"{seed}:split:terms"))

    # ---- diagnosis ---------------------------------------------------------------------------------------------

    def diagnosis_cases(self, split: str, n: int) -> Iterator[DiagnosisCase]:
        """``n`` cases whose answers are ``split`` diseases, each disease once before any repeats.

        Answer letters and the four (k, distractor) strata are balanced: each is used n/4 times (+-1), in seeded order.
        Diseases with fewer than 3 sharing candidates in their split are passed over.
        """
        rng = random.Random(f"{self.seed}:diagnosis:{split}")
        pool = self.disease_split[split]
        order = rng.sample(pool, len(pool))
        letters = _balanced(LETTERS, n, rng)
        strata = _balanced([(k, d) for k in K_STRATA for d in DISTRACTOR_STRATA], n, rng)
        made = tried = 0
        while made < n:
            if tried >= len(order) and made == 0:
                raise ValueError(f"no {split} disease has enough distractor candidates")
            disease = order[tried % len(order)]
            tried += 1
            k_stratum, d_stratum = strata[made]
            case = self._case(disease, split, k_stratum, d_stratum, letters[made], rng)
            if case is not None:
                made += 1
                yield case

    def _case(
        self, disease: Disease, split: str, k_stratum: str, d_stratum: str, letter: str, rng: random.Random
    ) -> DiagnosisCase | None:
        clues = rng.sample(self.clues[disease.id], rng.choice(K_STRATA[k_stratum]))
        picked = self.distractors(clues, self._similar(disease, split), d_stratum, rng)
        if picked is None:
            return None
        distractors, jaccard, d_stratum = picked
        return DiagnosisCase(
            disease=disease,
            clues=clues,
            k_stratum=k_stratum,
            distractors=distractors,
            distractor_jaccard=jaccard,
            distractor_stratum=d_stratum,
            answer_letter=letter,
        )

    def distractors(self, clues: list[str], similar: Iterator[tuple[float, Disease]], d_stratum: str,
                    rng: random.Random) -> tuple[list[Disease], list[float], str] | None:
        """The world's distractor rule: 3 of the NEAR_POOL (near) or next FAR_POOL (far) most similar diseases in
        ``similar`` (Jaccard, descending) that do not account for every clue; None if fewer than 3 qualify. Returns
        the distractors (most similar first), their Jaccard similarities and the stratum actually made."""
        ranked = []  # the NEAR_POOL + FAR_POOL most similar diseases that do not account for every clue
        for j, other in similar:
            if not set(clues) <= self._explains(other):
                ranked.append((j, other))
                if len(ranked) == NEAR_POOL + FAR_POOL:
                    break
        if len(ranked) < len(LETTERS) - 1:
            return None
        near, far = ranked[:NEAR_POOL], ranked[NEAR_POOL:]
        if d_stratum == "far" and len(far) >= len(LETTERS) - 1:
            candidates = far
        else:
            candidates, d_stratum = near, "near"  # too few sharing diseases for a far set: record what was made
        picked = sorted(rng.sample(candidates, len(LETTERS) - 1), key=lambda jd: (-jd[0], jd[1].id))
        return [d for _, d in picked], [round(j, 4) for j, _ in picked], d_stratum

    def _similar(self, disease: Disease, split: str) -> Iterator[tuple[float, Disease]]:
        """Diseases of the same split sharing >= 1 phenotype with ``disease``, by Jaccard similarity (desc), then id."""
        return self.similar(self.features[disease.id], self._pool_index[split], exclude=disease.id)

    def similar(self, features: set[str], index: _PoolIndex, exclude: str | None = None
                ) -> Iterator[tuple[float, Disease]]:
        """Diseases of ``index`` (a :meth:`pool_index`) sharing >= 1 of ``features``, by Jaccard similarity of
        phenotype sets (desc), then id; the disease ``exclude`` is left out."""
        query = np.zeros(len(index.column))
        query[[index.column[h] for h in features if h in index.column]] = 1.0
        shared = index.matrix @ query
        jaccard = shared / (index.sizes + len(features) - shared)
        if exclude in index.row:
            jaccard[index.row[exclude]] = 0.0
        order = np.lexsort((np.arange(len(jaccard)), -jaccard))
        for r in order[jaccard[order] > 0]:
            yield float(jaccard[r]), index.diseases[r]

    def _explains(self, disease: Disease) -> set[str]:
        """Phenotypes a disease accounts for: its own and all their ancestors (a 'Focal seizure' explains 'Seizure')."""
        if disease.id not in self._explained:
            found = set(self.features[disease.id])
            for h in self.features[disease.id]:
                found |= self.kb.snapshot.ancestors(h)
            self._explained[disease.id] = found
        return self._explained[disease.id]

    def pool_index(self, pool: list[Disease]) -> _PoolIndex:
        """``pool`` (diseases with >= 1 feature) as the disease x phenotype matrix :meth:`similar` ranks over."""
        diseases = sorted(pool, key=lambda d: d.id)
        vocab = {h: c for c, h in enumerate(sorted({h for d in diseases for h in self.features[d.id]}))}
        rows = [r for r, d in enumerate(diseases) for _ in self.features[d.id]]
        cols = [vocab[h] for d in diseases for h in self.features[d.id]]
        matrix = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(diseases), len(vocab)))
        return _PoolIndex(
            diseases=diseases,
            row={d.id: r for r, d in enumerate(diseases)},
            column=vocab,
            matrix=matrix,
            sizes=np.diff(matrix.indptr).astype(float),
        )

    def _clue_candidates(self, disease: Disease) -> list[str]:
        """Phenotypes fit to show: observed (freq unknown or >= MIN_CLUE_FREQUENCY), no word shared with the name."""
        name_stems = _stems(" ".join(name_variants(disease)))
        return [
            h
            for h in self.kb.features(disease)
            if (disease.phenotypes[h] is None or disease.phenotypes[h] >= MIN_CLUE_FREQUENCY)
            and not _stems(self.terms[h].name) & name_stems
        ]

    def mcq_task(self, case: DiagnosisCase, split: str, index: int) -> Task:
        """Render a case as a 4-option multiple-choice task."""
        others = iter(case.distractors)
        options = {
            letter: (case.disease if letter == case.answer_letter else next(others)).name for letter in LETTERS
        }
        listing = option_listing(options)
        return Task(
            id=f"hpo-mcq-{split}-{index:06d}",
            messages=[system_message("letter"), Message(role="user", content=f"{self._question(case)}\n{listing}")],
            answer=case.answer_letter,
            options=options,
            images=[],
            gold_boxes=[],
            references=name_variants(case.disease),
            metadata=self._metadata(case, "hpo_diagnosis_mcq", split) | self._reference_reasoning(case),
        )

    def open_task(self, case: DiagnosisCase, split: str, index: int) -> Task:
        """Render a case as an open-ended task whose answer is the disease name."""
        return Task(
            id=f"hpo-open-{split}-{index:06d}",
            messages=[system_message("disease"), Message(role="user", content=self._question(case))],
            answer=case.disease.name,
            options=None,
            images=[],
            gold_boxes=[],
            references=name_variants(case.disease),
            metadata=self._metadata(case, "hpo_diagnosis_open", split) | self._reference_reasoning(case),
        )

    def _question(self, case: DiagnosisCase) -> str:
        shown = "; ".join(self._clue_names(case))
        return f"A patient has: {shown}. Which rare disease is most likely?"

    def _clue_names(self, case: DiagnosisCase) -> list[str]:
        """The names of the phenotypes a case shows, in the order its question lists them."""
        return [self.terms[h].name for h in case.clues]

    def _reference_reasoning(self, case: DiagnosisCase) -> dict:
        """Reference reasonings for reasoning rewards (Med-R3's semantic / statistic / logical), written from the
        ontology: which phenotypes the answer accounts for, and for each distractor a shown phenotype it does not;
        with the matching knowledge-graph triples, one graph per reasoning."""
        names = self._clue_names(case)
        support = f"The patient has {'; '.join(names)}. {case.disease.name} is annotated in the Human Phenotype " \
                  f"Ontology with {'; '.join(names)}, so {case.disease.name} is the most likely diagnosis."
        triples = [[case.disease.name, "has phenotype", n] for n in names]
        exclusions, excluded = [], []
        for other in case.distractors:
            missing = sorted(set(case.clues) - self._explains(other))
            if missing:
                exclusions.append(f"{other.name} does not account for {self.terms[missing[0]].name}.")
                excluded.append([other.name, "lacks phenotype", self.terms[missing[0]].name])
        differential = f"{support} {' '.join(exclusions)}".strip()
        return {"reference_reasonings": [support, differential],
                "reference_triples": [triples, triples + excluded]}

    def _metadata(self, case: DiagnosisCase, task: str, split: str) -> dict:
        return {
            "task": task,
            "split": split,
            "disease_id": case.disease.id,
            "kb_doc_id": f"disease:{case.disease.id}",
            "phenotype_ids": case.clues,
            "phenotype_names": self._clue_names(case),  # as the question lists them
            "k": len(case.clues),
            "k_stratum": case.k_stratum,
            "distractor_stratum": case.distractor_stratum,
            "distractor_ids": [d.id for d in case.distractors],
            "distractor_jaccard": case.distractor_jaccard,
        }

    # ---- warm-up -----------------------------------------------------------------------------------------------

    def warmup_tasks(self, split: str, n: int) -> Iterator[Task]:
        """``n`` definition -> term-name questions whose answers are ``split`` terms (each once before repeats)."""
        rng = random.Random(f"{self.seed}:warmup:{split}")
        pool = self.term_split[split]
        order = rng.sample(pool, len(pool))
        letters = _balanced(LETTERS, n, rng)
        made = tried = 0
        while made < n:
            if tried >= len(order) and made == 0:
                raise ValueError(f"no {split} term has enough distractors")
            term = order[tried % len(order)]
            tried += 1
            distractors = self._term_distractors(term, rng)
            if distractors is None:
                continue
            others = iter(distractors)
            options = {letter: (term if letter == letters[made] else next(others)).name for letter in LETTERS}
            listing = option_listing(options)
            question = f'Which phenotype has this definition? "{term.definition}"\n{listing}'
            yield Task(
                id=f"hpo-warmup-{split}-{made:06d}",
                messages=[system_message("letter"), Message(role="user", content=question)],
                answer=letters[made],
                options=options,
                images=[],
                gold_boxes=[],
                references=[term.name],
                metadata={
                    "task": "hpo_definition_mcq",
                    "split": split,
                    "term_id": term.id,
                    "kb_doc_id": f"term:{term.id}",
                    "distractor_ids": [t.id for t in distractors],
                },
            )
            made += 1

    def _term_distractors(self, term: Term, rng: random.Random) -> list[Term] | None:
        """3 siblings of the term (sharing a parent), topped up with cousins; None if there are not enough."""
        definition = term.definition.lower()
        names = {name_key(term.name)} | {name_key(s) for s in term.synonyms}

        def usable(ids: set[str]) -> list[Term]:
            found = [self.terms[i] for i in sorted(ids) if i != term.id and name_key(self.terms[i].name) not in names]
            return [t for t in found if t.name.lower() not in definition and len(t.name.split()) <= MAX_NAME_WORDS]

        children = self.children
        siblings = usable({c for p in term.parents for c in children.get(p, ())})
        picked = rng.sample(siblings, min(len(siblings), len(LETTERS) - 1))
        if len(picked) < len(LETTERS) - 1:
            grandparents = {g for p in term.parents for g in self.terms[p].parents}
            cousins = usable({c for g in grandparents for p in children.get(g, ()) for c in children.get(p, ())})
            cousins = [t for t in cousins if t not in siblings]
            if len(cousins) < len(LETTERS) - 1 - len(picked):
                return None
            picked += rng.sample(cousins, len(LETTERS) - 1 - len(picked))
        return picked

    def _warmup_eligible(self, term: Term) -> bool:
        """A phenotypic-abnormality term with a definition of 6-50 words that does not give its own name away."""
        words = len(term.definition.split())
        return (
            6 <= words <= 50
            and len(term.name.split()) <= MAX_NAME_WORDS
            and term.name.lower() not in term.definition.lower()
            and self.kb.branch(term.id) == "phenotype"
            and term.id != "HP:0000118"
        )


def _split(items: list, test_fraction: float, rng: random.Random) -> dict[str, list]:
    """Shuffle (items are in id order) and cut: the first ``test_fraction`` is test, the rest train."""
    shuffled = rng.sample(items, len(items))
    n_test = round(len(items) * test_fraction)
    return {"train": shuffled[n_test:], "test": shuffled[:n_test]}


def _balanced(values: list | str, n: int, rng: random.Random) -> list:
    """``n`` values cycling through ``values`` in shuffled order: each used n/len(values) times (+-1)."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def _stems(text: str) -> set[str]:
    """Content-word stems (first 6 letters) used to tell whether a phenotype name repeats the disease name."""
    return {w[:6] for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in _NAME_STOPWORDS}


def _decent_name(name: str) -> bool:
    """A disease name fit for an option: not a legacy all-caps OMIM title, not a numbered series member, short."""
    return (
        not name.isupper()
        and len(name.split()) <= MAX_NAME_WORDS
        and not re.search(r"\d|[\[\]{}?]|\bincluded\b|\btype [IVX]+[A-Z]?\b", name, flags=re.I)
    )
