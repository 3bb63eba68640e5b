"""Phenotype-similarity search: Resnik's query-to-disease score by hand on a four-term ontology, queries parsed into
terms by name or synonym, and on the real HPO knowledge base real patients' diseases found where word overlap (BM25)
misses them. No Ray, no model."""
import json
import math
from pathlib import Path

import pytest

from actors.retriever import LocalRetriever
from indexing.build_index import default_index_dir, ensure_index
from indexing.phenotype_similarity import PhenotypeSimilarity
from indexing.retrieval_index import IndexConfig
from tasks.hpo import Disease, HPOSnapshot, Term
from tasks.phenopacket_tasks import ensure_phenopacket_tasks
from tasks.schema import read_tasks

FIXTURES = Path(__file__).parent / "fixtures" / "phenopackets"


def term(id_, name, parents=(), synonyms=()):
    return Term(id=id_, name=name, definition="", synonyms=list(synonyms), parents=list(parents), umls=[])


def disease(id_, *phenotypes):
    return Disease(id=id_, name=id_, source="OMIM", phenotypes=dict.fromkeys(phenotypes), excluded=[])


@pytest.fixture(scope="module")
def toy() -> PhenotypeSimilarity:
    """Root R; A under R and A1 under A; B and C under R. D1 is annotated A1, D2 B, D3 A."""
    terms = [term("R", "All"), term("A", "Seizure", ["R"], ["Epileptic seizure"]), term("A1", "Focal seizure", ["A"]),
             term("B", "Short stature", ["R"], ["Seizure"]), term("C", "Soft, doughy skin", ["R"])]
    diseases = [disease("D1", "A1"), disease("D2", "B"), disease("D3", "A")]
    return PhenotypeSimilarity.from_snapshot(HPOSnapshot(meta={}, terms={t.id: t for t in terms},
                                                         diseases={d.id: d for d in diseases}))


def test_a_disease_scores_the_information_its_annotations_share_with_each_query_term(toy):
    # closures: D1 {R, A, A1}, D2 {R, B}, D3 {R, A}; IC = -log(n_t / 3): R 0, A log 1.5, A1 and B log 3
    by_id = lambda scores: dict(zip(toy.disease_ids, scores.tolist()))
    assert by_id(toy.scores("Focal seizure")) == pytest.approx({"D1": math.log(3), "D2": 0.0, "D3": math.log(1.5)})
    # the mean over the query's terms: D3 shares A with the first and nothing with the second
    assert by_id(toy.scores("focal SEIZURE; short stature")) == pytest.approx(
        {"D1": math.log(3) / 2, "D2": math.log(3) / 2, "D3": math.log(1.5) / 2})


def test_a_query_is_read_as_term_names_and_synonyms(toy):
    columns = {t: i for i, t in enumerate(["A", "A1", "B", "C", "R"])}
    assert toy.terms_of("Epileptic seizure, focal seizure\nshort stature; no such finding") == \
        [columns["A"], columns["A1"], columns["B"]]
    assert toy.terms_of("soft, doughy skin; Seizure") == [columns["C"], columns["A"]]  # a name with a comma
    assert toy.terms_of("seizure") == [columns["A"]]  # a term's own name before another term's synonym
    assert toy.terms_of("Focal seizure; focal seizure") == [columns["A1"]]
    assert toy.scores("a child with fits") is None


def test_the_saved_search_loads_as_built(toy, tmp_path):
    toy.save(tmp_path / "similarity.npz")
    loaded = PhenotypeSimilarity.load(tmp_path / "similarity.npz")
    assert loaded.disease_ids == toy.disease_ids and loaded.names == toy.names
    assert loaded.scores("Focal seizure").tolist() == toy.scores("Focal seizure").tolist()


@pytest.fixture(scope="module")
def hpo_index() -> Path:
    """The quickstart's index: BM25 over the whole HPO knowledge base (built in seconds, cached)."""
    config = IndexConfig(kind="none")
    out = default_index_dir("hpo", config.kind, 1)
    ensure_index("hpo", out, None, config)
    return out


def test_real_patients_diseases_are_found_where_word_overlap_misses_them(hpo_index, tmp_path):
    paths = ensure_phenopacket_tasks(FIXTURES, root=tmp_path)
    tasks = [t for split in ("mcq_train", "mcq_test") for t in read_tasks(paths[split])]
    queries = ["; ".join(t.metadata["phenotype_names"]) for t in tasks]

    def found(mode: str) -> int:
        results = LocalRetriever(hpo_index, config={"mode": mode, "top_k": 10}).search(queries)
        return sum(t.metadata["kb_doc_id"] in {h["doc_id"] for h in hits} for t, hits in zip(tasks, results))

    by_phenotype, by_words = found("phenotype"), found("sparse")
    print(f"\n{len(tasks)} real cases, gold disease in the top 10: phenotype {by_phenotype}, BM25 {by_words}")
    assert by_phenotype > by_words


def test_a_query_naming_no_phenotype_is_searched_by_its_words(hpo_index):
    query = "which rare disease causes webbed neck and heart defects"
    phenotype = LocalRetriever(hpo_index, config={"mode": "phenotype", "top_k": 5}).search([query])
    assert phenotype == LocalRetriever(hpo_index, config={"mode": "sparse", "top_k": 5}).search([query])
    hits = LocalRetriever(hpo_index, config={"mode": "phenotype", "top_k": 5}).search(["Webbed neck; Short stature"])[0]
    assert len(hits) == 5 and all(h["doc_id"].startswith("disease:") and h["id"].endswith("#0") for h in hits)


def test_phenotype_search_needs_the_hpo_knowledge_base(tmp_path):
    from learners.config import RetrievalSection
    with pytest.raises(ValueError, match="search.mode 'phenotype' ranks the HPO world's diseases; kb is"):
        RetrievalSection(kb=str(tmp_path / "chunks.jsonl"), search={"mode": "phenotype"})
    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text(json.dumps({"id": "note#0", "doc_id": "note", "title": "A note", "text": "Seizure.",
                                  "source": "test"}) + "\n")
    ensure_index(str(chunks), tmp_path / "index", None, IndexConfig(kind="none"))
    with pytest.raises(ValueError, match="holds no disease:<id> document"):
        LocalRetriever(tmp_path / "index", config={"mode": "phenotype"})


def test_each_shard_ranks_the_diseases_it_holds(tmp_path):
    """A sharded index of the HPO knowledge base: a shard without disease documents answers with no hits."""
    nf1 = {"id": "disease:OMIM:162200#0", "doc_id": "disease:OMIM:162200", "title": "Neurofibromatosis, type 1",
           "text": "Neurofibromatosis, type 1.", "source": "test"}
    note = {"id": "note#0", "doc_id": "note", "title": "A note", "text": "Seizure.", "source": "test"}
    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text("".join(json.dumps(c) + "\n" for c in (nf1, note)))
    ensure_index(str(chunks), tmp_path / "index", None, IndexConfig(kind="none"), shards=2)
    found = [LocalRetriever(shard, config={"mode": "phenotype"}).search(["Multiple cafe-au-lait spots"])[0]
             for shard in sorted((tmp_path / "index").glob("shard-*"))]
    assert [[h["doc_id"] for h in hits] for hits in found] == [["disease:OMIM:162200"], []]


@pytest.mark.parametrize("mode", ["phenotype", "sparse"])
def test_a_search_among_the_options_ranks_them_however_deep_in_the_order_of_the_whole_ranking(hpo_index, mode):
    query = "Microcephaly; Global developmental delay; Infantile spasms; Hypsarrhythmia"
    retriever = LocalRetriever(hpo_index, config={"mode": mode, "top_k": 3})
    ranked = retriever.search([query], 3000)[0]
    deep = [h["title"] for h in ranked]
    options = [deep[2500], deep[40], "No such disease", deep[700]]
    hits = retriever.search([query, query], 3, [options, None])
    assert [h for h in hits[0] if not h.get("candidate")] == hits[1]  # the hits as a search without candidates
    assert [h["score"] for h in hits[1]] == [h["score"] for h in ranked[:3]]
    # the named documents the search scores, in its order, after the top 3; unknown titles drop out
    assert [h["title"] for h in hits[0] if h.get("candidate")] == [deep[40], deep[700], deep[2500]]
    assert retriever.search([query], 3, [options]) == [hits[0]]  # cached with its candidates, not without


def test_shards_merge_their_candidates_after_the_global_top_k():
    from actors.retriever import merge_shard_results
    hit = lambda id_, score, candidate=False: {"id": id_, "score": score, **({"candidate": True} if candidate else {})}
    shard1 = [[hit("a", 5.0), hit("b", 4.0), hit("x", 0.5, True)]]
    shard2 = [[hit("c", 4.5), hit("y", 1.0, True)]]
    assert [h["id"] for h in merge_shard_results([shard1, shard2], 2)[0]] == ["a", "c", "y", "x"]


def test_candidates_need_sparse_or_phenotype_search():
    from learners.config import RetrievalSection
    with pytest.raises(ValueError, match="rank_options ranks the options a search links: it needs link_options"):
        RetrievalSection(rank_options=True)
    with pytest.raises(ValueError, match=r"search.mode sparse or phenotype \(not 'dense'\)"):
        RetrievalSection(rank_options=True, link_options=True, index={"kind": "flat"}, search={"mode": "dense"})
