"""The medray model as a Ray Serve application: OpenAI-compatible chat over vLLM, plus agent mode.

    MEDRAY_API_KEY=... serve run serve.app:app checkpoint=outputs/quickstart/checkpoints/latest
    MEDRAY_API_KEY=... serve deploy configs/serve.yaml      # on a running cluster (see configs/serve*.yaml)

Routes: GET /health (no key), GET /v1/models, POST /v1/chat/completions (streaming or not; image parts for a
multimodal checkpoint); every /v1 route wants `Authorization: Bearer <key>`. Arguments are `serve.config.ServeSettings`
fields; nested ones as dotted keys (`engine.max_model_len=512`, `agent.index_dir=...`). Serve's HTTP proxy binds to
127.0.0.1 unless its `http_options.host` says otherwise, and the app never starts without an API key.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import logging
import time

import ray
from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.episode import Generation
from actors.image_tokens import ImageTokens
from serve.agent import Cdir, retrieval_observer, run_agent, stream_agent
from serve.api import api, read_body
from serve.config import ServeSettings, key_digest, retrieval_environment
from serve.engine import EnginePrompt, start_engine
from serve.images import load_image
from serve.metrics import serve_metrics
from serve.protocol import (AgentOptions, APIError, ChatRequest, chunk, completion, completion_id, decode_body,
                            finish_reason, parse_request, sse, usage, usage_chunk)
from serve.retrievers import CONSTRUCTOR_RETRIES, ImageRetrieverServer, RetrieverServer
from serve.tools import ToolServer, tool_observer
from tasks.schema import parse_option_listing
from cluster.storage import local_checkpoint

log = logging.getLogger("medray.serve")

HEALTH_TIMEOUT_S = 5.0


def last_user_text(req: ChatRequest) -> str:
    """The text of the request's last user message (its text parts, for a multi-part message)."""
    content = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
    return content if isinstance(content, str) else "\n".join(p.text or "" for p in content if p.type == "text")


# Everything ChatServer's methods call is defined above it: Serve pickles the class by value when it is decorated.
@serve.deployment(name="ChatServer", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64,
                  health_check_period_s=10, health_check_timeout_s=60, max_constructor_retry_count=CONSTRUCTOR_RETRIES)
@serve.ingress(api)
class ChatServer:
    """One vLLM engine per replica behind the OpenAI routes; agent mode when a retriever or the tools are bound, CDIR
    in it when an image retriever is too."""

    def __init__(self, settings: dict, api_key_digest: bytes, retriever: DeploymentHandle | None = None,
                 image_retriever: DeploymentHandle | None = None, tools: DeploymentHandle | None = None):
        from transformers import AutoTokenizer

        self.settings = ServeSettings.model_validate(settings)
        self.limits = self.settings.limits
        self.key_digest = api_key_digest
        self.retriever, self.image_retriever, self.tools = retriever, image_retriever, tools
        self.environment = tools or retriever  # what agent mode's actions go to; None: no agent mode
        self.device = "cuda" if ray.get_gpu_ids() else "cpu"
        num_cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        checkpoint = local_checkpoint(self.settings.checkpoint)  # a URI on storage: fetched to this node first
        self.vision = ImageTokens.for_model(checkpoint)  # None: a text-only checkpoint
        self.engine = start_engine(checkpoint, self.settings.engine, self.device, num_cpus,
                                   max_images=self.limits.max_images if self.vision else None,
                                   num_gpus=len(ray.get_gpu_ids()))
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.max_prompt_tokens = self.limits.max_prompt_tokens or self.settings.engine.max_model_len - 1
        self.metrics = serve_metrics()
        log.info("serving %s as %r on %s", self.settings.checkpoint, self.settings.model_name, self.device)

    async def check_health(self) -> None:
        """Serve calls this periodically; a failure makes it replace the replica."""
        await self.engine.check_health()

    @api.get("/health")
    async def health(self) -> dict:
        """200 once this replica's engine and, in agent mode, a retriever or tools replica answer; 503 until then."""
        await self.engine.check_health()
        if self.environment is not None:
            try:
                await asyncio.wait_for(self.environment.ready.remote(), HEALTH_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001  starting, restarting or failed: not ready either way
                what = "tools are" if self.tools else "retriever is"
                raise APIError(503, f"the {what} not ready ({type(e).__name__})", code="not_ready") from None
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self.authenticate(request)
        ids = [self.settings.model_name] + ([self.settings.agent_model_name] if self.environment else [])
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "medray"}
                                           for i in ids]}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        started = time.perf_counter()
        self.authenticate(request)
        body = await read_body(request, self.limits.max_body_bytes)
        req = parse_request(decode_body(body))
        agent = self.agent_requested(req)
        prompt = self.prompt(req)
        max_tokens = self.max_tokens(req, prompt.num_tokens)
        cid = completion_id()
        if agent:
            return await self.agent_completion(req, cid, prompt, max_tokens, started)
        params = self.sampling(req, max_tokens, delta=req.stream)
        if req.stream:
            return StreamingResponse(self.stream(req, cid, prompt, params, started), media_type="text/event-stream")
        text, n_prompt, n_tokens, reason = "", prompt.num_tokens, 0, None
        async for output in self.engine.generate(prompt.to_vllm(), params, cid):
            seq = output.outputs[0]
            # usage counts the prompt as the engine ran it: with each image's placeholder expanded to its run of pads
            n_prompt, text, n_tokens, reason = len(output.prompt_token_ids), seq.text, len(seq.token_ids), \
                seq.finish_reason
        self.metrics.finished("chat", False, time.perf_counter() - started, n_prompt, n_tokens)
        return completion(cid, req.model, text, finish_reason(reason), usage(n_prompt, n_tokens))

    def authenticate(self, request: Request) -> None:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(key_digest(key.strip()), self.key_digest):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def agent_requested(self, req: ChatRequest) -> bool:
        """Agent mode is the `<name>-agent` model or an `agent` field; any other model id is a 404."""
        name = self.settings.model_name
        if req.model not in (name, self.settings.agent_model_name):
            raise APIError(404, f"model {req.model!r} does not exist; this server has {name!r} and "
                                f"{self.settings.agent_model_name!r}", param="model", code="model_not_found")
        agent = req.model == self.settings.agent_model_name or req.agent is not None
        if agent and self.environment is None:
            raise APIError(400, "agent mode needs a retriever or tools: start the app with agent.index_dir=<index> "
                                "or agent.tools (or from a checkpoint whose run used them)",
                           param="model")
        return agent

    def prompt(self, req: ChatRequest) -> EnginePrompt:
        """The chat template applied to the messages, after every image part has been checked and decoded. Each image
        is one placeholder in the ids (vLLM's form); the prompt-token limit counts the tokens it expands to."""
        if len(req.messages) > self.limits.max_messages:
            raise APIError(400, f"more than {self.limits.max_messages} messages", param="messages")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs an assistant message last", param="messages")
        messages, images = [], []
        for i, message in enumerate(req.messages):
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            parts = []
            for j, part in enumerate(message.content):
                param = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                    continue
                if part.image_url is None:
                    raise APIError(400, "image_url part without an image_url", param=param)
                if len(images) == self.limits.max_images:
                    raise APIError(400, f"more than {self.limits.max_images} images", param=param)
                images.append(load_image(part.image_url.url, self.limits, param))
                parts.append({"type": "image"})  # the chat template's placeholder: <|vision_start|><|image_pad|>...
            messages.append({"role": message.role, "content": parts})
        if images and self.vision is None:  # checked after decoding, so a bad image is reported as such
            raise APIError(400, f"model {req.model!r} is text-only and cannot take image inputs", param="messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=not req.continue_final_message,
                                                 continue_final_message=req.continue_final_message, tokenize=True,
                                                 return_dict=False)
        n_tokens = len(ids)
        if self.vision is not None:
            try:  # the length vLLM will see: each placeholder expanded to its image's run of pads
                n_tokens = len(self.vision.expand(ids, [self.vision.grid(image) for image in images]))
            except ValueError:  # "<|image_pad|>" typed into a message would take an image that is not there
                raise APIError(400, "message text holds image placeholder tokens (<|image_pad|>); send images as "
                                    "image_url parts", param="messages") from None
        if n_tokens > self.max_prompt_tokens:
            raise APIError(400, f"prompt has {n_tokens} tokens, more than the limit of {self.max_prompt_tokens}",
                           param="messages", code="context_length_exceeded")
        return EnginePrompt(ids, images, n_tokens - len(ids))

    def max_tokens(self, req: ChatRequest, n_prompt: int) -> int:
        room = self.settings.engine.max_model_len - n_prompt
        asked = req.requested_max_tokens
        if asked is None:
            return min(self.limits.max_tokens, room)
        if asked > self.limits.max_tokens:
            raise APIError(400, f"max_tokens {asked} is above this server's limit of {self.limits.max_tokens}",
                           param="max_tokens")
        if asked > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) plus max_tokens ({asked}) exceeds the context of "
                                f"{self.settings.engine.max_model_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return asked

    def sampling(self, req: ChatRequest, max_tokens: int, *, delta: bool, agent_stops: list[str] | None = None,
                 seed: int | None = None):
        """vLLM's sampling parameters for `req`. Agent turns stop at the grammar's tags and keep them in the text (the
        loop reads them), and, as in training (EpisodeRunner), at image tokens: a placeholder the model wrote would
        stand for no image in the next turn's prompt. A client's own stop strings are cut, as OpenAI does."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  seed=req.seed if seed is None else seed, stop=agent_stops or req.stop_list,
                                  logit_bias=self.logit_bias(req), presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty,
                                  include_stop_str_in_output=agent_stops is not None,
                                  stop_token_ids=self.vision.special_ids if agent_stops is not None and self.vision
                                  else None,
                                  logprobs=0 if agent_stops is not None else None,  # agent: CDIR's confidence
                                  skip_special_tokens=True,
                                  output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY)
        except ValueError as e:  # vLLM's own checks (e.g. a logit_bias token outside the vocabulary)
            raise APIError(400, f"invalid sampling parameters: {e}") from None

    def logit_bias(self, req: ChatRequest) -> dict[int, float] | None:
        """OpenAI's {"<token id>": bias} with ids checked against the vocabulary."""
        if not req.logit_bias:
            return None
        vocab = len(self.tokenizer)
        bias = {int(k): v for k, v in req.logit_bias.items() if k.isdigit()}
        if len(bias) < len(req.logit_bias) or any(k >= vocab for k in bias):
            raise APIError(400, f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
        return bias

    async def stream(self, req: ChatRequest, cid: str, prompt: EnginePrompt, params, started: float):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        model, n_prompt, n_tokens = req.model, prompt.num_tokens, 0
        yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
        try:
            async for output in self.engine.generate(prompt.to_vllm(), params, cid):
                seq = output.outputs[0]
                n_prompt, n_tokens = len(output.prompt_token_ids), n_tokens + len(seq.token_ids)
                if seq.text:
                    yield sse(chunk(cid, model, {"content": seq.text}))
                if output.finished:
                    yield sse(chunk(cid, model, {}, finish_reason(seq.finish_reason)))
        except Exception as e:  # noqa: BLE001  headers are sent: the error travels as an event
            log.exception("stream %s failed", cid)
            yield sse(APIError(500, f"generation failed: {type(e).__name__}").body())
        if req.stream_options and req.stream_options.include_usage:
            yield sse(usage_chunk(cid, model, usage(n_prompt, n_tokens)))
        yield sse("[DONE]")
        self.metrics.finished("chat", True, time.perf_counter() - started, n_prompt, n_tokens)

    async def agent_completion(self, req: ChatRequest, cid: str, prompt: EnginePrompt, max_tokens: int,
                               started: float):
        """Run the agent loop (retrieval, or the tools): to the end, then answer as one completion; or streamed turn
        by turn (`serve.agent.stream_agent`). With an image retriever and an image in the request, CDIR re-retrieves by the
        first image on a low-confidence answer."""
        asked = req.agent or AgentOptions()
        grammar = self.settings.agent.grammar
        if asked.max_turns is not None:
            grammar = grammar.model_copy(update={"max_turns": asked.max_turns})
        turn_ids = itertools.count()

        async def generate(engine_prompt: dict, budget: int, stops: list[str], seed: int | None) -> Generation:
            params = self.sampling(req, budget, delta=False, agent_stops=stops, seed=seed)
            async for output in self.engine.generate(engine_prompt, params, f"{cid}-{next(turn_ids)}"):
                seq = output.outputs[0]
            return Generation.from_vllm(seq)

        async def search(queries: list[str], top_k: int, among: list[list[str] | None] | None = None) \
                -> list[list[dict]]:
            return await self.retriever.search.remote(queries, top_k, among)

        async def search_images(images: list, top_k: int) -> list[list[dict]]:
            return await self.image_retriever.search.remote(images, top_k)

        cdir = Cdir(prompt.images[0], search_images, self.settings.agent.cdir_threshold) \
            if self.image_retriever is not None and prompt.images else None
        prefix = req.messages[-1].content if req.continue_final_message else ""
        agent = self.settings.agent
        observe = tool_observer(self.tools, prompt.images, agent.tool_timeout_s) if self.tools else \
            retrieval_observer(search, retrieval_environment(agent, asked.top_k or agent.retrieval["top_k"]),
                               agent.retrieval_timeout_s,
                               parse_option_listing(last_user_text(req)) if agent.link_options else None)
        episode = functools.partial(run_agent, generate, observe, self.tokenizer, grammar, prompt.ids,
                                    images=prompt.images, vision=self.vision,
                                    prefix=prefix if isinstance(prefix, str) else "", max_tokens=max_tokens,
                                    max_model_len=self.settings.engine.max_model_len,
                                    stop=req.stop_list, seed=req.seed, timeout_s=agent.retrieval_timeout_s,
                                    cdir=cdir)

        def finished(result) -> None:
            self.metrics.agent_turns(result.turns)
            self.metrics.finished("agent", req.stream, time.perf_counter() - started, prompt.num_tokens,
                                  result.completion_tokens)

        if req.stream:
            return StreamingResponse(stream_agent(lambda emit: episode(emit=emit), cid, req.model, trace=asked.trace,
                                                  prompt_tokens=prompt.num_tokens, finished=finished,
                                                  include_usage=bool(req.stream_options
                                                                     and req.stream_options.include_usage)),
                                     media_type="text/event-stream")
        result = await episode()
        finished(result)
        return completion(cid, req.model, result.answer or "", result.finish_reason,
                          usage(prompt.num_tokens, result.completion_tokens),
                          **({"trace": result.trace()} if asked.trace else {}))


def app(args: dict) -> serve.Application:
    """The app builder `serve run serve.app:app key=value ...` and Serve config files call. Everything a replica
    would fail on is checked here first (`ServeSettings.resolved`), so a deployment that cannot start stops
    `serve run` at once with its cause instead of restarting replicas: no API key, a missing, damaged or non-LM
    checkpoint, an unreadable index or a search mode it cannot serve, CDIR without a multimodal checkpoint."""
    settings = ServeSettings.model_validate(nest_dotted(args))
    digest = settings.api_key_digest()
    settings = settings.resolved()
    agent = settings.agent
    tools = ToolServer.bind(agent.tools, agent.index_dir, agent.retrieval) if agent.enabled and agent.tools else None
    retriever = RetrieverServer.bind(agent.index_dir, agent.retrieval) if agent.enabled and not agent.tools else None
    image_retriever = ImageRetrieverServer.bind(agent.image_index_dir) if agent.image_index_dir else None
    return ChatServer.bind(settings.model_dump(), digest, retriever, image_retriever, tools)


def nest_dotted(args: dict) -> dict:
    """{'engine.max_model_len': '512'} -> {'engine': {'max_model_len': '512'}}: CLI arguments reach nested settings."""
    nested: dict = {}
    for key, value in args.items():
        *parents, leaf = key.split(".")
        target = nested
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return nested
