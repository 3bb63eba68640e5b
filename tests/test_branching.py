"""EVR's entropy-guided branching: the formulas on hand numbers, and the branching statistics."""
import math
import random

import pytest

from actors.branching import EVRConfig, argument_spans, branch_probability, plan_forks, topk_entropy

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
