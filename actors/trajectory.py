"""What a rollout produces and every later stage reads."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One sampled episode of one prompt.

    `response_ids` holds every token after the prompt, the policy's and the environment's (retrieved text, tool
    observations); `loss_mask` is 1 exactly on the tokens the policy wrote, and `logprobs` are the behaviour
    policy's log-probabilities of those tokens (0 elsewhere). `weight_version` is the learner version whose
    weights sampled it (the oldest, when the weights changed while it was sampled: `versions` has each token's).

    With a multimodal policy, each image the sequence shows (the task's, then the environment's, in order) is a full
    run of `<|image_pad|>` tokens in the ids, and `images` holds its RGB uint8 array (a group's rollouts share the
    task's arrays, which pickle once) with `image_grids` its patch grid: what the learner needs to re-run the forward.
    """
    task: dict                       # the task record: id, messages, answer, options, images, references, metadata
    group: int                       # index of the prompt within the step's batch; rollouts of a group share it
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    text: str                        # decoded response (policy and environment text)
    finish_reason: str               # "stop", "length", or the environment's reason (turn limit, budget)
    weight_version: int
    versions: list[int] = field(default_factory=list)  # per response token: its weight version (-1: environment's)
    turns: list[dict] = field(default_factory=list)   # queries, retrieved chunks, tool calls, observations
    images: list = field(default_factory=list)        # np.uint8 [H, W, 3] per image, in token order
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)  # (t, h, w) patches per image
    # log p(gold answer token) right after <answer>, with and without the retrieved text (Med-RwR confidence gain)
    answer_logprobs: dict | None = None
    branch: dict | None = None       # a fork (rollout hooks): {"of": index of the base rollout in its group, "at": token}

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RolloutSummary:
    """What a rollout worker reports of one share of trajectories besides the trajectories themselves: one per
    `RolloutWorker.rollout` call, or in fully asynchronous mode one per training batch (learners/rollout_stream.py).
    The step's rollout columns of metrics.jsonl are computed from these (learners/metrics.py `step_metrics`),
    an evaluation's environment use too; `version` tells the driver whether a restarted worker sampled the share
    with older weights."""
    lengths: list[int]              # each trajectory's response tokens (policy and environment), in share order
    finish_reasons: list[str]       # each trajectory's (Trajectory.finish_reason; "length": truncated)
    policy_tokens: int              # tokens the policy sampled over the share (loss mask 1)
    env_calls: int                  # environment calls the episodes made
    env_errors: int                 # of those, calls that returned an error observation
    idle_s: float                   # seconds the engine had nothing to decode while environment calls were out
    seconds: float                  # wall time of the share's generation
    version: int                    # the (oldest) learner weight version that sampled the share
    peak_memory_gb: dict[str, float]  # the worker's peaks over the share (cluster.devices.step_peak_memory)
    hook_stats: dict[str, float] = field(default_factory=dict)  # the recipe's rollout hooks' numbers (actors/hooks.py)


@dataclass
class GroupSummary:
    """What `RolloutWorker.stream` says of one finished group (fully asynchronous rollouts)."""
    group: int                      # the group's number in the stream
    version: int                    # the oldest weight version of its trajectories
    partial: bool                   # some trajectory's policy tokens span several weight versions
    env_calls: int                  # environment calls of its episodes (their turns)
    lengths: list[int]              # as in RolloutSummary, over the group
    finish_reasons: list[str]
    policy_tokens: int


@dataclass
class SliceSummary:
    """What `RolloutWorker.stream` yields after the groups one slice of generation finished."""
    groups: list[GroupSummary]      # the groups finished in the slice, in the order yielded
    in_flight: int                  # groups still in the worker's episode pool
    env_errors: int                 # the slice's environment errors and engine idle time, as in RolloutSummary
    idle_s: float
    seconds: float                  # the slice's wall time
    peak_memory_gb: dict[str, float]
