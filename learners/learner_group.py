"""LearnerGroup: the driver's handle on K LearnerWorker ranks (learners/learner_worker.py): fans calls out, combines
their answers, and stops the group when one rank fails."""
from __future__ import annotations

import logging
import time
from typing import Callable

import ray
import torch

from cluster.devices import learner_env
from cluster.ray_session import ACTOR_LOST, wait_until_ready
from learners.learner_step import LearnerStep
from learners.learner_worker import LearnerWorker
from learners.metrics import peak_memory

log = logging.getLogger("medray.learner")


class LearnerRankFailed(RuntimeError):
    """Learner rank `rank` raised or died during `during`; every rank of the group is stopped. The trainer restarts
    the group from its newest checkpoint (fault_tolerance.max_learner_restarts) or ends the run with this error.
    `cause`: the error's type and first line."""

    def __init__(self, rank: int, during: str, err: BaseException):
        self.rank, self.during = rank, during
        self.cause = f"{type(err).__name__}: {next(iter(str(err).splitlines()), '')}"
        super().__init__(
            f"LearnerWorker-{rank} failed during {during}: {type(err).__name__}: {err}\n"
            "The other learner ranks were waiting for it in a collective, so the learner group was stopped. "
            "Checkpoints already written are intact: rerun with resume=true.")


def gather_ranks(calls: list, ranks: list, what: str, called: list[int] | None = None) -> list:
    """`ray.get` of one call per rank that fails fast. A rank that raises or dies leaves the others blocked in a
    collective (allreduce, gather) until gloo's or NCCL's timeout, 30 minutes; a plain `ray.get` in rank order
    would wait on a blocked rank first. So the first failure kills every rank and raises, naming the rank
    (`called[i]`: the rank of call i; by default call i went to rank i)."""
    rank_of = {ref: called[i] if called else i for i, ref in enumerate(calls)}
    pending = list(calls)
    while pending:
        (done,), pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except Exception as err:
            for r in ranks:
                ray.kill(r, no_restart=True)
            raise LearnerRankFailed(rank_of[done], what, err) from err
    return ray.get(calls)


def optimizer_steps_per_batch(stage_cfg) -> int:
    """Optimizer steps one GRPO rollout batch makes: passes x mini-batches."""
    batch = stage_cfg.rollout.prompts_per_step * stage_cfg.rollout.group_size
    return stage_cfg.algorithm.updates_per_batch * (batch // (stage_cfg.learner.mini_batch_size or batch))


class LearnerGroup:
    """The driver's handle on the K DeepSpeed ranks: fans calls out and combines their answers. Every call that
    all ranks join goes through `gather_ranks`, so one failing rank stops the run instead of hanging it."""

    def __init__(self, cfg, placement, model_path: str, resume_from=None, resume_source: str | None = None):
        res = cfg.cluster.learner
        self.cfg = cfg
        env = {"runtime_env": {"env_vars": learner_env(cfg.learner.keep_freed_memory,
                                                       cfg.learner.kernel_cache_entries)}}
        self.ranks = [LearnerWorker.options(**placement.options("learner", i, f"LearnerWorker-{i}"),
                                            **env).remote(i, res.num, res.threads) for i in range(res.num)]
        master = self._all([self.ranks[0].address.remote()], "start", [0])[0]
        stages = [(stage, cfg.for_stage(i)) for i, stage in enumerate(cfg.stage_plan())]
        total_updates = sum(stage.steps * optimizer_steps_per_batch(stage_cfg) if stage.kind == "grpo" else stage.steps
                            for stage, stage_cfg in stages)
        with_reference = any(stage.kind == "grpo" and stage_cfg.algorithm.kl_beta > 0 for stage, stage_cfg in stages)
        self.compute_dtype = self._all([r.setup.remote(master, model_path, cfg.dump(), total_updates, with_reference)
                                        for r in self.ranks], "setup")[0]
        log.info("learner ranks compute in %s (learner.compute_dtype=%s)", self.compute_dtype,
                 cfg.learner.compute_dtype)
        if resume_from is not None:
            self._all([r.load.remote(str(resume_from), resume_source) for r in self.ranks], "resume")
        self.nodes = ray.get([r.node.remote() for r in self.ranks])  # which rank uploads which checkpoint share

    def train(self, trajectory_refs: list, advantages: list[float] | None, stage_cfg,
              objective: str = "grpo") -> LearnerStep:
        """One batch on every rank: rollouts with their advantages (grpo) or demonstrations (sft)."""
        algorithm = stage_cfg.algorithm.model_dump()
        algorithm["loss_norm_length"] = algorithm["loss_norm_length"] or stage_cfg.rollout.max_new_tokens
        per_rank = self._all([r.train.remote(trajectory_refs, advantages, algorithm, objective,
                                             stage_cfg.rollout.temperature, stage_cfg.learner.lr,
                                             stage_cfg.learner.mini_batch_size) for r in self.ranks],
                             f"a {objective} step")
        summed = {k: sum(p[k] for p in per_rank) for k in ("loss", "mask_sum", "clip_sum", "kl_sum", "entropy_sum",
                                                             "mismatch_k3_sum", "mismatch_tokens",
                                                             "mismatch_corrected_sum")}
        tokens = sum(p["tokens"] for p in per_rank)
        # Each rank's loss is its share of a mini-batch loss; per optimizer step they add up to it.
        summed["loss"] /= per_rank[0]["optimizer_steps"]
        mismatch = {}
        if summed["mismatch_tokens"]:  # over the tokens whose learner behaviour log-probabilities were known
            mismatch = {"mismatch/kl": summed["mismatch_k3_sum"] / summed["mismatch_tokens"],
                        "mismatch/max_ratio": max(p["mismatch_max_ratio"] for p in per_rank),
                        "mismatch/corrected_fraction": summed["mismatch_corrected_sum"] / summed["mismatch_tokens"]}
        seconds = max(p["seconds"] for p in per_rank)
        held = {f"memory/learner_{k}": max(p["held_gb"][k] for p in per_rank) for k in per_rank[0]["held_gb"]}
        return LearnerStep(
            loss=summed["loss"], mask_sum=summed["mask_sum"], clip_sum=summed["clip_sum"], kl_sum=summed["kl_sum"],
            entropy_sum=summed["entropy_sum"], grad_norm=per_rank[0]["grad_norm"], lr=per_rank[0]["lr"],
            optimizer_steps=per_rank[0]["optimizer_steps"], seconds=seconds,
            reports={**mismatch, **peak_memory("learner", [p["peak_memory_gb"] for p in per_rank]), **held,
                     "learner_tokens": tokens, "learner_tokens_per_s": tokens / seconds})

    def _all(self, calls: list, what: str, called: list[int] | None = None) -> list:
        return gather_ranks(calls, self.ranks, what, called)

    def connect(self, workers: list) -> None:
        """Set up the weight transport to `workers` (`cluster.weight_sync`; auto: collective with GPUs)."""
        choice = self.cfg.cluster.weight_sync
        self.transport = choice if choice != "auto" else \
            ("collective" if self.cfg.cluster.learner.num_gpus > 0 else "object_store")
        self.workers = workers
        if self.transport == "collective":
            host, port = ray.get(self.ranks[0].address.remote())
            # Every shard of every engine is a rank of its own: worker i's shards are 1 + i * shards onward.
            shards = self.cfg.cluster.rollout.tensor_parallel_size
            world = 1 + len(workers) * shards
            ray.get([self.ranks[0].join_broadcast_group.remote(host, port, world)] +
                    [w.join_broadcast_group.remote(host, port, world, 1 + i * shards) for i, w in enumerate(workers)])
            self.meta, self.complete = ray.get(self.ranks[0].weight_meta.remote())

    def sync(self, version: int) -> dict:
        """Send the weights of `version` to every rollout worker; all learner ranks take part (ZeRO-3 gathers)."""
        start = time.perf_counter()
        if self.transport == "object_store":
            manifest, stats = self.publish(version)
            for retries in range(3):  # a worker Ray restarts mid-sync reads the same buckets once it is back
                try:
                    load_s = ray.get([w.update_weights.remote(manifest) for w in self.workers])
                    break
                except ACTOR_LOST:
                    if retries == 2:
                        raise
                    for w in self.workers:
                        wait_until_ready(w)
            del manifest  # the objects are freed as soon as no one holds the manifest
        else:
            helpers = [r.help_gather.remote() for r in self.ranks[1:]]
            retries = 0
            sent = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape in self.meta)
            send = self.ranks[0].broadcast_weights.remote()
            receives = [w.receive_broadcast.remote(version, self.meta, self.complete) for w in self.workers]
            stats = {"sync_send_s": self._all([send, *helpers], "weight sync")[0], "sync_mb": sent / 2**20}
            load_s = ray.get(receives)
        return {"sync_s": time.perf_counter() - start, **stats, "sync_load_s": max(load_s), "sync_retries": retries}

    def publish(self, version: int) -> tuple:
        """Put the weights of `version` in the object store (object-store transport): (their manifest, which each
        rollout worker's `update_weights` loads, {"sync_send_s", "sync_mb"})."""
        helpers = [r.help_gather.remote() for r in self.ranks[1:]]
        publish = self.ranks[0].publish_weights.remote(version, self.cfg.cluster.sync_bucket_mb)
        (manifest, send_s), *_ = self._all([publish, *helpers], "weight sync")
        return manifest, {"sync_send_s": send_s, "sync_mb": manifest.num_bytes / 2**20}

    def sequence_logprobs(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        return self._all([r.sequence_logprobs.remote(sequences, images) for r in self.ranks], "a logprob check")[0]

    def fidelity(self, workers: list, trajectories: ray.ObjectRef, n: int = 4, version: int = 0,
                 restore: Callable[[int], None] | None = None, attempts: int = 3) -> float:
        """Max |engine logprob - learner logprob| over the first `n` of a share of trajectories, on every rollout
        worker, under the weights just synced (`version`). A worker lost during the check, or restarted by Ray with
        older weights, is checked again once it answers and `restore(i)` has given worker i the current weights (as
        a lost share is generated again); raises after `attempts` such failures of one worker."""
        sample = ray.get(trajectories)[:n]
        seqs, images = [t.prompt_ids + t.response_ids for t in sample], [t.images for t in sample]
        learner = self.sequence_logprobs(seqs, images)
        worst = 0.0
        for i, worker in enumerate(workers):
            for attempt in range(attempts + 1):
                try:
                    engine = ray.get(worker.prompt_logprobs.remote(seqs, images))
                    held = ray.get(worker.ready.remote())["version"]  # after the call: a restart shows here
                    if held >= version:
                        break
                    problem = f"restarted with the weights of version {held}"
                except ACTOR_LOST as e:
                    problem = f"lost ({type(e).__name__})"
                if attempt == attempts:
                    raise RuntimeError(f"RolloutWorker-{i} failed {attempts + 1} times in the fidelity check: "
                                       f"{problem}")
                log.warning("RolloutWorker-%d %s in the fidelity check; checking it again with the current weights",
                            i, problem)
                wait_until_ready(worker)
                if restore is not None:
                    restore(i)
            worst = max([worst] + [abs(e - l) for ours, theirs in zip(learner, engine)
                                   for l, e in zip(ours, theirs, strict=True)])
        return worst

    def save(self, checkpoint_dir) -> None:
        self._all([r.save.remote(str(checkpoint_dir)) for r in self.ranks], "checkpoint save")

    def shares(self, checkpoint_dir, driver_node: str) -> dict[int, dict[str, str]]:
        """{rank: {file: sha256}} of the checkpoint files each node other than the driver's holds, listed by the
        first rank on that node."""
        firsts = {node: rank for rank, node in reversed(list(enumerate(self.nodes))) if node != driver_node}
        listed = self._all([self.ranks[r].share.remote(str(checkpoint_dir)) for r in firsts.values()], "checkpoint",
                           list(firsts.values()))
        return dict(zip(firsts.values(), listed))

    def upload_shares(self, checkpoint_dir, assigned: dict[int, list[str]], destination: str):
        """Start each rank's upload of its `assigned` files; returns a function that waits for them all."""
        uploading = [r for r, names in assigned.items() if names]
        calls = [self.ranks[r].upload_share.remote(str(checkpoint_dir), assigned[r], destination) for r in uploading]
        return lambda: self._all(calls, "checkpoint upload", uploading) if calls else None

    def shutdown(self) -> None:
        """Leave the process groups where the ranks are alive (ray.wait: a stopped group's calls fail at once)."""
        calls = [r.shutdown.remote() for r in self.ranks]
        ray.wait(calls, num_returns=len(calls), timeout=60)
        for r in self.ranks:
            ray.kill(r)
