"""ARMed's Normalised Contribution Index (the ARMed paper, arXiv 2508.12957, appendix E.1, eq. S8): how much each reward
component steers the GRPO advantage. A component whose NCI falls to ~0 has collapsed."""
from __future__ import annotations

import numpy as np


def nci(components: dict[str, list[float]], weights: dict[str, float]) -> dict[str, float]:
    """NCI_k = g_k * sigma(R_k) / sigma(r) * corr(R_k, r) with r = sum_k g_k R_k, which equals
    g_k * cov(R_k, r) / var(r); the NCIs sum to 1. A constant component gets 0; if the total r is constant (no
    advantage signal at all) every NCI is 0. Population (ddof=0) statistics over the given samples."""
    values = {k: np.asarray(v, dtype=float) for k, v in components.items()}
    total = sum(weights[k] * v for k, v in values.items())
    var = float(np.var(total))
    if var <= 1e-12:
        return {k: 0.0 for k in values}
    centred = total - total.mean()
    return {k: float(weights[k] * np.mean((v - v.mean()) * centred) / var) for k, v in values.items()}


def group_rows(groups: list[int]) -> list[list[int]]:
    """The sample indices of each prompt's group, in order of first appearance."""
    return [[i for i, x in enumerate(groups) if x == g] for g in dict.fromkeys(groups)]


def group_nci(components: dict[str, list[float]], weights: dict[str, float], groups: list[int]) -> dict[str, float]:
    """NCI as GRPO sees it: computed within each prompt's group (the advantage is normalised per group), then
    averaged over the groups whose total reward varies (the others give the update no signal). Sums to 1 unless no
    group varies, when every NCI is 0."""
    per_group = []
    for rows in group_rows(groups):
        scores = nci({k: [v[i] for i in rows] for k, v in components.items()}, weights)
        if any(scores.values()):
            per_group.append(scores)
    return {k: float(np.mean([s[k] for s in per_group])) if per_group else 0.0 for k in components}


def group_spread(components: dict[str, list[float]], groups: list[int]) -> dict[str, float]:
    """Each component's standard deviation within a prompt's group (population), averaged over the groups: what is
    left of it for GRPO to rank samples by. 0 when every group's samples score alike on it, as a saturated similarity
    reward does (ARMed sec. 3.3)."""
    rows = group_rows(groups)
    return {k: float(np.mean([np.std([v[i] for i in r]) for r in rows])) if rows else 0.0
            for k, v in components.items()}
