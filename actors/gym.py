"""The medical tool Gym (MedVistaGym, the MedVistaGym paper; MedVR's zoom-in, the MedVR paper): tool
calls parsed from the policy's text, checked, run on tool actors, and answered with evidence.

One set of rules serves two callers:

- :class:`ToolEnvironment` is the :class:`~actors.environment.Environment` the rollout engine calls with every action
  one engine step produced: each action is the JSON inside the grammar's action tag,
  ``<tool_call>{"name": "zoom_in", "arguments": {"box": [x0, y0, x1, y1]}}</tool_call>``; calls that pass the checks
  are grouped by tool and sent as ONE batched call per tool actor; the others get an error observation at once.
- :class:`MedicalGym` is the Gym API over the same environment for one episode: ``reset(task) -> observation``
  (question text and images) and ``step(action) -> observation, done, info``, synchronous (scripted experts, tests).

Episode rules, checked in this order (MedVistaGym sec. 3 and its prompt): the action must be a JSON object
``{"name", "arguments"}``; the tool must exist and be allowed by the recipe; its arguments must validate (a box inside
the image, ...) -- a failure is an observation the policy reads, and the episode goes on; a call identical (same tool,
same normalised arguments) to one already executed in the episode ends it (``finish: repeated_call``); a call beyond
``max_tool_calls`` executed calls ends it (``finish: tool_limit``). The grammar's ``max_turns`` caps all turns,
failed ones included.

Each turn's record (kept in the trajectory; rewards read it): an executed call has ``tool`` (what MedVistaGym's
tool reward counts), ``args`` (normalised), ``box`` when the call named one (MedVR's CCA reads zoom_in boxes),
``boxes``/``scores`` and ``measurements`` from the tool, and ``error: None``. A call that was not executed, or
failed, has ``requested`` (the tool name, if any) instead of ``tool``, the ``args`` as written, and ``error``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import ray
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.environment import Environment
from actors.episode import Episode, Observation
from actors.grammar import Grammar
from actors.tool_actor import ToolActor, tool_actor_name
from actors.tools import TOOLS, ToolArgs, ToolArgumentError, ToolCall, ToolContext, ToolResult, tool_class


class ToolActorConfig(BaseModel):
    """Resources of one tool's actors and the tool's constructor options."""
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="actors serving this tool; batches go round-robin")
    num_cpus: float = Field(0.25, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    threads: int = Field(1, ge=1, description="OpenMP/MKL threads inside the actor")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="tool constructor kwargs, e.g. biomedclip_labels: {path: DIR}")


class ToolsConfig(BaseModel):
    """`tools:` of a recipe: which tool actors to start, which tools the policy may call, the per-episode cap."""
    model_config = ConfigDict(extra="forbid")

    tools: dict[str, ToolActorConfig] = Field(default_factory=lambda: {"zoom_in": ToolActorConfig()})
    allowed: list[str] | None = Field(None, description="tools the policy may call; null: every tool in `tools`")
    max_tool_calls: int = Field(6, ge=1, description="executed tool calls per episode (MedVR/MedVistaGym: 6)")
    timeout_s: float = Field(60.0, gt=0, description="seconds to wait for a tool actor's batch")
    observe_images: bool = Field(True, description="hand image evidence (crops, enhanced regions) to the policy; "
                                                   "false for a text-only policy, which reads the text alone")

    @model_validator(mode="after")
    def _known(self) -> ToolsConfig:
        unknown = sorted(set(self.tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"field 'tools': unknown tool(s) {unknown}; registered: {sorted(TOOLS)}")
        if self.allowed is not None and not set(self.allowed) <= set(self.tools):
            raise ValueError(f"field 'allowed': {sorted(set(self.allowed) - set(self.tools))} not in 'tools'")
        return self

    @property
    def allowed_tools(self) -> list[str]:
        return list(self.allowed if self.allowed is not None else self.tools)


def parse_tool_call(action: str) -> tuple[str, Any]:
    """The text inside the action tag -> (tool name, raw arguments); ToolArgumentError says what is malformed."""
    shape = 'write {"name": "<tool>", "arguments": {...}}'
    if not action.strip():
        raise ToolArgumentError(f"empty tool call: {shape}")
    try:
        call = json.loads(action)
    except json.JSONDecodeError as e:
        raise ToolArgumentError(f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                                f"{shape}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolArgumentError(f"the tool call must be a JSON object with a string 'name': {shape}")
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        raise ToolArgumentError(f"unexpected key(s) {extra} in the tool call: {shape}")
    return call["name"], call.get("arguments", {})


@dataclass(frozen=True)
class PlannedCall:
    """A call that passed every check: run `name` with `args` on the task's images."""
    name: str
    args: ToolArgs
    context: ToolContext

    @property
    def record_args(self) -> dict:
        return self.args.model_dump(mode="json")


def rejected(message: str, name: str | None = None, args: Any = None, finish: str | None = None) -> Observation:
    """A call that is not executed: the policy reads why; `finish` ends the episode."""
    record = {"requested": name, "args": args, "error": message, **({"finish": finish} if finish else {})}
    return Observation(text=f"error: {message}", record=record, done=finish is not None)


def tool_observation(call: PlannedCall, result: ToolResult | None, error: str | None,
                     images: bool = True) -> Observation:
    """A tool's answer (or the failure that replaced it) as text, images (unless `images` is false) and the turn's
    record."""
    error = error or (result.error if result is not None else "no result")
    if error is not None:
        return Observation(text=f"{call.name} failed ({error}); continue without it",
                           record={"requested": call.name, "args": call.record_args, "error": error})
    record: dict[str, Any] = {"tool": call.name, "args": call.record_args, "error": None}
    if getattr(call.args, "box", None) is not None:
        record["box"] = list(call.args.box)
    if result.boxes:
        record["boxes"] = result.boxes
    if result.scores:
        record["scores"] = result.scores
    if result.measurements:
        record["measurements"] = result.measurements
    return Observation(text=result.text, record=record, images=list(result.images) if images else [])


def plan_call(task: dict, turns: list[dict], action: str, allowed: list[str],
              max_tool_calls: int) -> PlannedCall | Observation:
    """The episode rules (module doc) for one action of an episode on `task` with turn records `turns`: a call to run,
    or the observation that replaces it. Pure: training's environment and the served agent's tools share it."""
    try:
        name, raw = parse_tool_call(action)
    except ToolArgumentError as e:
        return rejected(str(e))
    if name not in allowed:
        known = "is not available here" if name in TOOLS else "does not exist"
        return rejected(f"tool {name!r} {known}; available tools: {', '.join(allowed)}", name, raw)
    context = ToolContext.from_task(task)
    try:
        call = PlannedCall(name, tool_class(name).validate(raw, context), context)
    except ToolArgumentError as e:
        return rejected(str(e), name, raw)
    executed = [t for t in turns if "tool" in t]
    if any(t["tool"] == name and t["args"] == call.record_args for t in executed):
        return rejected(f"{name} was already called with these arguments; the episode ends", name,
                        call.record_args, finish="repeated_call")
    if len(executed) >= max_tool_calls:
        return rejected(f"the limit of {max_tool_calls} tool calls is reached; the episode ends", name,
                        call.record_args, finish="tool_limit")
    return call


class ToolEnvironment(Environment):
    """Tool calls of a batch of episodes -> one batched call per tool actor (see the module doc). Holds only actor
    handles and settings, so it travels to rollout workers: as its actors' names (ToolActor-<tool>-<i>, as
    start_tool_actors names them), looked up where it arrives."""
    role = "tool"

    def __init__(self, tool_actors: dict[str, list], allowed: list[str], max_tool_calls: int = 6,
                 timeout_s: float = 60.0, observe_images: bool = True):
        missing = sorted(set(allowed) - set(tool_actors))
        if missing:
            raise ValueError(f"allowed tool(s) {missing} have no actor")
        self.tool_actors, self.allowed = tool_actors, list(allowed)
        self.max_tool_calls, self.timeout_s, self.observe_images = max_tool_calls, timeout_s, observe_images
        self._turn = 0  # round-robin over a tool's replicas

    def __getstate__(self) -> dict:
        # An actor handle among an actor's constructor arguments is a reference Ray does not keep for the actor's
        # restart (ray-project/ray#53727); names are plain values, so a restarted rollout worker rebuilds this.
        return {**self.__dict__, "tool_actors": {name: len(replicas) for name, replicas in self.tool_actors.items()}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tool_actors = {name: [ray.get_actor(tool_actor_name(name, i)) for i in range(replicas)]
                            for name, replicas in self.tool_actors.items()}

    def plan(self, task: dict, turns: list[dict], action: str) -> PlannedCall | Observation:
        """Check one action against the episode so far: a call to run, or the observation that replaces it."""
        return plan_call(task, turns, action, self.allowed, self.max_tool_calls)

    def call(self, episodes: list[Episode], actions: list[str]) -> list:
        planned = [self.plan(ep.task, ep.turns, action) for ep, action in zip(episodes, actions)]
        rows_by_tool: dict[str, list[int]] = {}
        for i, p in enumerate(planned):
            if isinstance(p, PlannedCall):
                rows_by_tool.setdefault(p.name, []).append(i)
        out: list = list(planned)
        for name, rows in rows_by_tool.items():
            replicas = self.tool_actors[name]
            self._turn += 1
            ref = replicas[self._turn % len(replicas)].run_batch.remote(
                [ToolCall(planned[i].args, planned[i].context) for i in rows])
            for j, i in enumerate(rows):
                out[i] = (ref, j)
        return out

    def observe(self, episode: Episode, action: str, result, error: str | None) -> Observation:
        planned = self.plan(episode.task, episode.turns, action)  # the same call `call` sent: the checks are pure
        if isinstance(planned, Observation):
            return planned
        return tool_observation(planned, result, error, self.observe_images)

    def schemas(self) -> list[dict]:
        """The allowed tools' descriptions and argument schemas, for the policy's system prompt."""
        return [tool_class(name).schema() for name in self.allowed]

    def actors(self) -> list:
        return [actor for replicas in self.tool_actors.values() for actor in replicas]

    def health(self) -> dict[str, list[dict]]:
        return {name: ray.get([a.health.remote() for a in replicas]) for name, replicas in self.tool_actors.items()}

    def stats(self) -> dict[str, list[dict]]:
        """Per tool, each replica's counters (calls, batches, errors, seconds): the metrics a trainer logs."""
        return {name: ray.get([a.stats.remote() for a in replicas]) for name, replicas in self.tool_actors.items()}

    def shutdown(self) -> None:
        for actor in self.actors():
            ray.kill(actor)


def start_tool_actors(config: ToolsConfig, retriever=None) -> dict[str, list]:
    """One named actor per replica of each configured tool (ToolActor-<tool>-<i>), constructed, ready to call.
    `retriever` (a Retriever actor handle or a ShardedRetriever) is what retrieve_knowledge searches."""
    actors: dict[str, list] = {}
    for name, spec in config.tools.items():
        kwargs = dict(spec.options)
        if name == "retrieve_knowledge":
            if retriever is None:
                raise ValueError("tool 'retrieve_knowledge' needs a retriever: start one (actors.retriever) and "
                                 "pass it to make_tool_environment(config, retriever=...)")
            kwargs["retriever"] = retriever
        actors[name] = [ToolActor.options(name=tool_actor_name(name, i), num_cpus=spec.num_cpus,
                                          num_gpus=spec.num_gpus).remote(name, threads=spec.threads, **kwargs)
                        for i in range(spec.replicas)]
    ray.get([a.health.remote() for replicas in actors.values() for a in replicas])  # constructed, or raise here
    return actors


def make_tool_environment(config: ToolsConfig | dict, retriever=None) -> ToolEnvironment:
    """The factory the trainer calls: start the tool actors of `config` and the environment that calls them."""
    config = config if isinstance(config, ToolsConfig) else ToolsConfig.model_validate(config)
    return ToolEnvironment(start_tool_actors(config, retriever), config.allowed_tools, config.max_tool_calls,
                           config.timeout_s, config.observe_images)


def task_text(task: dict) -> str:
    """The question as the policy reads it: every prompt message's text, in order."""
    return "\n\n".join(m["content"] for m in task["messages"])


class MedicalGym:
    """The Gym API for one episode at a time over a :class:`ToolEnvironment` (the same checks and records as the
    rollout engine gets); calls run synchronously on the tool actors."""

    def __init__(self, environment: ToolEnvironment, grammar: Grammar | None = None):
        self.env = environment
        # by default room for as many failed calls as executed ones; the tool-call cap still applies
        self.grammar = grammar or Grammar(action_tag="tool_call", observation_tag="tool_response",
                                          max_turns=2 * environment.max_tool_calls)
        self.episode: Episode | None = None
        self.done = True

    def reset(self, task: dict | BaseModel) -> Observation:
        """Start an episode on `task` (a task record): the question text and its images (PIL, full resolution)."""
        task = task.model_dump(mode="json") if isinstance(task, BaseModel) else task
        self.episode, self.done = Episode(task=task, group=0, seed=0, prompt_ids=[]), False
        images = []
        for path in task.get("images") or []:
            with Image.open(path) as im:
                images.append(im.copy())
        return Observation(text=task_text(task), record={"task_id": task["id"]}, images=images)

    def step(self, action: str) -> tuple[Observation, bool, dict]:
        """One policy turn: text with a <tool_call> block (or the bare JSON call), or a final <answer>.
        Returns the observation, whether the episode is over, and info: the turn's record, turns so far, finish, and
        for a call that ran ``result``, the tool's whole :class:`ToolResult` (masks included: a trajectory's record
        keeps boxes and measurements only, since a full-image mask per turn would travel with every rollout)."""
        if self.done:
            raise RuntimeError("the episode is over: call reset(task) first")
        ep, g = self.episode, self.grammar
        answer = re.findall(rf"<{g.answer_tag}>(.*?)</{g.answer_tag}>", action, flags=re.S)
        if f"<{g.action_tag}>" in action:
            action = g.action_text(action)
        elif answer:
            return self._end(Observation(text="", record={"answer": answer[-1].strip()}, done=True), "answer")
        if len(ep.turns) >= g.max_turns:
            return self._end(Observation(text="", record={}, done=True), "turn_limit")
        pending, executed = self.env.call([ep], [action])[0], {}
        if not isinstance(pending, Observation):
            ref, index = pending
            try:
                result, error = ray.get(ref, timeout=self.env.timeout_s)[index], None
            except ray.exceptions.GetTimeoutError:
                result, error = None, "timeout"
            except Exception as e:  # noqa: BLE001  as in EpisodeRunner: the policy reads that the tool failed
                result, error = None, type(e).__name__
            pending = self.env.observe(ep, action, result, error)
            if pending.record.get("error") is None:
                executed["result"] = result
        ep.turns.append(pending.record)
        if pending.done:
            return self._end(pending, pending.record.get("finish", "environment"))
        return pending, False, {"record": pending.record, "turns": len(ep.turns), **executed}

    def _end(self, observation: Observation, finish: str) -> tuple[Observation, bool, dict]:
        self.done = True
        self.episode.finish_reason = finish
        return observation, True, {"record": observation.record, "turns": len(self.episode.turns), "finish": finish}
