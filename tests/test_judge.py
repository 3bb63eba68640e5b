"""The LLM judge (actors/judge.py) and Med-R3's judge-based rewards (rewards/judge.py).

- the formulas against numbers worked out by hand from the Med-R3 paper (no Ray);
- the strict parsers and the bounded retry loop on malformed outputs (no Ray);
- the openai backend: a real JudgeActor with the stock `openai` client against a stdlib HTTP server on loopback that
  serves /v1/chat/completions with scripted replies, malformed ones included;
- slow: the vllm backend on the tiny random model behind a RewardActor, end to end (its outputs are garbage, so
  this is the parse-failure path).
"""
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actors.judge import JudgeActor, JudgeConfig, parse_score, parse_triples, parse_with_retries
from actors.trajectory import Trajectory
from rewards.judge import (JudgeAnswer, answer_score, breadth_score, hop_paths, hop_weights, jaccard, logical_score,
                           longest_path, quality_score, reasoning_text, retrieval_num, semantic_score,
                           statistic_score)
from rewards.registry import make_reward


def traj(text: str, reasonings=None, turns=(), answer="Marfan syndrome", triples=None) -> Trajectory:
    metadata = {} if reasonings is None else {"reference_reasonings": list(reasonings)}
    if triples is not None:
        metadata["reference_triples"] = triples
    task = {"id": "t1", "messages": [{"role": "user", "content": "Tall stature and lens dislocation?"}],
            "answer": answer, "options": None, "references": [], "metadata": metadata}
    return Trajectory(task=task, group=0, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[], text=text,
                      finish_reason="stop", weight_version=0, turns=list(turns))


# ---- formulas ------------------------------------------------------------------------------------------------------
A, B, C = ("a", "r", "b"), ("b", "r", "c"), ("c", "r", "d")
D = ("c", "q", "e")


def test_jaccard_and_normalisations_by_hand():
    assert jaccard({"a", "b", "c"}, {"b", "c", "d"}) == 0.5
    assert jaccard(set(), set()) == 0.0
    assert [answer_score(s) for s in (2, 1, 0, None)] == [1.0, 0.5, 0.0, 0.0]
    assert semantic_score([-0.2, 0.4]) == 0.4 and semantic_score([-0.3]) == 0.0 and semantic_score([]) == 0.0
    # eq. 10 with (6 - e) / 5 per document: levels 1, 6, 3 -> (1 + 0 + 0.6) / 3; an unparsed level counts 0.
    assert quality_score([1, 6, 3]) == pytest.approx(1.6 / 3)
    assert quality_score([1, None]) == 0.5 and quality_score([]) == 0.0
    assert breadth_score([1, 0, 1, 1]) == 0.75 and breadth_score([]) == 0.0


def test_statistic_is_entity_plus_relation_jaccard_max_over_references():
    gen = [("oliguria", "suggests", "dehydration"), ("dehydration", "treated by", "iv fluids")]
    ref1 = [("oliguria", "suggests", "azotemia"), ("azotemia", "treated by", "iv fluids")]
    ref2 = [("fever", "suggests", "infection")]
    # ref1: entities 2/4 shared, relations 2/2 -> (0.5 + 1) / 2; ref2: entities 0/5, relations 1/2 -> 0.25.
    assert statistic_score(gen, [ref2]) == pytest.approx(0.25)
    assert statistic_score(gen, [ref1, ref2]) == pytest.approx(0.75)
    assert statistic_score(gen, []) == 0.0


def test_hop_paths_chain_and_stop_at_cycles():
    assert hop_paths([A, B, C], 2) == {(A, B), (B, C)}
    assert hop_paths([A, B, C], 3) == {(A, B, C)}
    assert longest_path([A, B, C], cap=4) == 3 and longest_path([A, B, C], cap=2) == 2
    back = ("b", "r", "a")
    assert hop_paths([A, back], 2) == set() and longest_path([A, back], cap=10) == 1
    assert hop_weights(3) == pytest.approx([1 / 6, 2 / 6, 3 / 6]) and sum(hop_weights(7)) == pytest.approx(1.0)


def test_logical_is_the_weighted_j_hop_jaccard_of_algorithm_1():
    gen, ref = [A, B, C], [A, B, D]
    # K = 3. 1-hop: {A,B,C} vs {A,B,D} -> 2/4; 2-hop: {AB,BC} vs {AB,BD} -> 1/3; 3-hop: {ABC} vs {ABD} -> 0.
    # 2/(3*4) * (1*1/2 + 2*1/3 + 3*0) = 7/36.
    assert logical_score(gen, [ref]) == pytest.approx(7 / 36)
    assert logical_score(gen, [ref, gen]) == pytest.approx(1.0)  # max over references
    # K is min(longest generated, longest over all references) (Algorithm 1, line 2): a 1-hop reference [A] alone
    # gives K = 1 and 1/3; next to ref it is scored with K = 3: 1/6 * 1/3 = 1/18 < 7/36.
    assert logical_score(gen, [[A]]) == pytest.approx(1 / 3)
    assert logical_score(gen, [[A], ref]) == pytest.approx(7 / 36)
    assert logical_score([], [ref]) == 0.0 and logical_score(gen, [ref], max_hops=1) == pytest.approx(0.5)
    assert logical_score(gen, [ref], max_triples=1) == 1.0  # only A on both sides


def test_retrieval_num_counts_searches_against_delta():
    two = traj("x", turns=[{"query": "q1", "chunks": []}, {"query": "q2", "chunks": []}])
    three = traj("x", turns=[{"query": f"q{i}", "chunks": []} for i in range(3)])
    assert retrieval_num([two, three])["retrieval_num"] == [0.0, 1.0]
    assert retrieval_num([two], delta=2)["retrieval_num"] == [1.0]


def test_reasoning_is_the_text_before_the_last_answer():
    text = "<think>oliguria <search>q</search><document>doc</document></think><answer>x</answer>"
    assert reasoning_text(text) == "<think>oliguria <search>q</search><document>doc</document></think>"
    assert reasoning_text("no answer at all ") == "no answer at all"


# ---- parsers and retries -------------------------------------------------------------------------------------------
def test_score_parser_is_strict():
    ok = {"2": 2, "Score: 1": 1, "The answer matches.\nScore: 2.": 2, "**0**": 0, " Level: 4 \n": None}
    for text, want in ok.items():
        assert parse_score(text, [0, 1, 2]) == want, text
    assert parse_score(" Level: 4 \n", list(range(1, 7))) == 4
    for bad in ("3", "2 or 1", "", "Score: two", "score 2", "2\nbecause", "-1", "1.5"):
        assert parse_score(bad, [0, 1, 2]) is None, bad


def test_triples_parser_rejects_anything_malformed():
    assert parse_triples('[["a", "b", "c", 1]]') == [("a", "b", "c", 1)]
    assert parse_triples('```json\n[["a", "b", "c", 0]]\n```') == [("a", "b", "c", 0)]
    assert parse_triples('[["a", "b", "c"]]', with_source=False) == [("a", "b", "c")]
    assert parse_triples("[]") == []
    for bad in ('[["a", "b", "c"]]', '[["a", "", "c", 0]]', '[["a", "b", "c", 2]]', '[["a", "b", "c", true]]',
                '[["a", "b", "c", 1], "x"]', '{"a": 1}', "garbage", '[["a", "b", "c", 1]] and more', ""):
        assert parse_triples(bad) is None, bad


def test_retries_resample_only_failures_with_new_seed_and_temperature():
    script = {"good": ["1"], "late": ["??", "2"], "never": ["x", "y", "z"]}
    calls = []

    def generate(prompts, seeds, temperature):
        calls.append((len(prompts), tuple(seeds), temperature))
        return [script[p].pop(0) for p in prompts]

    values, retries, failures = parse_with_retries(["good", "late", "never"], generate,
                                                   lambda t: parse_score(t, [0, 1, 2]), max_retries=2,
                                                   temperature=0.0, retry_temperature=0.7, seed=5)
    assert values == [1, 2, None] and retries == 3 and failures == 1
    assert [(n, t) for n, _, t in calls] == [(3, 0.0), (2, 0.7), (1, 0.7)]
    seeds_of_never = [s[-1] for _, s, _ in calls]
    assert len(set(seeds_of_never)) == 3


def test_judge_config_is_strict():
    with pytest.raises(ValueError, match="base_url"):
        JudgeConfig(backend="openai", model="m")
    with pytest.raises(ValueError, match="(?i)extra"):
        JudgeConfig(modle="typo")


def test_prompt_templates_are_checked_when_a_reward_is_built():
    with pytest.raises(ValueError, match="'prompt'.*answer"):
        JudgeAnswer(prompt="Grade {question} against {reference}.")


def test_reasoning_reward_names_the_task_without_references():
    reward = make_reward("med_r3_reasoning", {"judge": "nobody"})
    with pytest.raises(ValueError, match="'t1'.*reference_reasonings"):
        reward([traj("<think>x</think><answer>y</answer>")])


# ---- the openai backend against a real HTTP server -------------------------------------------------------------
class ScriptedChat(ThreadingHTTPServer):
    """POST /v1/chat/completions answered by `reply(user_content, times_seen)`; every request body is recorded."""

    def __init__(self, reply):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.reply, self.requests, self.seen, self.lock = reply, [], Counter(), threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class ChatHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        content = body["messages"][-1]["content"]
        with self.server.lock:
            self.server.requests.append({**body, "authorization": self.headers.get("Authorization")})
            times = self.server.seen[content]
            self.server.seen[content] += 1
        text = self.server.reply(content, times)
        out = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    servers = []

    def start(reply):
        server = ScriptedChat(reply)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def openai_judge(url: str, name: str, **cfg):
    config = {"backend": "openai", "base_url": url, "model": "judge-model", "api_key_env": "JUDGE_TEST_KEY", **cfg}
    return JudgeActor.options(name=name, num_cpus=0.25,
                              runtime_env={"env_vars": {"JUDGE_TEST_KEY": "sekret"}}).remote(config)


def test_openai_judge_parses_retries_and_counts(ray_session, chat_server):
    ray = ray_session
    script = {"p1": ["Score: 2"], "p2": ["I think it is fine", "1"], "p3": ["nonsense"] * 3}
    server = chat_server(lambda content, times: script[content][min(times, len(script[content]) - 1)])
    judge = openai_judge(server.url, "JudgeActor-openai-retries", max_retries=2)
    try:
        prompts = [[{"role": "user", "content": p}] for p in ("p1", "p2", "p3")]
        assert ray.get(judge.judge.remote(prompts, "score", allowed=[0, 1, 2])) == [2, 1, None]
        stats = ray.get(judge.stats.remote())
        assert {k: stats[k] for k in ("calls", "prompts", "generations", "retries", "parse_failures")} == \
            {"calls": 1, "prompts": 3, "generations": 6, "retries": 3, "parse_failures": 1}
        assert all(r["authorization"] == "Bearer sekret" and r["model"] == "judge-model" for r in server.requests)
        p3 = [r for r in server.requests if r["messages"][-1]["content"] == "p3"]
        assert [r["temperature"] for r in p3] == [0.0, 0.7, 0.7] and len({r["seed"] for r in p3}) == 3
        assert ray.get(judge.generate.remote([[{"role": "user", "content": "p2"}]])) == ["1"]
    finally:
        ray.kill(judge)


def test_openai_judge_without_its_key_says_which_variable(ray_session):
    judge = JudgeActor.options(num_cpus=0.25, max_restarts=0).remote(
        {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "NO_SUCH_KEY_VAR"})
    with pytest.raises(Exception, match="NO_SUCH_KEY_VAR"):
        ray_session.get(judge.stats.remote())


REF = "Lens dislocation and tall stature point to a fibrillin disorder, which is Marfan syndrome."
GEN = "Tall stature with lens dislocation suggests a connective tissue disorder such as Marfan syndrome."
REF_TRIPLES = [["lens dislocation", "suggests", "fibrillin disorder", 0],
               ["fibrillin disorder", "is", "marfan syndrome", 1]]
GEN_TRIPLES = [["lens dislocation", "suggests", "connective tissue disorder", 0],
               ["connective tissue disorder", "is", "marfan syndrome", 1],
               ["tall stature", "suggests", "marfan syndrome", 0]]


def scripted_judge_reply(content: str, times: int) -> str:
    """What a frontier judge would answer, by prompt: answer grades, knowledge graphs, evidence levels."""
    if "Answer to grade:" in content:
        answer = content.split("Answer to grade:")[1].split("\n")[0].strip()
        return {"Marfan syndrome": "The same disease.\nScore: 2", "Marfan or Ehlers-Danlos": "1"}.get(answer, "0")
    if "Reasoning process:" in content:
        if REF in content:
            return json.dumps(REF_TRIPLES)
        if GEN in content:
            return "```json\n" + json.dumps(GEN_TRIPLES) + "\n```"
        return "not json at all"
    return "Level: 1" if "A meta-analysis of" in content else "5"


def test_judge_rewards_through_an_openai_judge(ray_session, chat_server):
    ray = ray_session
    server = chat_server(scripted_judge_reply)
    judge = openai_judge(server.url, "JudgeActor-openai-rewards", max_retries=1)
    try:
        answer = make_reward("judge_answer", {"judge": "JudgeActor-openai-rewards"})
        batch = [traj("<answer>Marfan syndrome</answer>"), traj("<answer>Marfan or Ehlers-Danlos</answer>"),
                 traj("<answer>Down syndrome</answer>"), traj("no answer"), traj("<answer>Marfan syndrome</answer>")]
        assert answer(batch) == {"judge_answer": [1.0, 0.5, 0.0, 0.0, 1.0]}
        assert ray.get(judge.stats.remote())["prompts"] == 3  # one call, identical prompts once, no answer: not asked

        reasoning = make_reward("med_r3_reasoning", {"judge": "JudgeActor-openai-rewards"})
        refs = [REF, "A second reference that the judge cannot turn into a graph."]
        batch = [traj(f"<think>{REF}</think><answer>x</answer>", refs), traj(f"<think>{GEN}</think>", refs),
                 traj("<think>Something else.</think><answer>x</answer>", refs), traj("<answer>x</answer>", refs)]
        got = reasoning(batch)
        ref, gen = [tuple(t[:3]) for t in REF_TRIPLES], [tuple(t[:3]) for t in GEN_TRIPLES]
        assert got["reasoning_statistic"] == pytest.approx([1.0, statistic_score(gen, [ref]), 0.0, 0.0])
        assert got["reasoning_logical"] == pytest.approx([1.0, logical_score(gen, [ref]), 0.0, 0.0])
        # By hand: entities {lens dislocation, marfan syndrome} of 5 shared, relations 2 of 2 -> (2/5 + 1) / 2.
        assert got["reasoning_statistic"][1] == pytest.approx(0.7)
        # K = 2; no generated triple or 2-hop path equals a reference one (the middle entity differs) -> 0.
        assert got["reasoning_logical"][1] == 0.0
        assert got["reasoning_semantic"][0] == pytest.approx(1.0, abs=1e-5)
        assert 0.3 < got["reasoning_semantic"][1] < 1.0 and got["reasoning_semantic"][3] == 0.0

        given = make_reward("med_r3_reasoning", {"judge": "JudgeActor-openai-rewards"})
        before = ray.get(judge.stats.remote())["prompts"]
        got = given([traj(f"<think>{GEN}</think>", [REF], triples=[[t[:3] for t in GEN_TRIPLES]])])
        assert got["reasoning_statistic"] == [1.0] and got["reasoning_logical"] == [1.0]
        assert ray.get(judge.stats.remote())["prompts"] == before + 1  # references' graphs given: not extracted

        retrieval = make_reward("med_r3_retrieval", {"judge": "JudgeActor-openai-rewards"})
        docs = [{"id": "d1", "doc_id": "x", "text": "A meta-analysis of fibrillin mutations."},
                {"id": "d2", "doc_id": "y", "text": "A case report of ectopia lentis."}]
        batch = [traj(f"<think>{GEN}</think><answer>x</answer>", turns=[{"query": "q", "chunks": docs}]),
                 traj("<think>Something else.</think>", turns=[{"query": "q", "chunks": docs[1:]}]), traj("")]
        got = retrieval(batch)
        assert got["retrieval_quality"] == pytest.approx([(1.0 + 0.2) / 2, 0.2, 0.0])
        assert got["retrieval_breadth"] == pytest.approx([1 / 3, 0.0, 0.0])
        seen = dict(server.seen)
        retrieval(batch[1:2])  # a document's level is cached: only the reasoning goes to the judge again
        assert sum(server.seen.values()) - sum(seen.values()) == 2  # the graph, then its one retry
    finally:
        ray.kill(judge)


# ---- the vllm backend, end to end --------------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_judge_scores_every_sample_and_counts_parse_failures(ray_session):
    """The tiny random model writes garbage: every judgement goes through the retry and failure path, and the
    reward actor still scores every sample, with one judge call per kind of prompt per batch."""
    from rewards.reward_actor import RewardActor
    ray = ray_session
    judge = JudgeActor.options(name="JudgeActor-vllm-test", num_cpus=0.5).remote(
        {"backend": "vllm", "max_tokens": 12, "max_retries": 1, "max_model_len": 1024, "kv_cache_gb": 0.25})
    specs = [{"name": n, "args": {"judge": "JudgeActor-vllm-test"}}
             for n in ("judge_answer", "med_r3_reasoning", "med_r3_retrieval")] + [{"name": "retrieval_num"}]
    rewarder = RewardActor.options(num_cpus=0.25).remote(specs, 300.0, "fail", 1)
    try:
        docs = [{"id": f"d{i}", "doc_id": "x", "text": f"Document {i} about lens dislocation."} for i in range(3)]
        turns = [{"query": f"q{i}", "chunks": docs[i:i + 2]} for i in range(3)]
        batch = [traj(f"<think>{GEN} {i}</think><answer>Marfan {i}</answer>", [REF], turns=turns)
                 for i in range(4)] + [traj("", [REF])]
        scored = ray.get(rewarder.score.remote(batch))
        assert scored["errors"] == {} and len(scored["total"]) == len(batch)
        assert set(scored["components"]) == {"judge_answer", "reasoning_semantic", "reasoning_statistic",
                                             "reasoning_logical", "retrieval_quality", "retrieval_breadth",
                                             "retrieval_num"}
        assert all(len(v) == len(batch) and all(0.0 <= x <= 1.0 for x in v) for v in scored["components"].values())
        assert scored["components"]["retrieval_num"] == [1.0] * 4 + [0.0]
        stats = ray.get(judge.stats.remote())
        # answer: 4 prompts; reasoning: 4 graphs + 1 reference; retrieval: 3 documents + 4 graphs; 5 calls in all.
        assert stats["calls"] == 5 and stats["prompts"] == 16
        assert stats["parse_failures"] >= 1 and stats["retries"] >= stats["parse_failures"]
        assert stats["generations"] == stats["prompts"] + stats["retries"]
    finally:
        ray.kill(rewarder)
        ray.kill(judge)
