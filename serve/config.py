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

import yaml
from pydantic import Field, ValidationError

from actors.grammar import Grammar
from actors.cdir import THRESHOLD
from cluster.engine import EngineSettings, GpuMemoryUtilization, MaxNumSeqs
from cluster.schema import Strict
from cluster.storage import fetch_checkpoint, is_uri

API_KEY_ENV = "MEDRAY_API_KEY"


class ServeEngineSettings(EngineSettings):
    """The vLLM engine inside each replica."""
    backend: Literal["auto", "in_process", "async_llm"] = Field(
        "auto", description="in_process: LLMEngine stepped by a thread in the replica (starts in seconds; the CPU "
                            "default); async_llm: vLLM's AsyncLLM with its engine-core process (the GPU default)")
    dtype: str = Field("auto", description="auto: float32 on CPU, the checkpoint's dtype on GPU")
    # Sized apart from a training run's engines on purpose: a replica has its GPU to itself, so it takes most of it
    # (they default to half of theirs), and it decodes at most 64 requests together, as the judge does.
    max_num_seqs: MaxNumSeqs = 64
    gpu_memory_utilization: GpuMemoryUtilization = 0.85
    threads: int | None = Field(None, ge=1, description="OpenMP threads on CPU, per shard; default: the replica's "
                                                        "num_cpus over tensor_parallel_size, >= 1")
    tensor_parallel_size: int = Field(1, ge=1, description="shards of the model, one vLLM worker process each, all "
                                                           "inside the replica: give the ChatServer deployment's "
                                                           "ray_actor_options that many GPUs (num_gpus) on a GPU "
                                                           "cluster, that many times the CPUs per shard on CPU")
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
    """Agent mode: the policy's multi-turn loop with retrieval or with tools, selected per request by model id
    `<name>-agent` or an `agent` field in the request. Every field left unset is taken from the run that wrote the
    checkpoint (its `run.yaml`, or the run directory's `config.yaml`), so the served agent reads hits and tool
    results as the policy was trained to."""
    enabled: bool | None = Field(None, description="none: whenever the run used retrieval or tools with an action "
                                                   "tag, or index_dir is given")
    tools: dict | None = Field(None, description="actors.gym.ToolsConfig fields (the tool Gym: MedVR, MedVistaGym); "
                                                 "none: the run's tools section. With tools, actions go to the "
                                                 "tools (retrieve_knowledge searches index_dir)")
    tool_timeout_s: float = Field(60.0, gt=0, description="seconds to wait for one tool call")
    index_dir: str | None = Field(None, description="retrieval index (python -m indexing.build_index); "
                                                    "none: the run's index")
    retrieval: dict | None = Field(None, description="actors.retriever.RetrievalConfig fields (top_k: documents per "
                                                     "query); none: the run's search settings (a BM25-only index is "
                                                     "searched sparse)")
    grammar: Grammar | None = Field(None, description="none: the run's rollout.grammar")
    show: Literal["passages", "titles"] | None = Field(None, description="what the model reads of each hit; "
                                                                         "none: the run's retrieval.show")
    link_options: bool | None = Field(None, description="mark hits named like an option of the question; none: the "
                                                        "run's retrieval.link_options")
    passage_chars: int | None = Field(None, ge=1, description="cut each passage after this many characters; none: "
                                                              "the run's retrieval.passage_chars")
    paging: bool | None = Field(None, description="a repeated query returns the next top_k hits; none: the run's "
                                                  "retrieval.paging")
    rank_options: bool | Literal["places"] | None = Field(
        None, description="hits linking no option are followed by the options as the search ranks them (true: in its "
                          "order; places: each with its place); none: the run's retrieval.rank_options")
    retrieval_timeout_s: float = Field(30.0, gt=0)
    image_index_dir: str | None = Field(
        None, description="CDIR's image-caption index (python -m indexing.image_index): with a multimodal checkpoint, "
                          "a low-confidence agent answer is retried with the case most like the request's first image")
    cdir_threshold: float = Field(THRESHOLD, ge=0, le=1, description="CDIR fires when the confidence is below this "
                                                                     "(Med-RwR's lambda)")


DEFAULT_GRAMMAR = Grammar(action_tag="query", observation_tag="retrieve", max_turns=4)
DEFAULT_TOP_K = 3  # documents per query of an agent that no run's search settings size
DEFAULT_TOOL_GRAMMAR = Grammar(action_tag="tool_call", observation_tag="tool_response", max_turns=6)


def run_config(checkpoint: Path) -> dict | None:
    """The resolved config of the run that wrote `checkpoint`: its own `run.yaml`, else `config.yaml` of the run
    directory it sits in (`<run>/checkpoints/step_N`); None for a model that no medray run wrote."""
    for path in (checkpoint / "run.yaml", checkpoint.parent.parent / "config.yaml"):
        if path.is_file() and (path.name == "run.yaml" or checkpoint.parent.name == "checkpoints"):
            try:
                return yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError) as e:
                raise ValueError(f"{path}: not a readable run config ({e})") from None
    return None


def agent_from_run(agent: AgentSettings, run: dict | None) -> AgentSettings:
    """`agent` with every unset field taken from the run's retrieval, tools and grammar (defaults without a run).
    Agent mode is on when asked, or when not asked but the run used retrieval or tools with an action tag, or an
    index or tools are given. With tools the actions go to the tools; an index is needed only for retrieval
    (retrieve_knowledge among the tools, or no tools)."""
    retrieval = (run or {}).get("retrieval")
    tools = agent.tools if agent.tools is not None else (run or {}).get("tools")
    grammar = (run or {}).get("rollout", {}).get("grammar") if retrieval or tools else None
    index_dir = agent.index_dir
    if index_dir is None and retrieval:
        from indexing.build_index import default_index_dir
        index_dir = retrieval.get("index_dir") or str(default_index_dir(
            retrieval.get("kb", "hpo"), retrieval.get("index", {}).get("kind", "none"), retrieval.get("shards", 1)))
    enabled = agent.enabled if agent.enabled is not None else bool(
        agent.index_dir or agent.tools or ((retrieval or tools) and grammar and grammar.get("action_tag")))
    if not enabled:
        return agent.model_copy(update={"enabled": False, "index_dir": None, "tools": None})
    if tools is not None:
        from actors.gym import ToolsConfig
        try:
            tools = ToolsConfig.model_validate(tools).model_dump()
        except ValidationError as e:
            raise ValueError("agent.tools: " + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'tools'}: {err['msg']}"
                                                         for err in e.errors())) from None
    searches = tools is None or "retrieve_knowledge" in tools["tools"]
    if searches and index_dir is None:
        raise ValueError("agent.enabled: agent mode needs agent.index_dir (the run that wrote this checkpoint used "
                         "no retrieval)" if tools is None else "agent.tools: retrieve_knowledge needs agent.index_dir "
                         "(the run that wrote this checkpoint used no retrieval)")
    search = (retrieval or {}).get("search") or {}
    default_grammar = DEFAULT_GRAMMAR if tools is None else DEFAULT_TOOL_GRAMMAR
    if grammar:  # a run written before top_k left the grammar still has it there: the search settings hold it now
        grammar = {k: v for k, v in grammar.items() if k != "top_k"}
    # documents per query: agent.retrieval's, else the run's search settings' (one setting, as in training)
    searched = {"top_k": search.get("top_k", DEFAULT_TOP_K),
                **(agent.retrieval if agent.retrieval is not None else search)}
    # how hits are shown: an explicit agent.* setting, else the run's retrieval section (checked as agent.* is);
    # what neither sets is RetrievalEnvironment's default (retrieval_environment), the one training uses
    shown = {key: getattr(agent, key) if getattr(agent, key) is not None else (retrieval or {}).get(key)
             for key in SHOWN}
    try:
        AgentSettings.model_validate(shown)
    except ValidationError as e:
        raise ValueError("retrieval: " + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                                   for err in e.errors())) from None
    return agent.model_copy(update={
        "enabled": True, "index_dir": index_dir if searches else None, "tools": tools, "retrieval": searched,
        "grammar": agent.grammar or (Grammar.model_validate(grammar) if grammar else default_grammar), **shown})


SHOWN = ("show", "link_options", "passage_chars", "paging", "rank_options")  # the retrieval section's presentation keys


def retrieval_environment(agent: AgentSettings, top_k: int):
    """The served agent's retrieval environment, training's RetrievalEnvironment (its retriever unused: a replica
    searches through its own handle) with `top_k` hits per query and the resolved presentation of `agent`."""
    from actors.retrieval_env import RetrievalEnvironment
    return RetrievalEnvironment(None, top_k=top_k, timeout_s=agent.retrieval_timeout_s,
                                **{key: getattr(agent, key) for key in SHOWN if getattr(agent, key) is not None})


class ServeSettings(Strict):
    checkpoint: str = Field(..., description="Hugging Face directory of a trained model (e.g. checkpoints/latest), "
                                             "or its URI on a run's storage (s3://bucket/run/checkpoints/latest)")
    model_name: str = Field("medray", pattern=r"^[A-Za-z0-9._:-]+$",
                            description="the id clients ask for; agent mode is '<model_name>-agent'")
    api_key: str | None = Field(None, description=f"Bearer key clients must send; default: ${API_KEY_ENV}")
    engine: ServeEngineSettings = ServeEngineSettings()
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
        """Checked and made explicit before any replica starts, so a deployment that could not start fails here with
        its cause: the checkpoint verified (a model directory of a causal LM, its manifest's checksums when it has
        one), agent mode completed from the run that wrote it, every path a replica opens checked (the index's and
        the image index's files and encoders, the tools' weights, the image roots), paths made absolute (replicas may
        run elsewhere) and the key dropped (they get its digest). Raises ValueError naming the field."""
        if is_uri(self.checkpoint):  # replicas fetch this exact step (`latest` resolved here) to their node's cache
            source, checkpoint = fetch_checkpoint(self.checkpoint)
        else:
            checkpoint = Path(self.checkpoint).expanduser().resolve()
            source = str(checkpoint)
        check_checkpoint(checkpoint, self.checkpoint)
        agent = agent_from_run(self.agent, run_config(checkpoint))
        index_dir = agent.index_dir and str(Path(agent.index_dir).expanduser().resolve())
        image_index_dir = agent.image_index_dir and str(Path(agent.image_index_dir).expanduser().resolve())
        if image_index_dir:
            check_cdir(checkpoint, index_dir, image_index_dir)
        if agent.tools and agent.tools["observe_images"] and not is_multimodal(checkpoint):
            raise ValueError(f"agent.tools: the tools show images (observe_images) but checkpoint {checkpoint} is "
                             "text-only; set agent.tools.observe_images=false")
        if agent.tools:
            check_tool_options(agent.tools)
        retrieval = agent.retrieval
        # an index the run's config names but this node has not built yet is built on first use by the Retriever
        # replica; an index_dir given here must already be one
        if index_dir and (self.agent.index_dir or Path(index_dir).exists()):
            from actors.retriever import check_index, config_for_index
            try:
                check_index(index_dir)
                retrieval = config_for_index(index_dir, agent.retrieval).model_dump()
            except (OSError, ValueError) as e:  # IndexMismatchError is a ValueError
                raise ValueError(f"agent.index_dir: {e}") from None
        roots = [str(Path(root).expanduser().resolve()) for root in self.limits.image_roots]
        for root in roots:
            if not Path(root).is_dir():
                raise ValueError(f"limits.image_roots: {root} is not a directory")
        return self.model_copy(update={
            "api_key": None, "checkpoint": source,
            "limits": self.limits.model_copy(update={"image_roots": roots}),
            "agent": agent.model_copy(update={"index_dir": index_dir, "image_index_dir": image_index_dir,
                                              "retrieval": retrieval})})


def check_checkpoint(checkpoint: Path, given: str) -> None:
    """A directory vLLM can serve: a Hugging Face causal LM (or image-text-to-text) with its tokenizer, and, when it
    carries a medray manifest, every file the server loads matching its checksum. Raises ValueError naming it."""
    from transformers import AutoConfig

    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"checkpoint {given} is not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"checkpoint {given}: config.json cannot be read ({e})") from None
    architectures = config.architectures or []
    if not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        named = ", ".join(architectures) or "no architecture"
        raise ValueError(f"checkpoint {given} is a {config.model_type} model ({named}), not a generative language "
                         f"model")
    if not any((checkpoint / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"checkpoint {given} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    if (checkpoint / "manifest.json").is_file():
        from cluster.files import verify_manifest
        problem = verify_manifest(checkpoint, skip=lambda name: name.startswith("deepspeed/"))
        if problem:
            raise ValueError(f"checkpoint {given} is damaged: {problem}")


def is_multimodal(checkpoint: Path) -> bool:
    return "vision_config" in json.loads((checkpoint / "config.json").read_text())


def check_cdir(checkpoint: Path, index_dir: str | None, image_index_dir: str) -> None:
    """CDIR runs inside agent mode on the request's image: it needs a text index, a multimodal checkpoint and an
    image index. Raises ValueError naming the field otherwise."""
    from indexing.image_index import check_image_index

    if not index_dir:
        raise ValueError("agent.image_index_dir: CDIR runs in agent mode, which needs agent.index_dir as well")
    if not is_multimodal(checkpoint):
        raise ValueError(f"agent.image_index_dir: CDIR re-retrieves by the request's image, but checkpoint "
                         f"{checkpoint} is text-only (no vision_config in its config.json)")
    try:
        check_image_index(image_index_dir)
    except (OSError, ValueError) as e:  # IndexMismatchError is a ValueError
        raise ValueError(f"agent.image_index_dir: {e}") from None


def check_tool_options(tools: dict) -> None:
    """Each tool's constructor options (`agent.tools`, a ToolsConfig as a dict) as the Tools replica will pass them:
    known names, existing weight directories. Raises ValueError naming the field."""
    from actors.tools import tool_class

    for name, spec in tools["tools"].items():
        try:
            tool_class(name).check_options(spec["options"])
        except (OSError, ValueError) as e:
            raise ValueError(f"agent.tools.tools.{name}.options: {e}") from None


def key_digest(key: str) -> bytes:
    """What replicas compare presented keys against (constant-time, on digests of equal length)."""
    return hashlib.sha256(key.encode()).digest()
