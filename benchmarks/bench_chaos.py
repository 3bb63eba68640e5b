"""Chaos: a tiny-model run while a thread of the driver kills one of its actors at a time, of any role, and the checks
that the run still came out whole.

    python benchmarks/bench_chaos.py [--steps 40] [--every 20 40] [--max-kills 10] [--seed 0] [--baseline-s S]
                                     [extra dotted.key=value overrides]

The same run goes first without kills (its wall time is the baseline; `--baseline-s` gives one measured before),
then with them. Rollout workers, reward actors and retrievers are killed so that Ray restarts them; a learner rank is
killed for good, and the trainer's in-run restart of the learner group (fault_tolerance.max_learner_restarts, raised
here to the number of kills) brings it back from the newest checkpoint. Afterwards: every step in metrics.jsonl
exactly once, every checkpoint verifying against its manifest, the last record's weight version equal to its step,
the closing evaluation (eval.json) written, and every kill survived. Prints kills and survivals by role and the time
lost, writes benchmarks/results/chaos.json, and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from actors.retriever import Retriever  # noqa: E402
from actors.rollout_worker import RolloutWorker  # noqa: E402
from cluster.ray_session import ACTOR_LOST  # noqa: E402
from learners import checkpoint as ckpt  # noqa: E402
from learners.learner_worker import LearnerWorker  # noqa: E402
from learners.services import _process_id  # noqa: E402
from learners.traces import line_step  # noqa: E402
from rewards.reward_actor import RewardActor  # noqa: E402

log = logging.getLogger("medray.chaos")

#: The roles killed, by actor name prefix: the key of their `actor_restarts/<key>` metric and their actor class.
ROLES = {"RolloutWorker": ("rollout", RolloutWorker), "LearnerWorker": ("learner", LearnerWorker),
         "RewardActor": ("reward", RewardActor), "Retriever": ("retriever", Retriever)}


def max_restarts(role: str) -> int:
    """How often Ray restarts an actor of `role` (its class's `max_restarts`); 0 for learner ranks, which the trainer
    replaces instead."""
    return ROLES[role][1]._default_options.get("max_restarts", 0)


#: Batches for a step of well under a second here (4 prompts x 4 samples of up to 16 tokens a turn), for short runs.
SMALL_BATCH = ("rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=16",
               "learner.micro_batch_size=8")


def chaos_config(out: Path, steps: int, checkpoint_every: int, max_kills: int, *overrides: str):
    """configs/tiny.yaml (its batch: a step of seconds here) with a checkpoint every `checkpoint_every` steps, all of
    them kept (each is verified afterwards), a closing held-out evaluation, and a learner restart for every kill."""
    from learners.config import load_config
    return load_config("configs/tiny.yaml", [
        f"output_dir={out}", f"total_steps={steps}", f"checkpoint.every={checkpoint_every}",
        f"checkpoint.keep_last={steps}", "logging.progress_bar=false",
        f"fault_tolerance.max_learner_restarts={max_kills}", "eval.data=[hpo:mcq_test]", "eval.limit=8",
        "eval.batch_size=8", "eval.at_start=false", *overrides])


class Killer(threading.Thread):
    """Kills a run's actors from the driver, one at a time: the first `every` (a (low, high) range of seconds, drawn
    uniformly with `seed`) after the run's first step is logged, each next one as long after the previous kill but
    never before that actor is back and the run has logged a step since. At most `max_kills`; none once the run has
    logged `total_steps - 1` steps, so the last step, and the evaluation it ends with, runs whole and every kill is
    followed by a step that can notice it. The target is a random role among ROLES then a random actor of it, or
    `plan[i]`'s role for kill i; an actor Ray restarts is killed at most its `max_restarts` times.

    `kills`: one record per kill: role, name, at_s (since the thread started), step (steps logged then), back_s (when
    an actor of that name answered from a new process), recovered_s (when the run had logged a step after that) and
    survived (both happened within `recover_timeout_s`). `halt()` stops it at once."""

    def __init__(self, out: Path, total_steps: int, every: tuple[float, float] = (20.0, 40.0), max_kills: int = 10,
                 seed: int = 0, plan: list[str] | None = None, recover_timeout_s: float = 600.0):
        super().__init__(name="chaos-killer", daemon=True)
        self.metrics = Path(out) / "metrics.jsonl"
        self.total_steps, self.every, self.max_kills, self.plan = total_steps, every, max_kills, plan
        self.recover_timeout_s = recover_timeout_s
        self.rng = random.Random(seed)
        self.stopped = threading.Event()
        self.kills: list[dict] = []
        self.killed: Counter = Counter()  # kills per actor id: Ray's restart budget is per actor
        self.started = 0.0

    def halt(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        self.started = time.monotonic()
        while self.steps_logged() < 1:
            if self.stopped.wait(0.5):
                return
        due = time.monotonic() + self.rng.uniform(*self.every)
        while len(self.kills) < self.max_kills:
            if self.stopped.wait(max(0.0, due - time.monotonic())) or self.steps_logged() >= self.total_steps - 1:
                return
            record = self.kill_one()
            if record is None:  # no target right now (an actor between lives): look again shortly
                due = time.monotonic() + 1.0
                continue
            self.kills.append(record)
            self.await_recovery(record)
            if not record["survived"]:
                return
            due = self.started + record["at_s"] + self.rng.uniform(*self.every)

    def steps_logged(self) -> int:
        try:
            lines = self.metrics.read_text().splitlines()
        except OSError:  # not written yet
            return 0
        # a step-0 line is the evaluation of the base weights; a torn line (being written) is no step yet
        return sum(1 for line in lines if 0 < line_step(line) < math.inf)

    def targets(self) -> dict[str, list[tuple[str, str]]]:
        """{role: [(name, namespace)]} of the named actors alive or restarting now."""
        found: dict[str, list] = {}
        for actor in ray.util.list_named_actors(all_namespaces=True):
            match = re.fullmatch(r"(\w+)-\d+", actor["name"])
            if match and match.group(1) in ROLES:
                found.setdefault(match.group(1), []).append((actor["name"], actor["namespace"]))
        return found

    def kill_one(self) -> dict | None:
        """Kill one target; its record, or None when none could be killed now."""
        found = self.targets()
        if not found:
            return None
        role = self.plan[len(self.kills)] if self.plan else self.rng.choice(sorted(found))
        if role not in found:
            return None
        name, namespace = self.rng.choice(sorted(found[role]))
        try:
            handle = ray.get_actor(name, namespace=namespace)
            if self.killed[handle._actor_id.hex()] >= max_restarts(role) > 0:
                return None  # a last life left alone: killing it would end the run, not test its recovery
            pid = ray.get(handle.__ray_call__.remote(_process_id), timeout=60)
        except (ValueError, ray.exceptions.GetTimeoutError, *ACTOR_LOST):
            return None
        if self.stopped.is_set() or self.steps_logged() >= self.total_steps - 1:  # the run moved on meanwhile
            return None
        ray.kill(handle, no_restart=max_restarts(role) == 0)
        self.killed[handle._actor_id.hex()] += 1
        record = {"role": role, "name": name, "at_s": round(time.monotonic() - self.started, 1),
                  "step": self.steps_logged(), "pid": pid, "back_s": None, "recovered_s": None, "survived": False}
        log.warning("chaos: killed %s (pid %d) after %d steps", name, pid, record["step"])
        return record

    def await_recovery(self, record: dict) -> None:
        """Fill in `record`'s back_s, recovered_s and survived, waiting for them (see the class)."""
        killed_at, back_at = time.time(), None
        deadline = time.monotonic() + self.recover_timeout_s
        while time.monotonic() < deadline:
            if back_at is None:
                pid = self.pid_of(record["name"])
                if pid is not None and pid != record["pid"]:
                    back_at = time.time()
                    record["back_s"] = round(back_at - killed_at, 1)
            elif self.metrics.stat().st_mtime > back_at:  # a line logged since: any learner restart is over
                record["recovered_s"] = round(time.time() - killed_at, 1)
                record["survived"] = True
                return
            if self.stopped.wait(0.5):
                return

    @staticmethod
    def pid_of(name: str) -> int | None:
        """The process id the actor called `name` answers from, None while there is none to answer."""
        namespace = next((a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["name"] == name), None)
        try:
            return ray.get(ray.get_actor(name, namespace=namespace).__ray_call__.remote(_process_id), timeout=10)
        except (ValueError, ray.exceptions.GetTimeoutError, *ACTOR_LOST):
            return None


def timed_run(cfg, killer: Killer | None = None) -> tuple[float, str | None]:
    """`Trainer(cfg).fit()` in this process, so that `killer`, started with it, shares its Ray: (wall seconds, None
    or the error that ended the run)."""
    from learners.trainer import Trainer
    start, error = time.perf_counter(), None
    if killer is not None:
        killer.start()
    try:
        Trainer(cfg).fit()
    except Exception as e:  # noqa: BLE001  reported as the failed check it is
        log.exception("the run failed")
        error = f"{type(e).__name__}: {next(iter(str(e).splitlines()), '')}"
    finally:
        if killer is not None:
            killer.halt()
            killer.join(timeout=30)
    return time.perf_counter() - start, error


def check_run(out: Path, total_steps: int, kills: list[dict], error: str | None = None) -> dict[str, str | None]:
    """The run in `out` after `kills` (`error`: what ended it, from `timed_run`): {check: None when it passes, else
    what is wrong}."""
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steps = [r["step"] for r in records if r["step"] > 0]  # a step-0 line is the evaluation of the base weights
    counts = Counter(steps)
    wrong = [f"step {s} x{counts[s]}" for s in range(1, total_steps + 1) if counts[s] != 1] + \
        [f"step {s} (past the end)" for s in counts if not 1 <= s <= total_steps]
    checkpoints = sorted(out.glob("checkpoints/step_*"), key=lambda p: int(p.name[5:]))
    damaged = [f"{p.name}: {problem}" for p in checkpoints if (problem := ckpt.verify(p))]
    latest = out / "checkpoints" / "latest"
    if not checkpoints or not latest.is_symlink() or latest.resolve().name != f"step_{total_steps}":
        damaged.append(f"checkpoints/latest is not step_{total_steps}")
    last = records[-1] if records else {}
    evaluation = out / "eval.json"
    evaluated = json.loads(evaluation.read_text())["steps"] if evaluation.is_file() else []
    lost = [f"{k['name']} at {k['at_s']} s" for k in kills if not k["survived"]]
    return {
        "run completed": error,
        f"steps 1-{total_steps} logged once each": (", ".join(wrong) or None) if steps else "no step logged",
        f"every checkpoint verifies ({len(checkpoints)})": "; ".join(damaged) or None,
        "weight version == step, last record": None if last.get("weight_version") == last.get("step") == total_steps
        else f"step {last.get('step')}, weight version {last.get('weight_version')}",
        "closing evaluation written (eval.json)": None if total_steps in evaluated
        else f"eval.json {'evaluates steps ' + str(evaluated) if evaluation.is_file() else 'missing'}",
        f"every kill survived ({len(kills)})": "not survived: " + ", ".join(lost) if lost else None,
    }


def role_rows(kills: list[dict], last: dict) -> list[dict]:
    """Kills and survivals by role, with the restarts the run itself counted (`actor_restarts/<role>`)."""
    return [{"role": role, "kills": sum(k["role"] == role for k in kills),
             "survived": sum(k["role"] == role and k["survived"] for k in kills),
             "run_counted": last.get(f"actor_restarts/{key}", 0),
             "max_recovered_s": max((k["recovered_s"] or 0 for k in kills if k["role"] == role), default=None)}
            for role, (key, _) in ROLES.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=float, nargs=2, default=(20.0, 40.0), metavar=("LOW", "HIGH"),
                        help="seconds between kills, drawn uniformly")
    parser.add_argument("--max-kills", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="of the kill schedule")
    parser.add_argument("--baseline-s", type=float, default=None,
                        help="wall seconds of the same run without kills, measured before (default: run it first)")
    parser.add_argument("--out", default="outputs/bench_chaos", help="the runs' output_dirs go under it, replaced")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from benchmarks.common import report

    def fresh(name: str):
        out = Path(args.out) / name
        shutil.rmtree(out, ignore_errors=True)  # a fresh run refuses an output_dir that holds one
        return out, chaos_config(out, args.steps, args.checkpoint_every, args.max_kills, *args.overrides)

    from cluster.ray_session import start_or_join
    start_or_join(chaos_config(Path(args.out), args.steps, 1, 0).cluster)  # Ray's own start-up is in neither time
    baseline_s, error = (args.baseline_s, None) if args.baseline_s is not None else timed_run(fresh("baseline")[1])
    if error:
        sys.exit(f"the baseline run failed: {error}")
    out, cfg = fresh("chaos")
    killer = Killer(out, args.steps, tuple(args.every), args.max_kills, args.seed)
    wall_s, error = timed_run(cfg, killer)
    checks = check_run(out, args.steps, killer.kills, error)
    records = (out / "metrics.jsonl").read_text().splitlines()
    rows = role_rows(killer.kills, json.loads(records[-1]) if records else {})
    rows.append({"role": "all", "kills": len(killer.kills), "survived": sum(k["survived"] for k in killer.kills),
                 "wall_s": round(wall_s, 1), "baseline_wall_s": round(baseline_s, 1),
                 "time_lost_s": round(wall_s - baseline_s, 1)})
    path = report("chaos", rows)
    for name, problem in checks.items():
        print(f"{'PASS' if problem is None else 'FAIL'}  {name}{'' if problem is None else ': ' + problem}")
    result = json.loads(path.read_text())
    result.update(command=" ".join(sys.argv), checks={name: problem or "pass" for name, problem in checks.items()},
                  kills=killer.kills)
    path.write_text(json.dumps(result, indent=1))
    sys.exit(1 if any(checks.values()) else 0)


if __name__ == "__main__":
    main()
