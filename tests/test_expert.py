"""Scripted-expert demonstrations: the recipe's grammar, the real retriever's observation as a rollout shows it,
and the gold answer only when the retrieved text supports it."""
import json

from learners.config import load_config
from learners.data import read_demonstrations
from tasks.expert import phenotypes_of, write_demonstrations


def test_expert_demonstrations_follow_the_grammar_and_the_real_retriever(tiny_model_path, tmp_path):
    from actors.build_index import ensure_index
    from actors.environment import retrieval_text
    from actors.retriever import LocalRetriever
    from cluster.environments import default_index_dir
    from transformers import AutoTokenizer

    cfg = load_config("configs/quickstart.yaml")
    out = tmp_path / "demos.jsonl"
    report = write_demonstrations(cfg, "hpo:mcq_train", out, limit=40, progress=False)
    demos = read_demonstrations(out)  # the file an sft stage reads
    assert report["demonstrations"] == len(demos) > 0
    assert report["demonstrations"] + report["skipped_not_retrieved"] == 40

    g, r = cfg.rollout.grammar, cfg.retrieval
    retriever = LocalRetriever(default_index_dir(r.kb, r.index.kind, r.shards), config=r.search)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for demo in demos[:5]:
        task, (ask, observed, answer) = demo["task"], demo["segments"]
        assert [ask["role"], observed["role"], answer["role"]] == ["policy", "environment", "policy"]
        query = ask["text"].split("<query>")[1].split("</query>")[0]
        assert query.split("; ") == phenotypes_of(task)
        # exactly what RetrievalEnvironment + EpisodeRunner insert: the observation, wrapped and cut
        hits = retriever.search([query], g.top_k)[0]
        full = tok.encode(g.wrap_observation(retrieval_text(hits, None)), add_special_tokens=False)
        assert observed["text"] == tok.decode(full[:g.max_observation_tokens], skip_special_tokens=False)
        assert answer["text"].endswith(f"<answer>{task['answer']}</answer>")
        assert task["options"][task["answer"]] in observed["text"]  # the answer is read, not guessed
    assert json.loads(out.read_text().splitlines()[0])["task"]["id"].startswith("hpo-mcq-train")
