"""EVR's entropy-guided branching (recipes/medvr.py): the formulas on hand numbers, the branching statistics, and the
rollout hook on a real rollout worker."""
import math
import random

import pytest

from actors.entropy import topk_entropy
from learners.config import load_config
from recipes import load_recipe
from recipes.medvr import EVRBranching, EVRConfig, argument_spans, branch_probability, plan_forks

OPEN, CLOSE = 5, 6


def test_entropy_from_top_k_is_exact_when_k_covers_the_vocabulary():
    assert topk_entropy([math.log(0.5), math.log(0.5)], vocab_size=2) == pytest.approx(math.log(2))
    # top-2 of a 4-token distribution (0.5, 0.3, 0.1, 0.1): the 0.2 left is spread evenly, as it truly is
    h = topk_entropy([math.log(0.5), math.log(0.3)], vocab_size=4)
    assert h == pytest.approx(-(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 2 * 0.1 * math.log(0.1)))


def test_branch_probability_rises_with_the_entropy_increase_and_stays_a_probability():
    assert branch_probability(2.0, 1.0, 0.5, 0.5) == pytest.approx(1.0)      # 0.5 + 0.5 * 1.0
    assert branch_probability(1.2, 1.0, 0.5, 0.5) == pytest.approx(0.6)
    assert branch_probability(0.0, 3.0, 0.5, 0.5) == 0.0                      # clipped


def test_argument_spans_are_inside_policy_action_blocks_only():
    ids = [1, OPEN, 7, 8, CLOSE, 9, OPEN, 7, CLOSE, OPEN, 3]
    mask = [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1]   # the second block was inserted by the environment; the last is open
    assert argument_spans(ids, mask, OPEN, CLOSE) == [range(2, 4)]
    # with a decoder, a block naming "arguments" starts after it: the tool's name is never resampled
    words = {7: '{"name": "zoom_in", ', 8: '"arguments": ', 3: "x", 11: '{"box": [1, 2, 3, 4]}}'}
    ids = [OPEN, 7, 8, 11, CLOSE]
    decode = lambda toks: "".join(words.get(t, "") for t in toks)
    assert argument_spans(ids, [1] * 5, OPEN, CLOSE, decode) == [range(3, 4)]


def test_forks_happen_only_inside_arguments_and_never_exceed_the_budget():
    cfg = EVRConfig(enabled=True, base_tokens=2, window=2)
    spans = [[range(5, 9), range(12, 15)], [range(3, 6)], []]
    entropies = [[1.0] * 20, [1.0] * 20, [1.0] * 20]
    for seed in range(50):
        forks = plan_forks(entropies, spans, budget=2, cfg=cfg, rng=random.Random(seed))
        assert len(forks) <= 2
        for f in forks:
            assert any(f.position in call for call in spans[f.episode])
        per_call = [(f.episode, next(i for i, c in enumerate(spans[f.episode]) if f.position in c)) for f in forks]
        assert len(per_call) == len(set(per_call))  # at most one fork per tool call


def test_branching_statistics_follow_p():
    """With flat entropy P = P_base: a one-token argument forks with probability 0.5; with entropy rising by 1 nat
    in the arguments, P = 0.5 + 0.5 * 1 = 1."""
    cfg = EVRConfig(enabled=True, base_tokens=3, window=1)
    flat = [[1.0] * 10]
    rng = random.Random(0)
    rate = sum(len(plan_forks(flat, [[range(4, 5)]], 1, cfg, rng)) for _ in range(4000)) / 4000
    assert rate == pytest.approx(0.5, abs=0.03)
    rising = [[1.0, 1.0, 1.0, 1.0, 2.0, 1.0]]
    assert all(plan_forks(rising, [[range(4, 5)]], 1, cfg, random.Random(s)) for s in range(100))
    low = [[2.0, 2.0, 2.0, 2.0, 1.0, 2.0]]   # arguments more certain than the start: P = 0
    assert not any(plan_forks(low, [[range(4, 5)]], 1, cfg, random.Random(s)) for s in range(100))


def test_the_medvr_recipe_branches_unless_its_config_turns_evr_off():
    cfg = load_config("configs/medvr.yaml")
    [hook] = load_recipe(cfg.recipe).rollout_hooks(cfg)
    assert isinstance(hook, EVRBranching) and hook.base_samples(8) == 4 and hook.top_logprobs == 20
    off = load_config("configs/medvr.yaml", ["recipe.args.evr.enabled=false"])
    assert load_recipe(off.recipe).rollout_hooks(off) == []


def test_evr_refuses_action_tags_the_tokenizer_spells_in_several_tokens(tiny_model_path):
    """EVR finds tool calls by their tag tokens: a tag that is not one token would silently never fork."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    cfg = load_config("configs/medvr.yaml")
    [hook] = load_recipe(cfg.recipe).rollout_hooks(cfg)
    grammar = cfg.rollout.grammar.model_copy(update={"action_tag": "zoomx"})
    worker = SimpleNamespace(runner=SimpleNamespace(grammar=grammar), vision=None,
                             tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))
    with pytest.raises(ValueError, match="no single token for <zoomx>"):
        hook.extend(worker, SimpleNamespace(group_size=4, groups=[], seed=0))


@pytest.mark.slow
def test_evr_forks_inside_tool_arguments_on_a_real_rollout_worker(ray_session):
    """A RolloutWorker with the tiny Qwen2.5-VL and a zoom-in tool actor; the policy is constrained (structured
    output) to zoom calls with free coordinates, until the turn limit. With P_base = 1 every base rollout that calls the tool
    forks at its first argument token: forks share the base prefix up to that token, never exceed half the group, and
    sample their coordinates anew."""
    import ray
    from vllm.sampling_params import StructuredOutputsParams

    from actors.gym import ToolsConfig, make_tool_environment
    from actors.rollout_worker import RolloutWorker
    from tasks.tiny_models import TinyModelConfig
    from learners.data import load_tasks
    from tasks.tiny_models import ensure_tiny_model

    model = ensure_tiny_model(TinyModelConfig(arch="qwen2_5_vl"))
    env = make_tool_environment(ToolsConfig(tools={"zoom_in": {"num_cpus": 0}}))
    grammar = {"action_tag": "tool_call", "observation_tag": "tool_response", "max_turns": 2,
               "max_response_tokens": 384, "max_observation_tokens": 64}
    worker = RolloutWorker.options(num_cpus=0).remote(str(model), seed=0, threads=1, max_model_len=1024,
                                                      kv_cache_gb=0.25, grammar=grammar, environment=env)
    call = (r'<tool_call>\{"name": "zoom_in", "arguments": \{"box": \[[1-9][0-9], [1-9][0-9], '
            r'1[0-9][0-9], 1[0-9][0-9]\]\}\}</tool_call>')
    sampling = {"temperature": 1.0, "max_tokens": 128,
                "structured_outputs": StructuredOutputsParams(regex=call)}
    tasks = load_tasks("imaging:finding_mcq_train")[:2]
    try:
        hooks = [EVRBranching(EVRConfig(p_base=1.0, gamma=0.0))]
        trajs, summary = ray.get(worker.rollout.remote(tasks, [0, 1], 4, sampling, 7, grammar, hooks))
    finally:
        ray.kill(worker)
        env.shutdown()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    open_id, close_id = (tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    assert len(trajs) == 8 and [t.group for t in trajs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(t.branch is None for g in (0, 4) for t in trajs[g:g + 2])  # the base half
    forks = [t for t in trajs if t.branch is not None]
    stats = summary.hook_stats
    assert stats["evr/branch_budget"] == 4 and stats["evr/branch_events"] == len(forks) > 0
    for t in forks:
        origin, at = trajs[4 * t.group + t.branch["of"]], t.branch["at"]
        assert t.response_ids[:at] == origin.response_ids[:at]  # the shared prefix, sampled anew from `at`
        spans = argument_spans(origin.response_ids, origin.loss_mask, open_id, close_id, tok.decode)
        assert any(at in span for span in spans)  # inside the base rollout's tool-call arguments
        assert '"arguments"' in tok.decode(t.response_ids[:at])  # past the tool's name: the box is resampled
        assert len(t.turns) >= 1  # the branch's call went to the tool environment (the constraint restarts the
        # call after the fork point, so the tool may refuse its JSON: the branch reads that error and goes on)
