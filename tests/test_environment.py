"""Multi-turn episodes on a real vLLM engine with a real retriever actor: masks, turn limits, budgets, faults."""
import os
import time

import pytest

from actors.environment import EpisodeRunner
from actors.episode import Episode
from actors.grammar import Grammar
from actors.retrieval_env import RetrievalEnvironment

pytestmark = pytest.mark.slow

DOCS = [{"id": f"d{i}#0", "doc_id": f"d{i}", "title": t, "text": f"{t} presents with {s}."}
        for i, (t, s) in enumerate([("Marfan syndrome", "tall stature and lens dislocation"),
                                    ("Gout", "joint pain and hyperuricemia"),
                                    ("Asthma", "wheezing and cough")])]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    llm = LLM(model=str(tiny_model_path), dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
              distributed_executor_backend="uni", enable_chunked_prefill=False, kv_cache_memory_bytes=2**28)
    return llm


@pytest.fixture(scope="module")
def retriever_cls(ray_session):
    import ray

    @ray.remote(max_restarts=2, max_task_retries=0)
    class WordOverlapRetriever:
        """A small real retriever: ranks documents by words shared with the query."""

        def __init__(self, delay_s: float = 0.0):
            self.delay_s = delay_s

        def search(self, queries, top_k):
            time.sleep(self.delay_s)
            ranked = []
            for q in queries:
                words = set(q.lower().split())
                ranked.append(sorted(DOCS, key=lambda d: -len(words & set(d["text"].lower().split())))[:top_k])
            return ranked
    return WordOverlapRetriever


def forced(tokenizer, token: str) -> dict:
    """Sampling that can only write `token`: a scripted policy on a real engine."""
    return {"temperature": 1.0, "max_tokens": 8, "allowed_token_ids": [tokenizer.convert_tokens_to_ids(token)]}


def episodes(engine, n=2):
    tok = engine.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tall with lens dislocation?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt += tok.encode("<query>tall lens dislocation", add_special_tokens=False)
    return [Episode(task={"id": "t"}, group=0, seed=i, prompt_ids=list(prompt)) for i in range(n)]


def test_masks_are_exact_and_turn_limit_holds(engine, retriever_cls):
    tok = engine.get_tokenizer()
    grammar = Grammar(action_tag="query", observation_tag="retrieve", max_turns=2)
    runner = EpisodeRunner(engine.llm_engine, tok, grammar, RetrievalEnvironment(retriever_cls.remote(), 1))
    eps = episodes(engine)
    stats = runner.run(eps, forced(tok, "</query>"))
    close = tok.convert_tokens_to_ids("</query>")
    for ep in eps:
        assert ep.finish_reason == "turn_limit" and len(ep.turns) == 2
        assert ep.turns[0]["chunks"][0]["doc_id"] == "d0"  # the Marfan document answers "tall lens dislocation"
        # policy tokens are exactly the three </query> it wrote; everything between is the environment's
        assert [t for t, m in zip(ep.response_ids, ep.loss_mask) if m] == [close] * 3
        assert sum(ep.loss_mask) == 3 and len(ep.logprobs) == len(ep.response_ids)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        text = tok.decode(ep.response_ids)
        assert text.count("<retrieve>") == 2 and "Marfan syndrome" in text
    assert stats["env_calls"] == 4 and stats["env_errors"] == 0


def test_token_budget_ends_the_episode(engine, retriever_cls):
    tok = engine.get_tokenizer()
    grammar = Grammar(action_tag="query", max_turns=5, max_response_tokens=20, max_observation_tokens=12)
    runner = EpisodeRunner(engine.llm_engine, tok, grammar, RetrievalEnvironment(retriever_cls.remote(), 1))
    eps = episodes(engine, n=1)
    runner.run(eps, forced(tok, "</query>"))
    assert eps[0].finish_reason == "budget" and len(eps[0].response_ids) <= 20


def test_single_turn_grammar_stops_at_answer(engine):
    tok = engine.get_tokenizer()
    runner = EpisodeRunner(engine.llm_engine, tok, Grammar())
    eps = episodes(engine, n=1)
    runner.run(eps, forced(tok, "</answer>"))
    assert eps[0].finish_reason == "stop" and eps[0].loss_mask == [1] and not eps[0].turns


def test_killed_retriever_does_not_lose_the_trajectory(engine, retriever_cls):
    import threading

    import ray
    tok = engine.get_tokenizer()
    retriever = retriever_cls.remote(delay_s=1.5)
    ray.get(retriever.search.remote([], 1))  # started
    runner = EpisodeRunner(engine.llm_engine, tok, Grammar(action_tag="query", max_turns=2),
                           RetrievalEnvironment(retriever, 3))
    eps = episodes(engine)
    threading.Timer(0.5, lambda: ray.kill(retriever, no_restart=False)).start()
    stats = runner.run(eps, forced(tok, "</query>"))
    for ep in eps:  # the failed call became an observation the policy can read, and the episode went on
        assert ep.finish_reason == "turn_limit" and len(ep.turns) == 2
        assert ep.turns[0]["error"] in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
        assert "retrieval failed" in tok.decode(ep.response_ids)
    assert stats["env_errors"] >= 2
    deadline = time.time() + 60
    while True:  # Ray restarts it; calls succeed again once it is back
        try:
            assert ray.get(retriever.search.remote(["joint pain"], 1))[0][0]["doc_id"] == "d1"
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.time() < deadline, "the retriever was not restarted"
            time.sleep(0.5)


def test_paging_returns_the_next_hits_of_a_query_already_searched():
    """retrieval.paging: the same query again (case and spacing aside) reads the next top_k hits, numbered on; another
    query starts at the first page; without paging a repeated query reads the first page again."""
    from actors.episode import Episode
    from actors.retrieval_env import RetrievalEnvironment
    hits = [{"id": i, "title": f"Disease {i}", "text": ""} for i in range(1, 7)]
    episode = Episode(task={"options": {"A": "Disease 4", "B": "Other"}}, group=0, seed=0, prompt_ids=[])
    env = RetrievalEnvironment(None, top_k=2, show="titles", link_options=True, paging=True)
    first = env.observe(episode, "fever, rash", hits, None)
    assert first.text == "[1] Disease 1\n[2] Disease 2" and first.record["page"] == 1
    episode.turns.append(first.record)
    second = env.observe(episode, "Fever,  Rash", hits, None)
    assert second.text == "[3] Disease 3\n[4] Disease 4 (option A)" and second.record["page"] == 2
    assert second.record["linked"] == ["A"]
    assert env.observe(episode, "seizures", hits, None).text.startswith("[1] Disease 1")
    plain = RetrievalEnvironment(None, top_k=2, show="titles")
    assert plain.observe(episode, "fever, rash", hits, None).text == "[1] Disease 1\n[2] Disease 2"
