"""What one training step of the learner group returns (`LearnerGroup.train`), in a module of its own: the trainer
and learners/metrics.py read it, and the group imports the metrics, so the metrics cannot import the group."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LearnerStep:
    """One batch's update, combined over the learner ranks. The `*_sum` fields add up over every rank, micro-batch
    and pass, so their mean per policy token is the sum over `mask_sum`. `reports` holds the columns the group
    reports under their metrics.jsonl names: `mismatch/*` (engine vs learner log-probabilities, when the learner's
    were known), `memory/learner_*`, and the tokens its forwards and backwards processed, `learner_tokens`, with
    `learner_tokens_per_s` over `seconds`."""
    loss: float                 # the mini-batch loss, averaged over the optimizer steps
    mask_sum: float             # policy tokens trained on (loss mask 1), once per pass
    clip_sum: float             # of those, tokens whose ratio was clipped
    kl_sum: float               # the KL to the reference over those tokens (0 without a KL term)
    entropy_sum: float          # the policy's entropy over those tokens
    grad_norm: float            # the global gradient norm (rank 0's), averaged over the optimizer steps
    lr: float                   # the learning rate once the step is done (rank 0's)
    optimizer_steps: int        # passes x mini-batches
    seconds: float              # the slowest rank's
    reports: dict[str, float]
