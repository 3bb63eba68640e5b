"""Tool-use rewards, both given only to correct answers: MedVR's Consensus-based Credit Assignment (CCA) over zoom-in
boxes, and MedVistaGym's answer-conditioned tool-use reward. A tool call is a trajectory turn with a "tool" key.

"Correct" is rewards.builtin.answer_correct: the gold option, or for open-ended tasks the normalised gold text. (MedVR
conditions on acc > 0, which for its open-ended R_open, containing BERTScore, holds for almost every answer.)
"""
from __future__ import annotations

import numbers

import numpy as np

from actors.trajectory import Trajectory
from rewards.builtin import answer_correct
from rewards.registry import register_reward

Box = tuple[float, float, float, float]


def rasterise(footprints: list[list[Box]]) -> tuple[np.ndarray, np.ndarray]:
    """Exact rasterisation of each footprint (a union of [x0, y0, x1, y1] boxes) on the grid cut by every box edge:
    returns the cell areas [X, Y] and one boolean mask per footprint [N, X, Y]. Areas computed this way equal pixel
    counts for integer pixel boxes, with no image size needed."""
    xs = sorted({c for f in footprints for b in f for c in (b[0], b[2])})
    ys = sorted({c for f in footprints for b in f for c in (b[1], b[3])})
    areas = np.outer(np.diff(xs), np.diff(ys)) if len(xs) > 1 and len(ys) > 1 else np.zeros((0, 0))
    masks = np.zeros((len(footprints), *areas.shape), dtype=bool)
    for i, footprint in enumerate(footprints):
        for x0, y0, x1, y1 in footprint:
            masks[i, xs.index(x0):xs.index(x1), ys.index(y0):ys.index(y1)] = True
    return areas, masks


def consensus_ious(footprints: list[list[Box]]) -> list[float]:
    """IoU of each correct rollout's footprint with the consensus of all of them (MedVR's CCA, the MedVR paper,
    sec. 3.3 and Algorithm 1): heatmap C = sum_k M_k of the footprint masks, consensus M_hat = 1(C > n / 2) with n
    the number of correct rollouts."""
    areas, masks = rasterise(footprints)
    consensus = masks.sum(0) > len(footprints) / 2
    ious = []
    for mask in masks:
        union = float((areas * (mask | consensus)).sum())
        ious.append(float((areas * (mask & consensus)).sum()) / union if union > 0 else 0.0)
    return ious


def consensus_tool_rewards(footprints: list[list[Box]], iou_threshold: float = 0.5) -> list[float]:
    """CCA's tool reward for the correct rollouts of one prompt: R_tool = 1.0 if IoU(M_k, M_hat) > iou_threshold
    else 0.5 (:func:`consensus_ious`). As in Algorithm 1 no tool reward (0) when n <= 1; a rollout that zoomed
    nowhere gets 0 too (no tool use to credit)."""
    if len(footprints) <= 1:
        return [0.0] * len(footprints)
    return [0.0 if not footprint else 1.0 if iou > iou_threshold else 0.5
            for footprint, iou in zip(footprints, consensus_ious(footprints))]


def zoom_boxes(traj: Trajectory, tool: str = "zoom_in") -> list[Box]:
    """The trajectory's zoom-in boxes with positive area, corners ordered; malformed boxes are skipped."""
    boxes = []
    for turn in traj.turns:
        box = turn.get("box")
        if turn.get("tool") == tool and isinstance(box, (list, tuple)) and len(box) == 4 \
                and all(isinstance(c, numbers.Real) for c in box):
            x0, x1, y0, y1 = sorted(box[0::2]) + sorted(box[1::2])
            if x0 < x1 and y0 < y1:
                boxes.append((float(x0), float(y0), float(x1), float(y1)))
    return boxes


@register_reward("medvr_tool")
def medvr_tool(trajectories: list[Trajectory], tool: str = "zoom_in",
               iou_threshold: float = 0.5) -> dict[str, list[float]]:
    """MedVR's 1(acc > 0) * R_tool: CCA among the correct rollouts of each prompt (trajectories sharing `group`;
    the batch must hold whole groups, as the trainer sends them); 0 for incorrect rollouts. Also the diagnostic
    `metric/consensus_iou` (each correct rollout's IoU with its group's consensus; NaN where there is none)."""
    scores, ious = [0.0] * len(trajectories), [float("nan")] * len(trajectories)
    correct_by_group: dict[int, list[int]] = {}
    for i, traj in enumerate(trajectories):
        if answer_correct(traj):
            correct_by_group.setdefault(traj.group, []).append(i)
    for rows in correct_by_group.values():
        footprints = [zoom_boxes(trajectories[i], tool) for i in rows]
        for i, reward in zip(rows, consensus_tool_rewards(footprints, iou_threshold)):
            scores[i] = reward
        if len(rows) > 1:
            for i, footprint, iou in zip(rows, footprints, consensus_ious(footprints)):
                ious[i] = iou if footprint else ious[i]
    return {"tool": scores, "metric/consensus_iou": ious}


@register_reward("medvista_tool")
def medvista_tool(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """MedVistaGym's answer-conditioned tool-use reward (the MedVistaGym paper, sec. 3.2): 1 if the trajectory
    called at least one tool and its answer is correct, else 0."""
    return {"tool": [float(any("tool" in turn for turn in t.turns) and answer_correct(t)) for t in trajectories]}
