"""The run config's sections about what a run keeps and how it recovers: checkpoints, fault tolerance, storage,
held-out evaluation and logging (learners/config.py assembles them into RunConfig)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from cluster.schema import Strict


class CheckpointConfig(Strict):
    every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)


class FaultToleranceConfig(Strict):
    """What a run does when an actor fails. A lost rollout worker's share is always generated again, and reward,
    retriever, judge and tool actors restarted; a failed learner rank stops the learner group, which the trainer
    restarts from the newest verified checkpoint, up to max_learner_restarts times."""
    max_learner_restarts: int = Field(2, ge=0, description="learner-group restarts in one run (each from the newest "
                                                           "verified checkpoint, the steps since redone); 0: a failed "
                                                           "learner rank ends the run (resume=true continues it)")


class StorageConfig(Strict):
    """Where a run is kept beyond the node that trains it: checkpoints (each committed by its manifest, uploaded
    last), metrics.jsonl, TensorBoard and evaluations. output_dir stays the driver's local working copy."""
    path: str | None = Field(None, description="a local directory, an NFS mount or a URI (s3://bucket/run, gs://, "
                                               "file://, any pyarrow.fs or fsspec filesystem); null: output_dir only")


class EvalConfig(Strict):
    """Held-out evaluation on the run's own rollout workers (greedy, the run's grammar and environment), written under
    output_dir/eval/step_<N>/<split>/ and logged as eval/<split>/<metric>."""
    data: list[str] = Field(..., min_length=1, description="task splits: JSONL files, <world>:<split> or "
                                                           "phenopackets:<path>#<split>")
    limit: int | None = Field(None, ge=1, description="the first N tasks of each split")
    every: int = Field(0, ge=0, description="evaluate every N steps (0: only at start and end)")
    at_start: bool = Field(True, description="evaluate the starting weights before the first step (the base)")
    at_end: bool = Field(True, description="evaluate the final weights; with at_start, eval.md compares the two")
    at_stage_end: bool = Field(False, description="evaluate at the end of every stage before the last too (after a "
                                                  "cold start): eval.md then says what the last stage added")
    batch_size: int = Field(64, ge=1, description="tasks per rollout call on one worker")
    max_turns: int | None = Field(None, ge=0, description="environment calls per episode at evaluation (e.g. 4 "
                                                          "tool calls at inference); null: the grammar's")
    judge: bool = Field(False, description="grade open answers with the run's JudgeActor (the `judge` section): "
                                           "judge_accuracy with a Wilson interval, parse failures counted")


class WandbConfig(Strict):
    """Weights & Biases, next to TensorBoard (the `wandb` extra). offline writes the run under output_dir/wandb/ for a
    later `wandb sync`, with no network or account."""
    project: str = "medray"
    name: str | None = Field(None, description="the run's name; default: output_dir's last component")
    mode: Literal["online", "offline", "disabled"] = "online"


class LoggingConfig(Strict):
    tensorboard: bool = True
    progress_bar: bool = True
    wandb: WandbConfig | None = Field(None, description="log to Weights & Biases too")
    verbose: bool = Field(False, description="print everything: third-party warnings and every actor's output (by "
                                             "default they go to output_dir/run.log only)")
    trace_episodes_per_step: int = Field(8, ge=0, description="episodes of each GRPO step kept in "
                                         "output_dir/traces.jsonl (`medray traces` shows them): the first of the "
                                         "training batch, whole groups first; 0: none")
    trace_max_mb: float = Field(64.0, gt=0, description="bound on traces.jsonl: past it, every other traced step "
                                                        "is dropped and later steps are traced half as often")
