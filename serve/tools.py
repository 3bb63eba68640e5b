"""Tools for the served agent: the run's tool Gym (actors/gym.py, MedVR / MedVistaGym) as a Serve deployment, and the
`serve.agent.Observe` that calls it.

A served episode gets what a training episode got: the Gym's checks (`actors.gym.plan_call`: the call's JSON, the
allowed tools, valid arguments, no repeated call, the tool-call cap) and its observations (`tool_observation`: the
tool's text, its image evidence, the turn's record). Tools address a task's images by path, so the request's images
are written once as PNG files named by their content hash (a bounded number kept) in the replica's own directory.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import tempfile
from collections import OrderedDict
from pathlib import Path

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.episode import Observation
from actors.gym import ToolsConfig, plan_call, tool_observation
from actors.tools import ToolCall, make_tool
from cluster.devices import pin_threads
from serve.agent import Observe
from serve.retrievers import CONSTRUCTOR_RETRIES, assigned_threads


class ImageFiles:
    """Request images as PNG files under `root`, named by the hash of their pixels; the oldest go beyond `keep`."""

    def __init__(self, root: Path, keep: int = 256):
        self.root, self.keep, self.paths = root, keep, OrderedDict()

    def paths_of(self, images: list) -> list[str]:
        return [self.path_of(image) for image in images]

    def path_of(self, image) -> str:
        data = io.BytesIO()
        image.save(data, format="PNG")
        name = hashlib.sha256(data.getvalue()).hexdigest()[:32]
        if name not in self.paths:
            path = self.root / f"{name}.png"
            path.write_bytes(data.getvalue())
            self.paths[name] = path
            while len(self.paths) > self.keep:
                self.paths.popitem(last=False)[1].unlink(missing_ok=True)
        self.paths.move_to_end(name)
        return str(self.paths[name])


@serve.deployment(name="Tools", ray_actor_options={"num_cpus": 0.5}, health_check_period_s=30,
                  max_constructor_retry_count=CONSTRUCTOR_RETRIES)
class ToolServer:
    """The tools of `tools` (a `ToolsConfig` as a dict) resident in the replica, one call at a time per replica
    (models need not be thread-safe); Serve scales and restarts it with the app. retrieve_knowledge searches a
    Retriever actor over `index_dir` that the replica starts and owns."""

    def __init__(self, tools: dict, index_dir: str | None = None, retrieval: dict | None = None):
        self.config = ToolsConfig.model_validate(tools)
        pin_threads(assigned_threads())
        self.tools = {name: make_tool(name, **self.tool_options(name, index_dir, retrieval))
                      for name in self.config.tools}
        self.workdir = tempfile.TemporaryDirectory(prefix="medray-serve-images-")
        self.images = ImageFiles(Path(self.workdir.name))

    def tool_options(self, name: str, index_dir: str | None, retrieval: dict | None) -> dict:
        options = dict(self.config.tools[name].options)
        if name == "retrieve_knowledge":
            from actors.retriever import Retriever
            if index_dir is None:
                raise ValueError("agent.tools: retrieve_knowledge needs a knowledge index (agent.index_dir)")
            options["retriever"] = Retriever.options(num_cpus=0).remote(index_dir, config=retrieval)
        return options

    def step(self, images: list, turns: list[dict], action: str) -> Observation:
        """One action of an episode on a request with `images` (PIL) whose turn records so far are `turns`."""
        planned = plan_call({"images": self.images.paths_of(images)}, turns, action, self.config.allowed_tools,
                            self.config.max_tool_calls)
        if not isinstance(planned, Observation):
            try:
                result, error = self.tools[planned.name].run_batch([ToolCall(planned.args, planned.context)])[0], None
            except Exception as e:  # noqa: BLE001  as in training: the policy reads that the tool failed
                result, error = None, type(e).__name__
            planned = tool_observation(planned, result, error, self.config.observe_images)
        return planned

    def ready(self) -> bool:
        """Answered once the tools are loaded (the constructor has returned)."""
        return True


def tool_observer(tools: DeploymentHandle, images: list, timeout_s: float) -> Observe:
    """The served agent's environment for a request with `images`: each action to the Tools deployment. A tool
    that does not answer within `timeout_s`, or a failed replica, is an observation the policy reads, as in training."""
    async def observe(action: str, turns: list[dict]) -> Observation:
        try:
            return await asyncio.wait_for(tools.step.remote(images, turns, action), timeout_s)
        except asyncio.TimeoutError:
            error = "timeout"
        except Exception as e:  # noqa: BLE001
            error = type(e).__name__
        return Observation(f"the tool call failed ({error}); continue without it",
                           {"requested": None, "args": None, "error": error})
    return observe
