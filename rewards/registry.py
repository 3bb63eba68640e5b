"""The reward registry: a reward is a plain function or class with one signature, chosen by name in config.

    reward(trajectories: list[Trajectory], **args) -> dict[str, list[float]]

It returns one or more named components, one score per trajectory. Names starting with `metric/` are diagnostics:
logged each step (mean over the samples that have one; NaN marks a sample without), never added to the reward. A class is
instantiated once per reward actor with the config's `args` (so models stay resident) and then called with the batch.

A reward with state across steps (ARMed's Adapt thresholds) says so with `stateful = True` and adds
`calibrate(components) -> components` and `state_dict()` / `load_state_dict()`: every reward actor computes the raw
components of its share, and once per step one owner (RewardActor-0) calibrates the whole batch's, so the state is
updated once, from every sample, whatever the number of reward actors.
"""
from __future__ import annotations

import importlib
from typing import Callable

REWARDS: dict[str, Callable] = {}
# The modules whose rewards are registered on first use; the heavy ones import their models only when built.
BUILTIN_MODULES = ("rewards.builtin", "rewards.text_similarity", "rewards.semantic", "rewards.adaptive",
                   "rewards.formats", "rewards.tool_use", "rewards.query_semantic", "rewards.judge",
                   "rewards.confidence")


def register_reward(name: str):
    def add(fn_or_cls):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = fn_or_cls
        return fn_or_cls
    return add


def make_reward(name: str, args: dict) -> Callable:
    """The callable for reward `name`: a class is built with `args`; a function gets them bound."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}")
    target = REWARDS[name]
    if isinstance(target, type):
        return target(**args)
    return lambda trajectories: target(trajectories, **args)


def is_stateful(reward) -> bool:
    """Whether a built reward keeps state across steps and needs `calibrate` on the whole batch."""
    return bool(getattr(reward, "stateful", False))


def is_diagnostic(component: str) -> bool:
    """A `metric/...` component: logged, never part of the reward."""
    return component.startswith("metric/")
