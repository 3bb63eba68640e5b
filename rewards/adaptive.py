"""ARMed's adaptive reward calibration Adapt() (ARMed, arXiv 2508.12957, eqs. 5-9, defaults from its Table S5) and
the semantic alignment reward built on it.

The full ARMed reward, (g1*Rc + g2*Ras + g3*Rf) / (g1 + g2 + g3) with g = 0.4, 0.4, 0.2, is plain config: reward
components armed_textual (weight 0.4), armed_semantic (0.4) and a format reward (0.2); the weights already sum to 1.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from actors.trajectory import Trajectory
from rewards.builtin import extract_answer
from rewards.registry import register_reward
from rewards.semantic import load_bertscore, load_encoder
from rewards.text_similarity import score_against_gold


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def next_threshold(threshold: float, target: float, max_step: float, lo: float, hi: float) -> float:
    """Eq. 6: T_{t+1} = clip(T_t + clip(T* - T_t, -d_max, d_max), T_min, T_max)."""
    return clip(threshold + clip(target - threshold, -max_step, max_step), lo, hi)


def calibrate(reward: float, threshold: float, alpha_pos: float, alpha_neg: float, eps: float = 1e-8) -> float:
    """Eqs. 7-8: r_hat = clip((r - T) / (1 - T + eps), -1, 1); r' = 0.5 * (1 + tanh(a * r_hat)), a = alpha_pos if
    r_hat >= 0 else alpha_neg. r' is in (0, 1), equals 0.5 at r = T, and is non-decreasing in r."""
    r_hat = clip((reward - threshold) / (1 - threshold + eps), -1.0, 1.0)
    return 0.5 * (1 + math.tanh((alpha_pos if r_hat >= 0 else alpha_neg) * r_hat))


class Adapt:
    """Adapt() for one reward stream. Each call (one batch): keep the rewards above rho * T_t in the history buffer H
    (eq. 5; the newest max_history values), T* = the `percentile`-th percentile of H, move the threshold to T_{t+1}
    by at most max_step (eq. 6), and map every reward through `calibrate` with T_{t+1} (eqs. 7-8).

    Defaults are ARMed's Table S5: rho 0.8, L_max 2000, p 0.5 (read as the median, percentile 50), d_max 0.01,
    T in [0, 0.995], eps 1e-8, alpha_pos 5, alpha_neg 2. The paper gives no T_0; ours is 0.5.
    `state_dict()` / `load_state_dict()` carry T and H across a checkpoint.
    """

    def __init__(self, rho: float = 0.8, max_history: int = 2000, percentile: float = 50.0, max_step: float = 0.01,
                 min_threshold: float = 0.0, max_threshold: float = 0.995, initial_threshold: float = 0.5,
                 eps: float = 1e-8, alpha_pos: float = 5.0, alpha_neg: float = 2.0):
        self.rho, self.percentile, self.max_step = rho, percentile, max_step
        self.min_threshold, self.max_threshold, self.eps = min_threshold, max_threshold, eps
        self.alpha_pos, self.alpha_neg = alpha_pos, alpha_neg
        self.threshold = initial_threshold
        self.history: deque[float] = deque(maxlen=max_history)

    def update(self, rewards: list[float]) -> float:
        """Eqs. 5-6 for one batch; returns T_{t+1}. With an empty H the threshold stays."""
        self.history.extend(r for r in rewards if r > self.rho * self.threshold)
        if self.history:
            target = float(np.percentile(list(self.history), self.percentile))
            self.threshold = next_threshold(self.threshold, target, self.max_step,
                                            self.min_threshold, self.max_threshold)
        return self.threshold

    def __call__(self, rewards: list[float]) -> list[float]:
        threshold = self.update(rewards)
        return [calibrate(r, threshold, self.alpha_pos, self.alpha_neg, self.eps) for r in rewards]

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.threshold = state["threshold"]
        self.history.clear()
        self.history.extend(state["history"])


@register_reward("armed_semantic")
class ArmedSemantic:
    """ARMed's semantic alignment reward of the <answer> against the gold answer / references (max over them):
    adaptive=True:  Ras = l2 * Adapt(BERTScore) + (1 - l2) * Adapt(CosSim)   (eq. 9), one Adapt stream per metric;
    adaptive=False: Rs  = l2 * BERTScore + (1 - l2) * CosSim                  (eq. 4), the static ablation.
    l2 = 0.2. A trajectory without an <answer> scores 0 and does not enter the Adapt history.
    `adapt` holds Adapt's arguments; the model arguments are those of the bertscore and cos_sim rewards.
    """

    def __init__(self, l2: float = 0.2, adaptive: bool = True, adapt: dict | None = None,
                 bertscore_model_dir: str | None = None, bertscore_num_layers: int | None = None,
                 cos_sim_model_dir: str | None = None, batch_size: int = 64):
        self.l2 = l2
        self.bertscore = load_bertscore(bertscore_model_dir, bertscore_num_layers, None, batch_size)
        self.encoder = load_encoder(cos_sim_model_dir, batch_size)
        self.streams = {"bertscore": Adapt(**(adapt or {})), "cos_sim": Adapt(**(adapt or {}))} if adaptive else {}

    @property
    def stateful(self) -> bool:
        """Adaptive: the final scores need `calibrate` on the whole step's batch, run by the run's one owner."""
        return bool(self.streams)

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        """Static: the final Rs. Adaptive: Rs as a placeholder and the raw metrics (`metric/armed_bertscore`,
        `metric/armed_cos_sim`; NaN without an answer) that `calibrate` turns into Ras."""
        answered = [i for i, t in enumerate(trajectories) if extract_answer(t.text)]
        batch = [trajectories[i] for i in answered]
        raw = {"bertscore": score_against_gold(batch, self.bertscore.f1),
               "cos_sim": score_against_gold(batch, self.encoder.cosine)}
        out = {"armed_semantic": self.combine(answered, raw["bertscore"], raw["cos_sim"], len(trajectories))}
        if self.streams:
            for name, values in raw.items():
                column = [math.nan] * len(trajectories)
                for i, value in zip(answered, values):
                    column[i] = value
                out[f"metric/armed_{name}"] = column
        return out

    def calibrate(self, components: dict[str, list[float]]) -> dict[str, list[float]]:
        """Adapt() once on a whole step's raw metrics (eq. 9): every stream updates its threshold from all of them."""
        bert, cos = components["metric/armed_bertscore"], components["metric/armed_cos_sim"]
        answered = [i for i, value in enumerate(bert) if not math.isnan(value)]
        scores = self.combine(answered, self.streams["bertscore"]([bert[i] for i in answered]),
                              self.streams["cos_sim"]([cos[i] for i in answered]), len(bert))
        return {**components, "armed_semantic": scores}

    def combine(self, answered: list[int], bert: list[float], cos: list[float], n: int) -> list[float]:
        """l2 * BERTScore + (1 - l2) * CosSim on the answered samples, 0 elsewhere."""
        scores = [0.0] * n
        for i, b, c in zip(answered, bert, cos):
            scores[i] = self.l2 * b + (1 - self.l2) * c
        return scores

    def state_dict(self) -> dict:
        return {name: stream.state_dict() for name, stream in self.streams.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, stream in self.streams.items():
            stream.load_state_dict(state[name])
