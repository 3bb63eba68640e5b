"""Fully asynchronous rollouts (`async: fully_async`, as AReaL and verl's fully async mode): the rollout workers sample
continuously, the learner trains on whole groups as they finish, and new weights reach each worker between its
slices of generation, episodes in flight included (partial rollouts: each token keeps the version that sampled it).

One feeder thread per worker keeps it busy: between slices it hands over the newest weights, admits new groups and
sends the finished ones to a reward actor. The staleness bound is kept at admission (AReaL): a group is admitted only
while fewer than (max_staleness + 1) x prompts_per_step groups are outstanding (admitted and not yet trained on), so
it trains at most max_staleness versions after the weights it was admitted under. A group older than that anyway
(a worker that took its weights late) is dropped and counted. Within the bound the ratio to the behaviour policy
(the engine's log-probabilities, each token's under the weights that sampled it) corrects the lag, as in any step.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

import ray

from actors.rollout_worker import RolloutCall
from actors.trajectory import GroupSummary, RolloutSummary, SliceSummary
from cluster.ray_session import ACTOR_LOST, wait_until_ready
from learners.dynamic_sampling import informative
from learners.metrics import sample_totals

log = logging.getLogger("medray.stream")

SLICE_S = 2.0  # a worker takes new weights and new groups this often: the lag a sync adds, against per-call overhead


@dataclass
class StreamedGroup:
    """A finished group: its trajectories and their scores (refs), and the worker's summary of it."""
    trajectories: ray.ObjectRef
    scores: ray.ObjectRef
    summary: GroupSummary

    version = property(lambda self: self.summary.version)
    partial = property(lambda self: self.summary.partial)


class RolloutStream:
    """`call_for(groups)`: the RolloutCall that samples the stream's group numbers `groups`. `first_group`: the
    number of the first group (a stage resumed at step s starts at s x prompts_per_step). `restore(i)`: gives a
    worker Ray restarted the current weights; it is called on the trainer's thread (in `take` or a pause), since
    it syncs through the learner group, which only that thread calls. `uniform_drops`: dynamic sampling, the groups
    whose rewards are all equal a batch may drop (then it keeps them, as the synchronous refill does after its last
    round)."""

    def __init__(self, workers: list, rewarders: list, call_for: Callable[[list[int]], RolloutCall],
                 prompts_per_step: int, max_staleness: int, version: int, first_group: int,
                 restore: Callable[[int], None], uniform_drops: int = 0):
        self.workers, self.rewarders, self.call_for, self.restore = workers, rewarders, call_for, restore
        self.per_step, self.bound = prompts_per_step, (max_staleness + 1) * prompts_per_step
        self.max_staleness, self.uniform_drops = max_staleness, uniform_drops
        self.capacity = math.ceil(prompts_per_step / len(workers))  # groups in flight a worker, as in a sync step
        self.cond = threading.Condition()
        self.version, self.manifest = version, None  # the newest weights and their object-store manifest
        self.next_group, self.outstanding = first_group, 0
        self.retry: list[int] = []                          # groups lost with a worker, to sample again
        self.lost: set[int] = set()                         # workers Ray restarted, waiting for their weights
        self.assigned: list[set[int]] = [set() for _ in workers]
        self.ready: dict[int, StreamedGroup] = {}
        self.slices: list[tuple[int, SliceSummary]] = []    # (worker, its slice's summary) since the last batch
        self.counts = {"stale_dropped": 0, "groups_filtered": 0}
        self.paused = self.closed = False
        self.held = [version] * len(workers)               # the weight version each worker holds
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._feed, args=(i,), name=f"feed-RolloutWorker-{i}", daemon=True)
                        for i in range(len(workers))]
        for thread in self.threads:
            thread.start()

    # ---- the trainer's side -------------------------------------------------------------------------------------
    def take(self) -> tuple[list[StreamedGroup], list[dict], list[dict], dict]:
        """The next batch: prompts_per_step finished groups, oldest first, none older than the bound allows (and
        with dynamic sampling, up to `uniform_drops` groups whose rewards are all equal dropped). Returns (groups,
        their score dicts, the score dicts of the groups dropped for equal rewards, stream statistics)."""
        batch, scores, filtered = [], [], []
        while len(batch) < self.per_step:
            if self._restore_lost(lambda: bool(self.ready)):
                continue
            with self.cond:
                group = self.ready.pop(min(self.ready))
                stale = group.version < self.version - self.max_staleness
            score = ray.get(group.scores)
            empty = self.counts["groups_filtered"] < self.uniform_drops and \
                not informative(sample_totals([score]), len(group.summary.lengths))
            if stale or empty:
                with self.cond:
                    self.counts["stale_dropped" if stale else "groups_filtered"] += 1
                    self.outstanding -= 1
                    self.cond.notify_all()
                filtered += [score] if empty and not stale else []
                continue
            batch.append(group)
            scores.append(score)
        with self.cond:
            slices, self.slices = self.slices, []
            counts, self.counts = self.counts, {k: 0 for k in self.counts}
        lags = [self.version - g.version for g in batch]
        stats = {**counts, "version_lag_max": max(lags), "version_lag_mean": sum(lags) / len(lags),
                 **{f"groups_lag_{lag}": lags.count(lag) for lag in sorted(set(lags))},
                 "partial_groups": sum(g.partial for g in batch), "stream_slices": len(slices)}
        return batch, scores, filtered, {**stats, "slices": slices}

    def trained(self, version: int, manifest) -> None:
        """A batch was trained on and `version`'s weights published (`manifest`): the feeders hand them over."""
        with self.cond:
            self.version, self.manifest = version, manifest
            self.outstanding -= self.per_step
            self.cond.notify_all()

    @contextlib.contextmanager
    def paused_and_current(self):
        """While the body runs, the workers hold no streamed episode and have the newest weights (an evaluation, a
        fidelity check: they run the engine themselves). Groups in flight finish first; none is admitted meanwhile."""
        with self.cond:
            self.paused = True
            self.cond.notify_all()
        while self._restore_lost(lambda: all(not assigned and held >= self.version
                                             for assigned, held in zip(self.assigned, self.held))):
            pass
        try:
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def close(self) -> None:
        """Stop the feeders and drop what the workers still hold of the stream."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join()
        with contextlib.suppress(*ACTOR_LOST):
            ray.get([w.drop_stream.remote() for w in self.workers])

    # ---- a worker's feeder --------------------------------------------------------------------------------------
    def _feed(self, i: int) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.closed or self._work(i) != "idle")
                    if self.closed:
                        return
                    version, manifest = self.version, self.manifest
                    admitted = self._admit(i) if self._work(i) == "admit" else []
                try:
                    if version > self.held[i] and manifest is not None:
                        ray.get(self.workers[i].update_weights.remote(manifest))
                        with self.cond:
                            self.held[i] = version
                            if all(held >= self.version for held in self.held):
                                self.manifest = None  # every worker has it: the object store lets it go
                            self.cond.notify_all()
                    if admitted or self.assigned[i]:
                        self._slice(i, admitted)
                except ACTOR_LOST as err:
                    self._lost(i, err)
        except BaseException as err:  # noqa: BLE001  the trainer raises it from take()
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _work(self, i: int) -> str:
        """What worker i should do next: "weights" to take, "admit" new groups, "continue" those in flight, "idle"."""
        if i in self.lost:
            return "idle"
        if self.version > self.held[i] and self.manifest is not None:
            return "weights"
        if not self.paused and (self.retry or self.outstanding < self.bound) and len(self.assigned[i]) < self.capacity:
            return "admit"
        return "continue" if self.assigned[i] else "idle"

    def _admit(self, i: int) -> list[int]:
        """Group numbers for worker i: lost ones first, then new ones within the staleness bound."""
        room = self.capacity - len(self.assigned[i])
        groups, self.retry = self.retry[:room], self.retry[room:]
        new = max(0, min(room - len(groups), self.bound - self.outstanding))
        groups += list(range(self.next_group, self.next_group + new))
        self.next_group += new
        self.outstanding += new
        self.assigned[i].update(groups)
        return groups

    def _slice(self, i: int, admitted: list[int]) -> None:
        """One slice of worker i: its finished groups go to a reward actor and join the ready ones."""
        call = self.call_for(admitted)
        *groups, summary = self.workers[i].stream.options(num_returns="streaming").remote(call, SLICE_S)
        summary = ray.get(summary)
        with self.cond:
            for ref, meta in zip(groups, summary.groups):
                scores = self.rewarders[meta.group % len(self.rewarders)].score.remote(ref)
                self.ready[meta.group] = StreamedGroup(ref, scores, meta)
                self.assigned[i].discard(meta.group)
            self.slices.append((i, summary))
            self.cond.notify_all()

    def _lost(self, i: int, err: BaseException) -> None:
        """Worker i died: its groups are sampled again (by whichever worker has room first), and once Ray has
        restarted it the trainer's thread gives it the current weights (`_restore_lost`)."""
        log.warning("RolloutWorker-%d lost (%s); sampling its %d groups again", i, type(err).__name__,
                    len(self.assigned[i]))
        wait_until_ready(self.workers[i])
        with self.cond:
            self.retry += sorted(self.assigned[i])
            self.assigned[i] = set()
            self.lost.add(i)
            self.cond.notify_all()

    def _restore_lost(self, done: Callable[[], bool]) -> bool:
        """On the trainer's thread: wait until `done()` holds or a worker is lost; restore a lost one (then return
        True: the caller checks again). Raises what a feeder raised."""
        with self.cond:
            self.cond.wait_for(lambda: done() or self.lost or self.error)
            self._raise()
            if not self.lost:
                return False
            i = self.lost.pop()
        self.restore(i)
        with self.cond:
            self.held[i] = self.version
            self.cond.notify_all()
        return True

    def summaries(self, batch: list[StreamedGroup], slices: list[tuple[int, SliceSummary]]) -> list[RolloutSummary]:
        """The batch as one rollout summary: its groups' lengths, finish reasons and environment calls, the slices'
        (`take`'s "slices": (worker, summary) pairs) environment errors and idle time, each worker's generating time
        since the last batch (the longest), and each worker's peak memory in its last slice."""
        busy = [sum(s.seconds for w, s in slices if w == i) for i in range(len(self.workers))]
        last = {w: s.peak_memory_gb for w, s in slices}
        return [RolloutSummary(lengths=[n for g in batch for n in g.summary.lengths],
                               finish_reasons=[r for g in batch for r in g.summary.finish_reasons],
                               policy_tokens=sum(g.summary.policy_tokens for g in batch),
                               env_calls=sum(g.summary.env_calls for g in batch),
                               env_errors=sum(s.env_errors for _, s in slices),
                               idle_s=sum(s.idle_s for _, s in slices),
                               seconds=max(busy), version=min(g.version for g in batch),
                               peak_memory_gb={k: max(p[k] for p in last.values() if k in p)
                                               for k in {k for p in last.values() for k in p}})]

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fully asynchronous rollouts failed: {type(self.error).__name__}: "
                               f"{self.error}") from self.error
