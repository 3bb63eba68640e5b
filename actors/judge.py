"""JudgeActor: an LLM that scores trajectories for judge-based rewards (Med-R3's answer, triples, evidence levels).

One actor, named by role ("JudgeActor"), serves every reward actor: rewards find it with `ray.get_actor` and send
all prompts of a batch in one call. Two backends behind one method:

- "vllm": a vLLM engine in-process on a local model directory (the tiny random Qwen2 when `model_path` is None; a
  real judge model on a cluster), started as every medray engine is (`cluster.engine`);
- "openai": the stock `openai` client against any OpenAI-compatible `base_url` (vLLM serve, medray's serve app,
  a hosted frontier model); the key is read from the environment variable named by `api_key_env`, never logged.

`judge(prompts, parser)` generates, parses strictly, and re-samples only the outputs that failed to parse (a new seed,
temperature at least `retry_temperature`) up to `max_retries` times; what still fails is None and is counted in
`stats()["parse_failures"]`. Parsing never raises; a judge that cannot be reached does (the reward actor's on_error
policy then decides).
"""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal

import ray
from pydantic import Field, model_validator

from cluster.engine import ContextLength, EngineSettings, KvCacheGB, MaxNumSeqs
from tasks.extras import require

Messages = list[dict]


class JudgeConfig(EngineSettings):
    """How the judge runs. The trainer starts one JudgeActor from this (config key `judge`). The engine settings
    (max_model_len, max_num_seqs, kv_cache_gb, gpu_memory_utilization) size the vllm backend's engine."""
    backend: Literal["vllm", "openai"] = "vllm"
    model_path: str | None = Field(None, description="vllm: local HF model directory; null: the tiny model")
    base_url: str | None = Field(None, description="openai: the endpoint, e.g. http://127.0.0.1:8000/v1")
    api_key_env: str | None = Field(None, description="openai: name of the env var holding the key (null: no key)")
    model: str | None = Field(None, description="openai: the model name sent with each request")
    temperature: float = Field(0.0, ge=0, description="first attempt (0: greedy)")
    retry_temperature: float = Field(0.7, gt=0, description="re-samples of unparsable outputs use at least this")
    max_tokens: int = Field(256, ge=1, description="new tokens per judgement")
    max_retries: int = Field(2, ge=0, description="re-samples of an unparsable output before it counts as failed")
    seed: int = 0
    concurrency: int = Field(8, ge=1, description="openai: requests in flight at once")
    timeout_s: float = Field(60.0, gt=0, description="openai: per request (the client retries transport errors)")
    # The judge's engine is sized apart from a rollout worker's on purpose: a judge prompt holds the instructions and a
    # whole trajectory (longer ones are cut in the middle), so twice the context; and it is a helper beside the
    # rollout workers (on CPU, on the same machine), so it decodes at most 64 sequences together in half their KV cache.
    max_model_len: ContextLength = 2048
    max_num_seqs: MaxNumSeqs = 64
    kv_cache_gb: KvCacheGB = 0.5
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="vllm: auto is float32 on CPU, the checkpoint's dtype on GPU")

    @model_validator(mode="after")
    def _backend_fields(self):
        if self.backend == "openai" and not (self.base_url and self.model):
            raise ValueError("judge.backend 'openai' needs judge.base_url and judge.model")
        return self


# ---- strict parsers: text -> value, or None when the text is not exactly what was asked for ----------------------
_SCORE_LINE = re.compile(r"^(?:[A-Za-z][A-Za-z ]*:\s*)?\**(\d+)\**\.?$")
_FENCED = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.S)
_VERDICT_LINE = re.compile(r"^(?:[A-Za-z][A-Za-z ]*:\s*)?\**(correct|incorrect)\**\.?$", re.I)


def parse_score(text: str, allowed: list[int]) -> int | None:
    """The integer on the last non-empty line, alone or after a label ("2", "Score: 2", "Level: 4."), if it is in
    `allowed`; else None. Reasoning may precede that line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    m = _SCORE_LINE.match(lines[-1]) if lines else None
    return int(m.group(1)) if m and int(m.group(1)) in allowed else None


def parse_verdict(text: str) -> bool | None:
    """"correct" (True) or "incorrect" (False) alone on the last non-empty line, in any case, optionally after a label
    ("Verdict: Correct."); else None. Reasoning may precede that line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    m = _VERDICT_LINE.match(lines[-1]) if lines else None
    return m.group(1).lower() == "correct" if m else None


def parse_json(text: str) -> Any | None:
    """The whole output as JSON, bare or in one ```json fenced block; None if it does not decode."""
    body = text.strip()
    fenced = _FENCED.match(body)
    try:
        return json.loads(fenced.group(1) if fenced else body)
    except json.JSONDecodeError:
        return None


def parse_triples(text: str, with_source: bool = True) -> list[tuple] | None:
    """A JSON list of knowledge-graph triples, Med-R3 eq. 1 (the Med-R3 paper): [head, relation, tail] or,
    with_source, [head, relation, tail, s] with s = 1 if the fact came from retrieved documents, 0 if from the model's
    own reasoning. Strings must be non-empty; any malformed item makes the whole output None (no partial credit for
    half-parsed graphs). An empty list is a valid graph."""
    data = parse_json(text)
    if not isinstance(data, list):
        return None
    arity = 4 if with_source else 3
    triples = []
    for item in data:
        if not (isinstance(item, list) and len(item) == arity
                and all(isinstance(x, str) and x.strip() for x in item[:3])):
            return None
        if with_source and (isinstance(item[3], bool) or item[3] not in (0, 1)):
            return None
        triples.append(tuple(x.strip() if isinstance(x, str) else int(x) for x in item))
    return triples


PARSERS: dict[str, Callable[..., Any]] = {"score": parse_score, "verdict": parse_verdict, "json": parse_json,
                                          "triples": parse_triples}


def parse_with_retries(prompts: list[Messages], generate: Callable[[list[Messages], list[int], float], list[str]],
                       parse: Callable[[str], Any], max_retries: int, temperature: float, retry_temperature: float,
                       seed: int) -> tuple[list[Any], int, int]:
    """Generate once for every prompt, then re-generate only the unparsable ones, at most `max_retries` times, with a
    new seed per attempt and temperature >= retry_temperature (greedy would repeat itself).

    Returns (values with None for outputs that never parsed, retries made, parse failures)."""
    values: list[Any] = [None] * len(prompts)
    pending, retries = list(range(len(prompts))), 0
    for attempt in range(max_retries + 1):
        if not pending:
            break
        temp = temperature if attempt == 0 else max(temperature, retry_temperature)
        texts = generate([prompts[i] for i in pending], [seed + 7919 * attempt + i for i in pending], temp)
        retries += len(pending) if attempt else 0
        still = []
        for i, text in zip(pending, texts):
            values[i] = parse(text)
            if values[i] is None:
                still.append(i)
        pending = still
    return values, retries, len(pending)


@ray.remote(max_restarts=3, max_task_retries=2)
class JudgeActor:
    """An LLM judge: `generate` returns texts for a batch of chat prompts, `judge` returns parsed values."""

    def __init__(self, config: dict, threads: int = 1, tensor_parallel_size: int = 1):
        """`config`: a JudgeConfig as a dict; `threads` (torch/OpenMP threads, per shard) and `tensor_parallel_size`
        (vLLM worker processes the model is sharded over): the role's cluster resources."""
        self.cfg, self.threads, self.shards = JudgeConfig.model_validate(config), threads, tensor_parallel_size
        self.counts = {"calls": 0, "prompts": 0, "generations": 0, "retries": 0, "parse_failures": 0,
                       "truncated_prompts": 0, "seconds": 0.0}
        if self.cfg.backend == "vllm":
            self._start_vllm()
        else:
            self._start_openai()

    def _start_vllm(self) -> None:
        from cluster.devices import accelerator
        from cluster.engine import engine_args, prepare_engine_process
        prepare_engine_process(self.threads)
        from vllm import LLM

        path = self.cfg.model_path
        if path is None:
            from tasks.tiny_models import TinyModelConfig
            from tasks.tiny_models import ensure_tiny_model
            path = str(ensure_tiny_model(TinyModelConfig()))
        self.llm = LLM(**engine_args(path, self.cfg, device=accelerator(), dtype=self.cfg.dtype, seed=self.cfg.seed,
                                     tensor_parallel_size=self.shards))
        self.tokenizer = self.llm.get_tokenizer()
        self._generate = self._generate_vllm

    def _start_openai(self) -> None:
        OpenAI = require("openai", "judge").OpenAI
        key = "EMPTY"  # OpenAI-compatible servers without auth still need a non-empty key in the client
        if self.cfg.api_key_env:
            if not os.environ.get(self.cfg.api_key_env):
                raise ValueError(f"judge.api_key_env: environment variable {self.cfg.api_key_env!r} is not set "
                                 "in the JudgeActor's process")
            key = os.environ[self.cfg.api_key_env]
        self.client = OpenAI(base_url=self.cfg.base_url, api_key=key, timeout=self.cfg.timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="judge")
        self._generate = self._generate_openai

    def _prompt_ids(self, messages: Messages) -> list[int]:
        """Chat template -> ids, cut in the middle to fit max_model_len - max_tokens: the instructions at the start
        and the question at the end survive, part of a long reasoning or document goes."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        room = self.cfg.max_model_len - self.cfg.max_tokens
        if len(ids) <= room:
            return ids
        self.counts["truncated_prompts"] += 1
        head = room // 2
        return ids[:head] + ids[len(ids) - (room - head):]

    def _generate_vllm(self, prompts: list[Messages], seeds: list[int], temperature: float) -> list[str]:
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(temperature=temperature, max_tokens=self.cfg.max_tokens, seed=s) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=self._prompt_ids(p)) for p in prompts], params,
                                 use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def _generate_openai(self, prompts: list[Messages], seeds: list[int], temperature: float) -> list[str]:
        def one(messages: Messages, seed: int) -> str:
            reply = self.client.chat.completions.create(model=self.cfg.model, messages=messages, seed=seed,
                                                        temperature=temperature, max_tokens=self.cfg.max_tokens)
            return reply.choices[0].message.content or ""
        return list(self.pool.map(one, prompts, seeds))

    def generate(self, prompts: list[Messages], temperature: float | None = None) -> list[str]:
        """One reply per chat prompt (a list of {"role", "content"} messages), sampled with per-prompt seeds."""
        start = time.perf_counter()
        texts = self._generate(prompts, [self.cfg.seed + i for i in range(len(prompts))],
                               self.cfg.temperature if temperature is None else temperature)
        self.counts["calls"] += 1
        self.counts["prompts"] += len(prompts)
        self.counts["generations"] += len(prompts)
        self.counts["seconds"] += time.perf_counter() - start
        return texts

    def judge(self, prompts: list[Messages], parser: str, **parser_args) -> list[Any]:
        """Parsed judgements, one per prompt: `parser` is a key of PARSERS ("score" with allowed=[...], "verdict",
        "json", "triples"); an output that does not parse after max_retries re-samples is None (counted, never
        raised)."""
        if parser not in PARSERS:
            raise ValueError(f"unknown judge parser {parser!r}; known: {sorted(PARSERS)}")
        start, parse = time.perf_counter(), PARSERS[parser]
        generated = 0

        def counted(batch, seeds, temperature):
            nonlocal generated
            generated += len(batch)
            return self._generate(batch, seeds, temperature)

        values, retries, failures = parse_with_retries(
            prompts, counted, lambda text: parse(text, **parser_args), self.cfg.max_retries,
            self.cfg.temperature, self.cfg.retry_temperature, self.cfg.seed)
        for key, n in (("calls", 1), ("prompts", len(prompts)), ("generations", generated), ("retries", retries),
                       ("parse_failures", failures), ("seconds", time.perf_counter() - start)):
            self.counts[key] += n
        return values

    def stats(self) -> dict:
        """Counters since start: calls (batches), prompts, generations (retries included), retries,
        parse_failures (prompts that never parsed), truncated_prompts, seconds."""
        return dict(self.counts)
