"""Retrieval over the real HPO knowledge base with the real all-MiniLM-L6-v2 encoder.

The index covers a slice of the knowledge base: for the first 40 held-out test MCQ tasks, the answer disease's
document, the three distractor diseases' documents (hard negatives: they share phenotypes) and the HPO term document of
every phenotype in the question (~360 chunks). A query is the question's phenotype names, as a policy would search.
Encoding that slice takes 1-2 min on 2 busy CPU threads, so the index is cached under ``$MEDRAY_CACHE/test_indexes``
and rebuilt only when the corpus, the encoder or the index settings change (what ``ensure_index`` checks).
"""

import json
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from indexing.build_index import ensure_index, read_chunks
from indexing.encoders import load_encoder
from indexing.retrieval_index import IndexConfig, IndexMismatchError, read_manifest, write_index
from actors.retriever import (LocalRetriever, ShardedRetriever, merge_shard_results, reciprocal_rank_fusion,
                              weighted_fusion)
from tasks.build_hpo import ensure_hpo_world
from cluster.files import cache_dir
from tasks.schema import read_tasks

N_TASKS = 40
#: recall@5 of the answer disease's document; measured 0.55 / 1.00 / 1.00 (dense / sparse / hybrid).
RECALL_AT_5_FLOOR = {"dense": 0.35, "sparse": 0.9, "hybrid": 0.85}


def phenotype_query(task) -> str:
    """The question's phenotypes, 'A; B; C', as a policy would search them."""
    return "; ".join(task.metadata["phenotype_names"])


@pytest.fixture(scope="session")
def world() -> dict[str, Path]:
    return ensure_hpo_world(cache_dir() / "hpo_world", seed=0)


@pytest.fixture(scope="session")
def tasks(world) -> list:
    return read_tasks(world["mcq_test"])[:N_TASKS]


@pytest.fixture(scope="session")
def queries(tasks) -> list[str]:
    return [phenotype_query(t) for t in tasks]


@pytest.fixture(scope="session")
def subset_kb(world, tasks, tmp_path_factory) -> Path:
    """The slice of the knowledge base described above, in knowledge-base order (so its checksum is stable)."""
    wanted = set()
    for task in tasks:
        meta = task.metadata
        wanted |= {meta["kb_doc_id"], *(f"disease:{d}" for d in meta["distractor_ids"]),
                   *(f"term:{h}" for h in meta["phenotype_ids"])}
    path = tmp_path_factory.mktemp("kb") / "chunks.jsonl"
    with open(world["kb"], encoding="utf-8") as src, open(path, "w", encoding="utf-8") as out:
        out.writelines(line for line in src if json.loads(line)["doc_id"] in wanted)
    return path


@pytest.fixture(scope="session")
def encoder():
    return load_encoder("minilm")


@pytest.fixture(scope="session")
def index_dir(subset_kb, encoder) -> Path:
    out = cache_dir() / "test_indexes" / f"hpo-test{N_TASKS}-flat"
    manifest = ensure_index(subset_kb, out, encoder)
    print(f"\ntest index: {manifest['corpus']['chunks']} chunks; encoded at {manifest['encoding']['chunks_per_s']} "
          f"chunks/s ({manifest['encoding']['threads']} threads) when built")
    return out


@pytest.fixture(scope="session")
def vectors(index_dir) -> np.ndarray:
    """The embeddings in the flat index, read back (so other index kinds and shardings need no re-encoding)."""
    index = faiss.read_index(str(index_dir / "dense.faiss"))
    return index.reconstruct_n(0, index.ntotal)


@pytest.fixture(scope="session")
def sharded_dir(index_dir, subset_kb, vectors, encoder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "index"
    write_index(out, read_chunks(subset_kb), vectors, encoder_identity=encoder.identity,
                corpus=read_manifest(index_dir)["corpus"], config=IndexConfig(), shards=2, progress=False)
    return out


@pytest.mark.parametrize("mode", ["dense", "sparse", "hybrid"])
def test_phenotype_query_finds_its_disease(mode, index_dir, encoder, tasks, queries):
    retriever = LocalRetriever(index_dir, encoder=encoder, config={"mode": mode})
    results = retriever.search(queries, top_k=5)
    assert all(len(hits) == 5 for hits in results) or mode == "sparse"  # BM25 returns only chunks sharing a word
    found = [t.metadata["kb_doc_id"] in {hit["doc_id"] for hit in hits} for t, hits in zip(tasks, results)]
    recall = sum(found) / len(found)
    print(f"\nrecall@5 ({mode}) on {len(found)} held-out test diseases: {recall:.3f}")
    assert recall >= RECALL_AT_5_FLOOR[mode]


def test_hits_are_ranked_records_and_repeated_queries_come_from_the_cache(index_dir, encoder, queries):
    retriever = LocalRetriever(index_dir, encoder=encoder, config={"top_k": 3})
    first = retriever.search(queries[:4])
    hit = first[0][0]
    assert set(hit) == {"id", "doc_id", "title", "text", "score"} and hit["id"].startswith(hit["doc_id"] + "#")
    assert all([h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True) for hits in first)
    again = retriever.search([queries[1], queries[1], queries[0]])
    assert again == [first[1], first[1], first[0]]
    stats = retriever.stats()  # a query repeated within a batch is looked up once
    assert (stats["queries"], stats["cache_hits"], stats["cache_misses"]) == (7, 2, 4)


def test_index_built_with_another_encoder_is_refused(index_dir, tmp_path):
    """A different model (here a tiny random BERT) and the same model with another truncation are both refused."""
    from transformers import BertConfig, BertModel

    other = tmp_path / "tiny-bert"
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertModel(config).save_pretrained(other)
    load_encoder("minilm").tokenizer.save_pretrained(other)
    with pytest.raises(IndexMismatchError, match=r"built with encoder .* but the given encoder is tiny-bert"):
        LocalRetriever(index_dir, encoder=str(other))
    with pytest.raises(IndexMismatchError, match=r"max_length=256\).*max_length=128"):
        LocalRetriever(index_dir, encoder=load_encoder("minilm", max_length=128))


def test_index_built_from_another_corpus_is_refused(index_dir, subset_kb, encoder, tmp_path):
    LocalRetriever(index_dir, encoder=encoder, corpus=str(subset_kb))  # the right corpus loads
    changed = tmp_path / "chunks.jsonl"
    changed.write_text("".join(subset_kb.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(IndexMismatchError, match="was built from corpus .* but the given corpus"):
        LocalRetriever(index_dir, encoder=encoder, corpus=str(changed))


def test_merged_shards_equal_the_unsharded_index(index_dir, sharded_dir, encoder, queries):
    config = {"mode": "dense", "top_k": 8}
    whole = LocalRetriever(index_dir, encoder=encoder, config=config).search(queries)
    shards = [LocalRetriever(d, encoder=encoder, config=config) for d in sorted(sharded_dir.glob("shard-*"))]
    assert len(shards) == 2 and sum(len(s.docs) for s in shards) == len(LocalRetriever(index_dir, encoder=encoder).docs)
    merged = merge_shard_results([shard.search(queries) for shard in shards], top_k=8)
    assert [[h["id"] for h in hits] for hits in merged] == [[h["id"] for h in hits] for hits in whole]
    np.testing.assert_allclose([[h["score"] for h in hits] for hits in merged],
                               [[h["score"] for h in hits] for hits in whole], rtol=1e-5)


@pytest.mark.parametrize("kind", ["hnsw", "ivfpq"])
def test_approximate_indexes_agree_with_exact_search(kind, index_dir, subset_kb, vectors, encoder, queries, tmp_path):
    write_index(tmp_path / kind, read_chunks(subset_kb), vectors, encoder_identity=encoder.identity,
                corpus=read_manifest(index_dir)["corpus"], config=IndexConfig(kind=kind), progress=False)
    config = {"mode": "dense", "top_k": 5}
    exact = LocalRetriever(index_dir, encoder=encoder, config=config).search(queries)
    approximate = LocalRetriever(tmp_path / kind, encoder=encoder, config=config).search(queries)
    overlap = np.mean([len({h["id"] for h in a} & {h["id"] for h in e}) / 5 for a, e in zip(approximate, exact)])
    assert overlap >= 0.9


def test_fusion():
    dense = [(1, 0.9), (2, 0.8), (3, 0.1)]
    sparse = [(3, 12.0), (1, 4.0)]
    assert [row for row, _ in reciprocal_rank_fusion([dense, sparse], rrf_k=60)] == [1, 3, 2]
    fused = dict(weighted_fusion([dense, sparse], [0.5, 0.5]))
    assert fused[3] == pytest.approx(0.5) and fused[1] == pytest.approx(0.5) and fused[2] == pytest.approx(0.4375)
    assert [row for row, _ in weighted_fusion([dense, sparse], [0.2, 0.8])] == [3, 1, 2]


def test_build_command_writes_a_loadable_index(subset_kb, encoder, tmp_path):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(subset_kb.read_text().splitlines(keepends=True)[:24]))
    out = tmp_path / "index"
    cmd = [sys.executable, "-m", "indexing.build_index", "--kb", str(small), "--out", str(out), "--index", "hnsw",
           "--threads", "1", "--ef-search", "64"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert "encoding" in done.stderr and "wrote" in done.stdout  # tqdm progress bar on stderr, summary on stdout
    manifest = read_manifest(out)
    assert manifest["corpus"]["chunks"] == 24 and manifest["index"]["kind"] == "hnsw"
    assert manifest["index"]["ef_search"] == 64 and manifest["encoder"]["checksum"] == encoder.checksum
    first = read_chunks(small)[0]
    hits = LocalRetriever(out, corpus=str(small), config={"mode": "dense"}).search([first["text"]], top_k=1)
    assert hits[0][0]["id"] == first["id"]


@pytest.mark.slow
def test_sharded_actors_answer_a_batch_and_survive_a_crash(ray_session, index_dir, sharded_dir, encoder, queries):
    """One Retriever actor per shard (the local Ray of conftest's ray_session); a killed shard is restarted by Ray."""
    config = {"mode": "dense", "top_k": 5}
    expected = LocalRetriever(index_dir, encoder=encoder, config=config).search(queries[:6])
    retriever = ShardedRetriever(sharded_dir, config=config, actor_options={"num_cpus": 0.5})
    batch = queries[:6] + queries[:2]
    assert _ids(retriever.search(batch)) == _ids(expected + expected[:2])
    ray_session.kill(retriever.actors[0], no_restart=False)  # Ray restarts it (max_restarts) and retries the search
    assert _ids(retriever.search(queries[:6])) == _ids(expected)
    assert [s["shard"]["index"] for s in retriever.stats()] == [0, 1]


def _ids(results: list[list[dict]]) -> list[list[str]]:
    return [[hit["id"] for hit in hits] for hits in results]
