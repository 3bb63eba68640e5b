"""Serving what a run trained: the served agent takes its grammar, index, search mode and hit presentation from the
run that wrote the checkpoint, shows hits exactly as training did, and a deployment that cannot start is refused by
the app builder, naming its cause, before any replica starts."""
import asyncio
import json
import shutil

import pytest
import yaml

from actors.episode import Episode, Generation
from actors.grammar import Grammar
from actors.retrieval_env import RetrievalEnvironment
from learners.expert import cut_observation
from tasks.schema import option_listing, parse_option_listing

KEY = "test-key-0123456789"
OPTIONS = {"A": "Gout", "B": "Marfan syndrome", "C": "Cystic fibrosis", "D": "Down syndrome"}
HITS = [{"id": "marfan#0", "doc_id": "marfan", "title": "Marfan syndrome", "text": "Tall stature, ectopia lentis."},
        {"id": "homo#0", "doc_id": "homo", "title": "Homocystinuria", "text": "Lens dislocation, marfanoid habitus."}]
KB = [("marfan", "Marfan syndrome", "Marfan syndrome: tall stature, arachnodactyly and ectopia lentis."),
      ("cf", "Cystic fibrosis", "Cystic fibrosis: recurrent lung infections and salty sweat.")]


def scripted(tokenizer, text: str) -> Generation:
    """A policy turn as the engine returns it, stopped by the tag it closes."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Generation(text, ids, [0.0] * len(ids), "stop", text[text.rindex("</"):])


def test_option_listing_round_trips_through_a_question():
    question = f"A patient has arachnodactyly. Which disease?\n{option_listing(OPTIONS)}"
    assert parse_option_listing(question) == OPTIONS
    assert parse_option_listing("A. lonely line") == {} and parse_option_listing("no options") == {}


@pytest.mark.parametrize("show,link,chars",
                         [("titles", True, None), ("passages", False, None), ("passages", False, 16)])
def test_the_same_hits_read_the_same_in_training_the_expert_and_serving(tiny_model_path, show, link, chars):
    from transformers import AutoTokenizer

    from serve.agent import retrieval_observer, run_agent

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    grammar = Grammar(action_tag="query", observation_tag="retrieve", max_turns=1, max_observation_tokens=64)
    task = {"options": OPTIONS, "answer": "B"}
    # training and evaluation: the rollout workers' RetrievalEnvironment
    env = RetrievalEnvironment(None, top_k=2, show=show, link_options=link, passage_chars=chars)
    trained = env.observe(Episode(task=task, group=0, seed=0, prompt_ids=[1]), "tall", HITS, None).text
    expected = cut_observation(grammar, trained, tokenizer)  # what the engine inserts (the expert's demonstrations too)
    if link:
        assert "[1] Marfan syndrome (option B)" in trained and "Homocystinuria" in trained
    if chars:  # passages cut at a word, each hit still shown
        assert "[1] Marfan syndrome: Tall stature, ...\n[2] Homocystinuria: Lens ..." in trained

    turns = iter(["<query>tall</query>", "<answer>B</answer>"])

    async def generate(prompt, budget, stops, seed):  # the policy's two turns, scripted
        return scripted(tokenizer, next(turns))

    async def search(queries, top_k):
        return [HITS[:top_k]]

    observe = retrieval_observer(search, env, 5, options=parse_option_listing(option_listing(OPTIONS)))
    served = asyncio.run(run_agent(generate, observe, tokenizer, grammar, [1], max_tokens=64, max_model_len=512,
                                   stop=[], seed=0, timeout_s=5))
    assert served.answer == "B"
    assert served.transcript == "<query>tall</query>" + expected + "<answer>B</answer>"
    # one turn record: training's (query, error, chunks; linked with link_options)
    assert served.turns == [env.observe(Episode(task=task, group=0, seed=0, prompt_ids=[1]), "tall", HITS, None).record]


def test_served_paging_is_training_paging(tiny_model_path):
    """retrieval.paging: a repeated query returns the next top_k hits, served as in training (the same environment
    decides the depth searched, the hits shown, their numbering and the turn records)."""
    from transformers import AutoTokenizer

    from serve.agent import retrieval_observer, run_agent
    from serve.config import AgentSettings, agent_from_run, retrieval_environment

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    grammar = Grammar(action_tag="query", observation_tag="retrieve", max_turns=2, max_observation_tokens=64)
    agent = agent_from_run(AgentSettings(index_dir="index"), {"retrieval": {"paging": True, "search": {"top_k": 1}}})
    env = retrieval_environment(agent, agent.retrieval["top_k"])
    assert (env.paging, env.top_k, env.show) == (True, 1, "passages")  # unset: training's default
    places = agent_from_run(AgentSettings(index_dir="index"), {"retrieval": {"link_options": True,
                                                                           "rank_options": "places"}})
    assert retrieval_environment(places, 1).rank_options == "places"  # the ranking's style travels too
    asked = []
    turns = iter(["<query>tall</query>", "<query>Tall </query>", "<answer>B</answer>"])

    async def generate(prompt, budget, stops, seed):
        return scripted(tokenizer, next(turns))

    async def search(queries, top_k):
        asked.append(top_k)
        return [HITS[:top_k]]

    served = asyncio.run(run_agent(generate, retrieval_observer(search, env, 5), tokenizer, grammar, [1],
                                   max_tokens=64, max_model_len=512, stop=[], seed=0, timeout_s=5))
    episode = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    for query in ("tall", "Tall"):
        episode.turns.append(env.observe(episode, query, HITS, None).record)
    assert asked == [1, 2] and served.turns == episode.turns
    assert [t["page"] for t in served.turns] == [1, 2] and served.turns[1]["chunks"][0]["id"] == "homo#0"
    assert "[2] Homocystinuria" in served.transcript


# ---------------------------------------------------------------- the settings a run leaves with its checkpoint -----

@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    from indexing.build_index import build_index
    from indexing.retrieval_index import IndexConfig

    work = tmp_path_factory.mktemp("kb")
    kb = work / "kb.jsonl"
    kb.write_text("".join(json.dumps({"id": f"{d}#0", "doc_id": d, "title": t, "text": x, "source": "test"}) + "\n"
                          for d, t, x in KB))
    build_index(kb, work / "index", config=IndexConfig(kind="none"), progress=False)
    return work / "index"


@pytest.fixture
def trained(tmp_path, tiny_model_path, bm25_index):
    """A checkpoint as a run leaves it: weights plus the run's resolved config (titles with option links, BM25)."""
    from learners.config import load_config

    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(tiny_model_path, checkpoint)
    cfg = load_config("configs/quickstart.yaml", [f"retrieval.index_dir={bm25_index}", "retrieval.search.top_k=4",
                                                 "retrieval.search.mode=sparse"])
    (checkpoint / "run.yaml").write_text(yaml.safe_dump(cfg.dump()))
    return checkpoint


def resolved(**args):
    from serve.config import ServeSettings
    from serve.app import nest_dotted
    return ServeSettings.model_validate(nest_dotted({"api_key": KEY, **args})).resolved()


def test_agent_mode_follows_the_run_that_wrote_the_checkpoint(trained, bm25_index):
    agent = resolved(checkpoint=str(trained)).agent
    assert agent.enabled and agent.index_dir == str(bm25_index.resolve())
    assert (agent.show, agent.link_options) == ("titles", True)
    assert agent.grammar.action_tag == "query" and agent.retrieval["top_k"] == 4  # the run's search setting
    assert agent.grammar.max_observation_tokens == 224  # the quickstart's
    assert agent.retrieval["mode"] == "sparse"
    # explicit settings override the run's
    agent = resolved(checkpoint=str(trained), **{"agent.show": "passages", "agent.link_options": "false",
                                                 "agent.passage_chars": "200"}).agent
    assert (agent.show, agent.link_options, agent.passage_chars) == ("passages", False, 200)
    assert resolved(checkpoint=str(trained), **{"agent.enabled": "false"}).agent.enabled is False


def test_documents_per_query_are_the_search_setting_even_for_a_run_that_kept_them_in_its_grammar():
    """retrieval.search.top_k is the one setting; a run written while the grammar had a top_k key still serves."""
    from serve.config import AgentSettings, agent_from_run

    run = {"retrieval": {"index_dir": "/idx", "search": {"mode": "sparse", "top_k": 4}},
           "rollout": {"grammar": {"action_tag": "query", "observation_tag": "retrieve", "top_k": 4}}}
    agent = agent_from_run(AgentSettings(), run)
    assert agent.retrieval == {"mode": "sparse", "top_k": 4} and agent.grammar.action_tag == "query"
    assert agent_from_run(AgentSettings(retrieval={"top_k": 2}), run).retrieval == {"top_k": 2}
    assert agent_from_run(AgentSettings(retrieval={"mode": "sparse"}), run).retrieval == {"top_k": 4, "mode": "sparse"}
    with pytest.raises(ValueError, match=r"top_k is not a grammar key.*retrieval.search.top_k"):
        AgentSettings.model_validate({"grammar": {"action_tag": "query", "top_k": 3}})


def test_a_bm25_index_is_searched_sparse_unless_another_mode_is_asked_for(tiny_model_path, bm25_index):
    assert resolved(checkpoint=str(tiny_model_path), **{"agent.index_dir": str(bm25_index)}).agent.retrieval[
        "mode"] == "sparse"
    with pytest.raises(ValueError, match=r"agent.index_dir: .* sparse-only index .* cannot serve search mode 'hybrid'"):
        resolved(checkpoint=str(tiny_model_path), **{"agent.index_dir": str(bm25_index),
                                                     "agent.retrieval": {"mode": "hybrid"}})


def test_deployments_that_cannot_start_are_refused_naming_the_cause(trained, bm25_index, tmp_path, tiny_model_path,
                                                                    monkeypatch):
    from serve.app import app

    ok = trained.parent / "step_3"
    shutil.copytree(trained, ok)
    from cluster.files import sha256_file
    (ok / "manifest.json").write_text(json.dumps({"step": 3, "files": {
        name: sha256_file(ok / name) for name in ("config.json", "model.safetensors")}}))
    resolved(checkpoint=str(ok))  # a verified checkpoint passes

    damaged = trained.parent / "step_4"
    shutil.copytree(ok, damaged)
    with open(damaged / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ValueError, match="step_4 is damaged: model.safetensors does not match its checksum"):
        resolved(checkpoint=str(damaged))

    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        resolved(checkpoint=str(tmp_path / "missing"))

    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="is a bert model .BertModel., not a generative language model"):
        resolved(checkpoint=str(encoder))

    broken_index = tmp_path / "index"
    broken_index.mkdir()
    (broken_index / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="agent.index_dir: .* not a readable index manifest"):
        resolved(checkpoint=str(tiny_model_path), **{"agent.index_dir": str(broken_index)})
    with pytest.raises(ValueError, match="agent.index_dir: .* is not a retrieval index"):
        resolved(checkpoint=str(tiny_model_path), **{"agent.index_dir": str(tmp_path)})
    # a run that searched sparse reads no dense vectors, yet its index is checked all the same
    with pytest.raises(ValueError, match="agent.index_dir: .*nowhere is not a retrieval index"):
        resolved(checkpoint=str(trained), **{"agent.index_dir": str(tmp_path / "nowhere")})
    partial = tmp_path / "partial"
    shutil.copytree(bm25_index, partial)
    shutil.rmtree(partial / "bm25")
    with pytest.raises(ValueError, match="agent.index_dir: index .*partial has no bm25; rebuild it"):
        resolved(checkpoint=str(trained), **{"agent.index_dir": str(partial)})
    with pytest.raises(ValueError, match="limits.image_roots: .*nowhere is not a directory"):
        resolved(checkpoint=str(ok), **{"limits.image_roots": [str(tmp_path / "nowhere")]})

    monkeypatch.delenv("MEDRAY_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        app({"checkpoint": str(ok)})


@pytest.mark.slow
@pytest.mark.parametrize("what", ["checkpoint", "index"])
def test_serve_run_exits_at_once_with_the_cause(what, trained, tmp_path):
    """The command users type: a checkpoint that is not a model, or an index that is not there, stops `serve run`
    within seconds with a non-zero status, the cause on its console, before any replica starts."""
    import os
    import subprocess
    import sys
    import time

    args, cause = {
        "checkpoint": ([f"checkpoint={tmp_path}"], "not a Hugging Face model directory (no config.json)"),
        "index": ([f"checkpoint={trained}", f"agent.index_dir={tmp_path / 'index'}"],
                  f"agent.index_dir: {tmp_path / 'index'} is not a retrieval index (no manifest.json)")}[what]
    started = time.monotonic()
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "serve"), "run", "serve.app:app", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEDRAY_API_KEY": KEY, "RAY_ADDRESS": ""})
    assert proc.returncode != 0
    assert cause in proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
