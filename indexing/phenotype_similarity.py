"""Phenotype-similarity search over the HPO world's diseases (`retrieval.search.mode: phenotype`).

A query names phenotypes: HPO term names or synonyms, separated by ';' or new lines (or ',' where a part is no name
itself: some names hold a comma), in any case. Each disease
scores the mean, over the query's terms, of the information content of the most informative ancestor the term shares
with any of the disease's annotations (Resnik similarity in Phenomizer's query-to-disease direction, Köhler et al.,
Am J Hum Genet 2009):

    sim(Q -> D) = 1/|Q| * sum_{q in Q} max_{a in D} IC(MICA(q, a)),    IC(t) = -log(n_t / n)

with n_t the diseases annotated with t or a descendant of t, n all diseases, MICA the most informative common
ancestor (a term is its own ancestor). A patient's term more specific or more general than the disease's annotation
still earns what the two share, where word overlap (BM25) earns nothing for different words.
"""
from __future__ import annotations

import json
import re

import numpy as np
import scipy.sparse as sp

from cluster.files import file_lock
from tasks.hpo import HPOSnapshot, load_hpo_snapshot, snapshot_path

FORMAT = 1  # bump when what is saved changes
SEPARATORS = re.compile(r"[;\n]")


def information_content(closure: sp.csc_matrix) -> np.ndarray:
    """IC(t) = -log(n_t / n) for every term column of the diseases x terms `closure` (1 where the disease is
    annotated with the term or a descendant); a term no disease reaches gets the largest IC, -log(1 / n)."""
    reached = np.asarray(closure.sum(axis=0)).ravel()
    return -np.log(np.maximum(reached, 1) / closure.shape[0]).astype(np.float32)


def query_to_disease(query: list[int], ancestors: sp.csr_matrix, closure: sp.csc_matrix,
                     ic: np.ndarray) -> np.ndarray:
    """sim(Q -> D) of every disease (row of `closure`) for the query terms `query` (columns); `ancestors` has a row
    per term holding the term and all its ancestors."""
    score = np.zeros(closure.shape[0], dtype=np.float32)
    for term in query:
        best = np.zeros_like(score)
        for ancestor in ancestors.indices[ancestors.indptr[term]:ancestors.indptr[term + 1]]:
            if ic[ancestor] > 0:  # the root (IC 0) adds nothing
                rows = closure.indices[closure.indptr[ancestor]:closure.indptr[ancestor + 1]]
                best[rows] = np.maximum(best[rows], ic[ancestor])
        score += best
    return score / max(len(query), 1)


class PhenotypeSimilarity:
    """The HPO world's terms, their ancestors, every disease's annotation closure and each term's IC."""

    def __init__(self, disease_ids: list[str], names: dict[str, int], ancestors: sp.csr_matrix,
                 closure: sp.csc_matrix, ic: np.ndarray):
        self.disease_ids, self.names, self.ancestors, self.closure, self.ic = \
            disease_ids, names, ancestors, closure, ic

    @classmethod
    def from_snapshot(cls, snapshot: HPOSnapshot) -> PhenotypeSimilarity:
        terms = sorted(snapshot.terms)
        column = {t: i for i, t in enumerate(terms)}
        up = {t: [column[a] for a in sorted(snapshot.ancestors(t) | {t}) if a in column] for t in terms}
        ancestors = _binary([up[t] for t in terms], len(terms)).tocsr()
        diseases = sorted(snapshot.diseases)
        closure = _binary([sorted({a for h in snapshot.diseases[d].phenotypes if h in up for a in up[h]})
                           for d in diseases], len(terms)).tocsc()
        names: dict[str, int] = {}
        for synonyms in (False, True):  # a term's own name wins over another term's synonym
            for t in terms:
                for name in snapshot.terms[t].synonyms if synonyms else [snapshot.terms[t].name]:
                    names.setdefault(name.strip().lower(), column[t])
        return cls(diseases, names, ancestors, closure, information_content(closure))

    def terms_of(self, query: str) -> list[int]:
        """The query's parts that name a term (name or synonym), as term columns, each once, in query order; a part
        that names none is read as a comma-separated list."""
        parts = [part.strip().lower() for part in SEPARATORS.split(query)]
        found = (self.names.get(name) for part in parts
                 for name in ([part] if part in self.names else [p.strip() for p in part.split(",")]))
        return list(dict.fromkeys(t for t in found if t is not None))

    def restricted_to(self, keep: list[int]) -> PhenotypeSimilarity:
        """The same search over the diseases `keep` (row indices), each term's IC unchanged."""
        return PhenotypeSimilarity([self.disease_ids[i] for i in keep], self.names, self.ancestors,
                                   self.closure[keep].tocsc(), self.ic)

    def scores(self, query: str) -> np.ndarray | None:
        """sim(Q -> D) for every disease, or None when no part of `query` names a term."""
        terms = self.terms_of(query)
        return query_to_disease(terms, self.ancestors, self.closure, self.ic) if terms else None

    def save(self, path) -> None:
        arrays = {f"{name}_{part}": getattr(matrix, part) for name, matrix in
                  (("ancestors", self.ancestors), ("closure", self.closure)) for part in ("data", "indices", "indptr")}
        np.savez(path, **arrays, ic=self.ic, shapes=np.array([self.ancestors.shape, self.closure.shape]),
                 meta=np.array(json.dumps({"format": FORMAT, "diseases": self.disease_ids, "names": self.names})))

    @classmethod
    def load(cls, path) -> PhenotypeSimilarity:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            shapes = f["shapes"]
            ancestors = sp.csr_matrix((f["ancestors_data"], f["ancestors_indices"], f["ancestors_indptr"]),
                                      shape=tuple(shapes[0]))
            closure = sp.csc_matrix((f["closure_data"], f["closure_indices"], f["closure_indptr"]),
                                    shape=tuple(shapes[1]))
            return cls(meta["diseases"], meta["names"], ancestors, closure, f["ic"])


def ensure_phenotype_similarity() -> PhenotypeSimilarity:
    """The search data of the cached HPO snapshot, derived from it once and cached beside it."""
    path = snapshot_path().with_name(f"phenotype-similarity-v{FORMAT}.npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if not path.exists():
            partial = path.with_name(f".{path.stem}.partial.npz")
            PhenotypeSimilarity.from_snapshot(load_hpo_snapshot()).save(partial)
            partial.replace(path)
    return PhenotypeSimilarity.load(path)


def _binary(rows: list[list[int]], columns: int) -> sp.coo_matrix:
    """A 0/1 float32 matrix with a 1 at each (row, column) listed."""
    r = np.repeat(np.arange(len(rows)), [len(cols) for cols in rows])
    c = np.fromiter((col for cols in rows for col in cols), dtype=np.int64, count=len(r))
    return sp.coo_matrix((np.ones(len(r), dtype=np.float32), (r, c)), shape=(len(rows), columns))
