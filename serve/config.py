"""What a served model is: the checkpoint, the engine, the limits every request is held to, and agent mode.

These are the application arguments of `serve run serve.app:app key=value ...` and of `args:` in a Serve config YAML
(configs/serve*.yaml). Replicas, autoscaling and resources per replica are Serve's own `deployments:` settings.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.environment import Grammar
from learners.cdir import THRESHOLD

API_KEY_ENV = "MEDRAY_API_KEY"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSettings(Strict):
    """The vLLM engine inside each replica."""
    backend: Literal["auto", "in_process", "async_llm"] = Field(
        "auto", description="in_process: LLMEngine stepped by a thread in the replica (starts in seconds; the CPU "
                            "default); async_llm: vLLM's AsyncLLM with its engine-core process (the GPU default)")
    dtype: str = Field("auto", description="auto: float32 on CPU, the checkpoint's dtype on GPU")
    max_model_len: int = Field(1024, ge=16)
    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache on CPU (on GPU: gpu_memory_utilization)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    threads: int | None = Field(None, ge=1, description="OpenMP threads on CPU; default: the replica's num_cpus, >= 1")
    seed: int = 0


class Limits(Strict):
    """Bounds on what one request may ask; anything beyond them is a 4xx, never a crash."""
    max_body_bytes: int = Field(8 << 20, ge=1024, description="request body, images included")
    max_prompt_tokens: int | None = Field(None, ge=1, description="default: max_model_len - 1")
    max_tokens: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    max_messages: int = Field(64, ge=1)
    max_images: int = Field(4, ge=0, description="image parts per request")
    max_image_bytes: int = Field(4 << 20, ge=1, description="decoded size of one image")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="width * height of one image")
    image_roots: list[str] = Field(default_factory=list,
                                   description="directories image paths may point into (none: paths are refused)")


class AgentSettings(Strict):
    """Agent mode: the reasoning-with-retrieval loop, selected per request by model id `<name>-agent` or an
    `agent` field in the request."""
    index_dir: str | None = Field(None, description="retrieval index (python -m actors.build_index); none: no agent")
    retrieval: dict = Field(default_factory=dict, description="actors.retriever.RetrievalConfig fields")
    grammar: Grammar = Grammar(action_tag="query", observation_tag="retrieve", max_turns=4, top_k=3)
    retrieval_timeout_s: float = Field(30.0, gt=0)
    image_index_dir: str | None = Field(
        None, description="CDIR's image-caption index (python -m actors.image_index): with a multimodal checkpoint, "
                          "a low-confidence agent answer is retried with the case most like the request's first image")
    cdir_threshold: float = Field(THRESHOLD, ge=0, le=1, description="CDIR fires when the confidence is below this "
                                                                     "(Med-RwR's lambda)")


class ServeSettings(Strict):
    checkpoint: str = Field(..., description="Hugging Face directory of a trained model (e.g. checkpoints/latest)")
    model_name: str = Field("medray", pattern=r"^[A-Za-z0-9._:-]+$",
                            description="the id clients ask for; agent mode is '<model_name>-agent'")
    api_key: str | None = Field(None, description=f"Bearer key clients must send; default: ${API_KEY_ENV}")
    engine: EngineSettings = EngineSettings()
    limits: Limits = Limits()
    agent: AgentSettings = AgentSettings()

    @property
    def agent_model_name(self) -> str:
        return f"{self.model_name}-agent"

    def api_key_digest(self) -> bytes:
        """sha256 of the key (from here or $MEDRAY_API_KEY): replicas get only this and compare presented keys'
        digests in constant time. Raises ValueError without a key: medray never serves without one."""
        key = self.api_key or os.environ.get(API_KEY_ENV)
        if not key:
            raise ValueError(f"no API key: set {API_KEY_ENV} or pass api_key=...; medray never serves without one")
        return key_digest(key)

    def resolved(self) -> ServeSettings:
        """Paths made absolute (replicas may run in another directory or on another node) and the key dropped (they
        get its digest). Raises ValueError if the checkpoint is not a model directory."""
        checkpoint = Path(self.checkpoint).expanduser().resolve()
        if not (checkpoint / "config.json").is_file():
            raise ValueError(f"checkpoint {self.checkpoint} is not a Hugging Face model directory (no config.json)")
        index_dir = self.agent.index_dir and str(Path(self.agent.index_dir).expanduser().resolve())
        image_index_dir = self.agent.image_index_dir and str(Path(self.agent.image_index_dir).expanduser().resolve())
        if image_index_dir:
            check_cdir(checkpoint, index_dir, image_index_dir)
        roots = [str(Path(root).expanduser().resolve()) for root in self.limits.image_roots]
        return self.model_copy(update={
            "api_key": None, "checkpoint": str(checkpoint),
            "limits": self.limits.model_copy(update={"image_roots": roots}),
            "agent": self.agent.model_copy(update={"index_dir": index_dir, "image_index_dir": image_index_dir})})


def check_cdir(checkpoint: Path, index_dir: str | None, image_index_dir: str) -> None:
    """CDIR runs inside agent mode on the request's image: it needs a text index, a multimodal checkpoint and an
    image index. Raises ValueError naming the field otherwise."""
    from actors.image_index import read_image_manifest
    from actors.retrieval_index import IndexMismatchError

    if not index_dir:
        raise ValueError("agent.image_index_dir: CDIR runs in agent mode, which needs agent.index_dir as well")
    if "vision_config" not in json.loads((checkpoint / "config.json").read_text()):
        raise ValueError(f"agent.image_index_dir: CDIR re-retrieves by the request's image, but checkpoint "
                         f"{checkpoint} is text-only (no vision_config in its config.json)")
    try:
        read_image_manifest(image_index_dir)
    except (FileNotFoundError, IndexMismatchError) as e:
        raise ValueError(f"agent.image_index_dir: {e}") from None


def key_digest(key: str) -> bytes:
    """What replicas compare presented keys against (constant-time, on digests of equal length)."""
    return hashlib.sha256(key.encode()).digest()
