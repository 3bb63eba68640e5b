"""The OpenAI chat-completions wire format: what a request may say, what the server answers, and the error body every
4xx/5xx carries (`{"error": {"message", "type", "param", "code"}}`, which the `openai` client turns into its
exceptions)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

StopString = Annotated[str, Field(min_length=1, max_length=200)]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    """A request the server refuses, with the status and message the client sees."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class Lenient(BaseModel):
    """OpenAI clients send fields this server does not use (user, metadata, ...): they are ignored, not refused."""
    model_config = ConfigDict(extra="ignore")


class ImageURL(Lenient):
    url: str = Field(..., max_length=64 << 20)


class ContentPart(Lenient):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class Message(Lenient):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class AgentOptions(Lenient):
    """medray's extension: run the reasoning-with-retrieval loop for this request."""
    trace: bool = Field(False, description="return the queries, retrieved chunk ids and the transcript")
    max_turns: int | None = Field(None, ge=0, description="retrieval calls (default: the server's grammar)")
    top_k: int | None = Field(None, ge=1, le=50, description="chunks per query (default: the server's "
                                                             "agent.retrieval.top_k)")


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatRequest(Lenient):
    model: str
    messages: list[Message] = Field(..., min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Literal[1] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=8)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**31)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    continue_final_message: bool = Field(False, description="vLLM's extension: continue the last (assistant) "
                                                            "message instead of starting a new turn")
    agent: AgentOptions | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def decode_body(body: bytes):
    """The decoded JSON body; APIError(400) if it is not UTF-8 JSON, is nested too deeply for the parser, or holds
    text that is not valid Unicode (an unpaired surrogate escape such as "\\ud800", which tokenizers cannot encode)."""
    try:
        payload = json.loads(body)
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except UnicodeEncodeError:
        raise APIError(400, "request body is not valid Unicode text: it holds an unpaired surrogate escape "
                            "(\\ud800-\\udfff)") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    return payload


# OpenAI fields that change what an answer means: refused by name rather than ignored. Their harmless values pass.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none"), "function_call": (None, "none"),
               "response_format": (None, {"type": "text"})}


def parse_request(payload) -> ChatRequest:
    """Validate a decoded JSON body; the first problems become one readable 400. A field this server cannot honour
    (log-probabilities, function calling, JSON mode) is refused naming it; `n` above 1 likewise."""
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    for field, harmless in UNSUPPORTED.items():
        if field in payload and payload[field] not in harmless:
            raise APIError(400, f"{field} is not supported by this server; leave it out", param=field,
                           code="unsupported_parameter")
    try:
        return ChatRequest.model_validate(payload)
    except ValidationError as e:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5]]
        first = e.errors()[0]["loc"]
        raise APIError(400, "invalid request: " + "; ".join(problems), param=str(first[0]) if first else None) from None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def finish_reason(vllm_reason: str | None) -> str:
    """vLLM's reasons ('stop', 'length', 'abort') -> OpenAI's ('stop', 'length')."""
    return "length" if vllm_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(cid: str, model: str, content: str, reason: str, token_usage: dict, **extra) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": reason, "logprobs": None}],
            "usage": token_usage, **extra}


def chunk(cid: str, model: str, delta: dict, reason: str | None = None, **extra) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}], **extra}


def sse(event: dict | str) -> str:
    """One server-sent event: a chunk as JSON, or the closing "[DONE]"."""
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


def usage_chunk(cid: str, model: str, token_usage: dict) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": token_usage}
