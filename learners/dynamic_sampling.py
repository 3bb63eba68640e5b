"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose G rewards are all equal has zero advantage and
teaches nothing, so it is filtered out and more prompts are sampled until the batch holds `num_groups` informative
groups, for at most a bounded number of extra generation rounds.

Each round is (trajectories, totals) in group order: G consecutive samples per prompt.
"""
from __future__ import annotations


def informative(totals: list[float], group_size: int, eps: float = 1e-9) -> list[int]:
    """The groups whose rewards are not all equal: max - min > eps."""
    groups = [totals[g * group_size:(g + 1) * group_size] for g in range(len(totals) // group_size)]
    return [g for g, rewards in enumerate(groups) if max(rewards) - min(rewards) > eps]


def count_informative(rounds: list[tuple[list, list[float]]], group_size: int) -> int:
    return sum(len(informative(totals, group_size)) for _, totals in rounds)


def kept_groups(totals: list[list[float]], group_size: int, num_groups: int) -> tuple[list[tuple[int, int]], int]:
    """The (round, group) pairs the batch keeps, in batch order, given each round's totals: informative groups round
    by round; if the rounds ran out first, the first round's uninformative groups fill the rest (they keep the batch
    its size and contribute A = 0). Returns (pairs, how many of them are such padding)."""
    keep = [(r, g) for r, round_totals in enumerate(totals) for g in informative(round_totals, group_size)][:num_groups]
    uninformative = sorted(set(range(num_groups)) - set(informative(totals[0], group_size)))
    padding = [(0, g) for g in uninformative][:num_groups - len(keep)]
    return keep + padding, len(padding)


def gather(per_round: list[list], picks: list[tuple[int, int]], group_size: int) -> list:
    """The samples of the picked (round, group) pairs, in pick order, from per-round lists of per-sample values (the
    trajectories, their totals, a reward component: anything laid out G consecutive samples per prompt)."""
    return [x for r, g in picks for x in per_round[r][g * group_size:(g + 1) * group_size]]


def fill_batch(rounds: list[tuple[list, list[float]]], group_size: int,
               num_groups: int) -> tuple[list, list[float], dict]:
    """The batch of `num_groups` groups (`kept_groups`).
    Returns (trajectories, totals, {"groups_filtered": uninformative groups generated, "groups_padded": of them
    kept to fill the batch})."""
    picks, padded = kept_groups([totals for _, totals in rounds], group_size, num_groups)
    generated = sum(len(totals) // group_size for _, totals in rounds)
    trajs = gather([t for t, _ in rounds], picks, group_size)
    totals = gather([totals for _, totals in rounds], picks, group_size)
    stats = {"groups_filtered": generated - count_informative(rounds, group_size), "groups_padded": padded}
    return trajs, totals, stats
