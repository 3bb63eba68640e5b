"""The questions asked about rendered cases (finding and condition multiple choice, open finding), their captions
and saving a case."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from tasks.imaging.cases import CaseSpec, LesionSpec, render_case
from tasks.hpo import Term
from tasks.imaging.world import (Finding, FINDINGS, FINDINGS_BY_KEY, IMAGE_SIZE, INPUT_SIZE, LETTERS, MODALITIES,
                                 Modality)
from tasks.schema import Message, option_listing, Task


# ---- questions ---------------------------------------------------------------------------------------------------

EXTRA_LESIONS = (0, 1, 2)
EXTRA_WEIGHTS = (0.4, 0.4, 0.2)
QUESTION_TYPES = ("finding_mcq", "finding_open", "condition_mcq")
IMAGE_NOTE = (
    "The image is {n} x {n} pixels; coordinates are pixels of the full-resolution image (x to the right, y down, "
    "origin at the top left). "
)
_ANSWER_KINDS = {"letter": "the option letter", "finding": "the name of the finding"}


def system_message(answer_kind: str, image_size: int = IMAGE_SIZE) -> Message:
    """The HPO world's system prompt (think / query / answer tags) preceded by the image's coordinate convention."""
    from tasks.hpo_tasks import SYSTEM_PROMPT

    text = IMAGE_NOTE.format(n=image_size) + SYSTEM_PROMPT.format(what=_ANSWER_KINDS[answer_kind])
    return Message(role="system", content=text)


@dataclass
class CaseResult:
    """A rendered, saved case: the image path (relative to the world directory) and its lesions, described."""

    spec: CaseSpec
    image: str
    lesions: list[dict]


@dataclass
class CaseQuestion:
    """What every question about a case shares: its lesion's finding, HPO term and modality, the metadata, where the
    lesion is, the question's first sentence and the task fields (images, gold boxes)."""
    split: str
    index: int
    case: CaseResult
    finding: Finding
    term: Term
    modality: Modality
    meta: dict
    where: str
    intro: str
    common: dict


class ImagingTaskBuilder:
    """Links findings to HPO terms and diseases, splits the diseases, plans cases and renders their questions.

    ``linked[finding]`` lists the diseases (ids) annotated with the finding's term or one of its descendants with a
    non-zero frequency and a name fit for an option (the HPO world's rule); each is assigned to train or test once,
    per finding in catalogue order, so that every finding with >= 2 such diseases has some in both splits.
    """

    def __init__(self, snapshot, seed: int = 0, test_fraction: float = 0.25):
        from tasks.hpo_tasks import _decent_name
        from tasks.knowledge_base import name_key

        self.snapshot = snapshot
        self.seed = seed
        by_name: dict[str, list[str]] = {}
        for t in snapshot.terms.values():
            by_name.setdefault(t.name, []).append(t.id)
        self.terms = {}
        for f in FINDINGS:
            ids = by_name.get(f.hpo_name, [])
            if len(ids) != 1:
                raise LookupError(f"HPO term {f.hpo_name!r} (finding {f.key}) found {len(ids)} times in the snapshot")
            self.terms[f.key] = snapshot.terms[ids[0]]
        children: dict[str, list[str]] = {}
        for t in snapshot.terms.values():
            for p in t.parents:
                children.setdefault(p, []).append(t.id)
        seen_names: set[str] = set()
        eligible = []
        for d in snapshot.diseases.values():  # id order; the first disease of a name keeps it
            key = name_key(d.name)
            if _decent_name(d.name) and key not in seen_names:
                seen_names.add(key)
                eligible.append(d)
        self.linked: dict[str, list[str]] = {}
        for f in FINDINGS:
            below = self._descendants(self.terms[f.key].id, children)
            self.linked[f.key] = [d.id for d in eligible if any(h in below and q != 0 for h, q in d.phenotypes.items())]
        rng = random.Random(f"{seed}:imaging:split:diseases")
        assigned: dict[str, str] = {}
        for f in FINDINGS:
            pool = self.linked[f.key]
            n_test = 0 if len(pool) < 2 else max(1, round(len(pool) * test_fraction))
            have_test = sum(assigned.get(d) == "test" for d in pool)
            fresh = [d for d in pool if d not in assigned]
            rng.shuffle(fresh)
            for d in fresh:
                assigned[d] = "test" if have_test < n_test else "train"
                have_test += assigned[d] == "test"
        self.disease_split = {s: sorted(d for d, a in assigned.items() if a == s) for s in ("train", "test")}
        self.split_of = assigned

    @staticmethod
    def _descendants(term_id: str, children: dict[str, list[str]]) -> set[str]:
        found, stack = {term_id}, [term_id]
        while stack:
            for c in children.get(stack.pop(), ()):
                if c not in found:
                    found.add(c)
                    stack.append(c)
        return found

    def hpo_id(self, finding_key: str) -> str:
        return self.terms[finding_key].id

    # ---- planning ----

    def plan(self, split: str, n: int, extras: bool = True) -> list[CaseSpec]:
        """``n`` case specs: (finding, stratum) combinations balanced (each n/len +-1), 0-2 extra lesions each."""
        from tasks.hpo_tasks import _balanced

        rng = random.Random(f"{self.seed}:imaging:plan:{split}")
        combos = [(f.key, s) for f in FINDINGS for s in f.strata]
        targets = _balanced(combos, n, rng)
        specs = []
        for i, (key, stratum) in enumerate(targets):
            finding = FINDINGS_BY_KEY[key]
            n_extra = rng.choices(EXTRA_LESIONS, EXTRA_WEIGHTS)[0] if extras else 0
            others = [f for f in FINDINGS if f.modality == finding.modality and f.key != key]
            lesions = [LesionSpec(key, stratum)]
            for other in rng.sample(others, n_extra):
                lesions.append(LesionSpec(other.key, rng.choice(other.strata)))
            specs.append(CaseSpec(self.seed, split, i, finding.modality, tuple(lesions)))
        return specs

    # ---- tasks ----

    def tasks(self, split: str, cases: list[CaseResult]) -> dict[str, list[Task]]:
        """The three question types for the cases of a split (condition questions only where a disease exists)."""
        from tasks.hpo_tasks import _balanced

        rng = random.Random(f"{self.seed}:imaging:questions:{split}")
        with_condition = [i for i, c in enumerate(cases) if self._split_diseases(c.lesions[0]["finding"], split)]
        letters = _balanced(LETTERS, len(cases), rng)
        condition_letters = dict(zip(with_condition, _balanced(LETTERS, len(with_condition), rng)))
        answer_pools: dict[str, list[str]] = {}
        out: dict[str, list[Task]] = {q: [] for q in QUESTION_TYPES}
        for i, case in enumerate(cases):
            about = self._case_question(split, i, case)
            out["finding_mcq"].append(self._finding_mcq(about, letters[i], rng))
            out["finding_open"].append(self._finding_open(about))
            disease_id = self._next_answer(about.finding.key, split, answer_pools, rng)
            if disease_id is not None:
                out["condition_mcq"].append(self._condition_mcq(about, disease_id, condition_letters[i], split, rng))
        return out

    def _case_question(self, split: str, i: int, case: CaseResult) -> CaseQuestion:
        target = case.lesions[0]
        finding = FINDINGS_BY_KEY[target["finding"]]
        term = self.terms[finding.key]
        modality = MODALITIES[case.spec.modality]
        meta = {
            "split": split,
            "case_id": f"{split}-{case.spec.index:05d}",
            "modality": modality.key,
            "finding": finding.key,
            "hpo_id": term.id,
            "hpo_name": term.name,
            "kb_doc_id": f"term:{term.id}",
            "size_stratum": target["stratum"],
            "needs_zoom": target["stratum"] == "small",
            "region": target["region"],
            "image_size": IMAGE_SIZE,
            "input_size": INPUT_SIZE,
            "lesions": case.lesions,
            "case": case.spec.to_json(),
        }
        return CaseQuestion(split, i, case, finding, term, modality, meta, where=f"the {target['region']} of the image",
                            intro=f"This is a {modality.label}.",
                            common={"images": [case.image], "gold_boxes": [[float(v) for v in target["box"]]]})

    def _finding_mcq(self, about: CaseQuestion, letter: str, rng: random.Random) -> Task:
        """The finding, multiple choice: the image's other findings are the first distractors."""
        present = [les["finding"] for les in about.case.lesions[1:]]
        rest = [f.key for f in FINDINGS
                if f.modality == about.modality.key and f.key != about.finding.key and f.key not in present]
        distractors = (present + rng.sample(rest, len(rest)))[: len(LETTERS) - 1]
        rng.shuffle(distractors)  # which letters the distractors take says nothing about them
        options = self._options(letter, about.term.name, [self.terms[k].name for k in distractors])
        return Task(
            id=f"imaging-finding-mcq-{about.split}-{about.index:06d}",
            messages=[
                system_message("letter"),
                Message(role="user", content=f"{about.intro} What finding is present in {about.where}?\n"
                                             f"{option_listing(options)}"),
            ],
            answer=letter,
            options=options,
            references=[about.term.name],
            metadata={"task": "imaging_finding_mcq", **about.meta,
                      "distractor_hpo_ids": [self.terms[k].id for k in distractors]},
            **about.common,
        )

    @staticmethod
    def _finding_open(about: CaseQuestion) -> Task:
        term = about.term
        return Task(
            id=f"imaging-finding-open-{about.split}-{about.index:06d}",
            messages=[
                system_message("finding"),
                Message(role="user", content=f"{about.intro} What finding is present in {about.where}? "
                                             "Answer with the name of the finding."),
            ],
            answer=term.name,
            options=None,
            references=[term.name] + [s for s in term.synonyms if s.lower() != term.name.lower()],
            metadata={"task": "imaging_finding_open", **about.meta},
            **about.common,
        )

    def _condition_mcq(self, about: CaseQuestion, disease_id: str, letter: str, split: str,
                       rng: random.Random) -> Task:
        """Which condition the lesion is a recognised feature of: `disease_id` among others of the split."""
        from tasks.knowledge_base import name_variants

        distractor_ids = self._condition_distractors(about.finding, split, rng)
        disease = self.snapshot.diseases[disease_id]
        options = self._options(letter, disease.name, [self.snapshot.diseases[d].name for d in distractor_ids])
        return Task(
            id=f"imaging-condition-mcq-{split}-{about.index:06d}",
            messages=[
                system_message("letter"),
                Message(role="user", content=f"{about.intro} The lesion in {about.where} is a recognised feature of "
                                             f"which of these conditions?\n{option_listing(options)}"),
            ],
            answer=letter,
            options=options,
            references=name_variants(disease),
            metadata={"task": "imaging_condition_mcq", **about.meta, "disease_id": disease_id,
                      "kb_doc_ids": [f"term:{about.term.id}", f"disease:{disease_id}"],
                      "distractor_ids": distractor_ids},
            **about.common,
        )

    @staticmethod
    def _options(letter: str, answer: str, distractors: list[str]) -> dict[str, str]:
        others = iter(distractors)
        return {x: (answer if x == letter else next(others)) for x in LETTERS}

    def _split_diseases(self, finding_key: str, split: str) -> list[str]:
        return [d for d in self.linked[finding_key] if self.split_of.get(d) == split]

    def _next_answer(self, finding_key: str, split: str, pools: dict, rng: random.Random) -> str | None:
        """The finding's ``split`` diseases in a shuffled cycle (each once before any repeats); None if it has none."""
        candidates = self._split_diseases(finding_key, split)
        if not candidates:
            return None
        key = f"{finding_key}:{split}"
        if not pools.get(key):
            pools[key] = rng.sample(candidates, len(candidates))
        return pools[key].pop()

    def _condition_distractors(self, finding: Finding, split: str, rng: random.Random) -> list[str]:
        """3 ``split`` diseases not linked to the finding: preferably linked to another finding of the same image
        family, else to any other finding, else any disease of the split; distinct names."""
        excluded = set(self.linked[finding.key])
        pool = set(self.disease_split[split]) - excluded
        same = sorted({d for f in FINDINGS if f.modality == finding.modality for d in self.linked[f.key]} & pool)
        other = sorted(pool - set(same))
        picked: list[str] = []
        names = set()
        for group in (same, other):
            for d in rng.sample(group, len(group)):
                name = self.snapshot.diseases[d].name
                if len(picked) < len(LETTERS) - 1 and name not in names:
                    picked.append(d)
                    names.add(name)
        if len(picked) < len(LETTERS) - 1:
            raise ValueError(f"too few {split} diseases for distractors of {finding.key}")
        rng.shuffle(picked)
        return picked

    # ---- CDIR corpus ----

    def corpus_rows(self, cases: list[CaseResult]) -> Iterator[dict]:
        """Image-caption pairs of similar cases for test-time image re-retrieval: one caption per image naming every
        finding, its HPO term and its region."""
        for i, case in enumerate(cases):
            yield {
                "id": f"cdir-{i:06d}",
                "image": case.image,
                "caption": case_caption(case.spec.modality, case.lesions),
                "modality": case.spec.modality,
                "findings": case.lesions,
                "kb_doc_ids": [f"term:{les['hpo_id']}" for les in case.lesions],
            }


def case_caption(modality_key: str, lesions: list[dict]) -> str:
    """An image's caption as the CDIR corpus writes it: every lesion (as :meth:`Lesion.describe` gives it, e.g. a
    task's ``metadata["lesions"]``) with its size, HPO term, look and region."""
    label = MODALITIES[modality_key].label
    parts = [f"a {les['stratum']} {les['hpo_name'][0].lower() + les['hpo_name'][1:]} ({les['hpo_id']}), "
             f"{FINDINGS_BY_KEY[les['finding']].looks}, in the {les['region']} of the image" for les in lesions]
    return f"{label[0].upper() + label[1:]} showing " + "; ".join(parts) + "."


def render_and_save(spec: CaseSpec, out_dir: str | Path, relpath: str, hpo_ids: dict[str, str]) -> CaseResult:
    """Render a case, save it as PNG under ``out_dir/relpath`` and describe its lesions (boxes, regions, HPO ids)."""
    rendered = render_case(spec)
    path = Path(out_dir) / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rendered.image).save(path, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    lesions = [les.describe(hpo_ids[les.finding.key]) for les in rendered.lesions]
    return CaseResult(spec, relpath, lesions)


PNG_COMPRESS_LEVEL = 3
