"""Agent mode: the served policy's multi-turn loop, with retrieval or with tools, on a served request.

Training's episode loop and turn logic (`actors.episode.play`, the grammar `actors.grammar.Grammar`), driven here by
one request on the async engine: the model writes until it closes the action tag, the action goes to the environment (an
`Observe`), its observation comes back inside the observation tag and the model continues, until it closes
`</answer>`, runs out of turns or of its token budget, or the environment ends the episode.
Two environments: retrieval (`retrieval_observer`: `</query>` -> hits in `<retrieve>...`, as the Retriever shows them in
training) and tools (`serve.tools`: `<tool_call>{"name", "arguments"}</tool_call>` -> the tool's text and images in
`<tool_response>...`, with the Gym's checks and records). Observation images join the request's images; the episode
holds each image's full run of pads, as training's do, and the engine gets one placeholder per image (vLLM's form).

CDIR (Med-RwR's test-time image re-retrieval, `actors/cdir.py`): when the request's image and an image search are
given, the answer's confidence (the probability of the option token after `<answer>`, from the engine's log-prob of
the sampled token: vLLM's default `raw_logprobs`, the model's own distribution whatever the temperature) below the
threshold drops the answer turn, shows the most similar image-caption case as an observation (a multimodal model:
the case's image, then its caption, as evaluation shows it, `actors.cdir.case_observation`), and answers again. The
trace carries the confidence and, whenever CDIR was asked for, its record: `{"fired", "threshold"}`, plus the case
(`case_id`, `caption`, `score`, `image_shown`) and `confidence_after` when it fired (or `error` when the image search
failed); the transcript holds the case's observation, its image as one placeholder.

Streaming (`stream_agent`): one `chat.completion.chunk` per event, as it happens: each model turn's text and each
observation in `delta.reasoning_content` (their concatenation is the transcript, with any answer turn CDIR dropped),
the event itself in the chunk's `agent` field (`{"kind": "model" | "observation" | "cdir", "turn", ...}`); then the
answer in `delta.content`, the finish reason (with the trace when asked), usage when asked, and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from actors.cdir import THRESHOLD, answer_confidence, case_observation, cdir_fires, token_pieces
from actors.episode import Act, Episode, Generation, Observation, next_request, play, rgb_array
from actors.grammar import Grammar
from actors.retrieval_env import RetrievalEnvironment
from actors.image_tokens import ImageTokens
from serve.protocol import APIError, chunk, sse, usage, usage_chunk

log = logging.getLogger("medray.serve")

# (vLLM's token prompt, max_tokens, stop strings, seed) -> the generation
Generate = Callable[[dict, int, list[str], int | None], Awaitable[Generation]]
# (queries, top_k) -> hits per query, each a dict with at least "id" and "text"
Search = Callable[..., Awaitable[list[list[dict]]]]  # (queries, top_k, among=None) -> hits, as Retriever.search
# (images, top_k) -> image-caption hits per image, each {id, image_path, caption, score} (indexing.image_index)
SearchImages = Callable[[list, int], Awaitable[list[list[dict]]]]
# receives each event of an episode as it happens: {"kind": "model" | "observation" | "cdir", "turn", "text", ...}
Emit = Callable[[dict], None]


def ignore(event: dict) -> None:
    """The Emit of an episode nobody watches turn by turn."""


# (the action's text, the episode's turn records so far) -> the observation (training's type: text, the turn's record,
# images as RGB arrays, and whether it ends the episode, then `record["finish"]` says why)
Observe = Callable[[str, list[dict]], Awaitable[Observation]]


def retrieval_observer(search: Search, environment: RetrievalEnvironment, timeout_s: float,
                       options: dict[str, str] | None = None) -> Observe:
    """Retrieval as training does it: `environment` (a RetrievalEnvironment with the run's top_k, show, link_options,
    passage_chars and paging; its retriever unused) decides the depth searched (paging: a repeated query's next
    page), the text shown and the turn's record, with `options` the question's {letter: text}; the search is
    `search`. A failed search is an observation the model reads, not a failed request."""
    async def observe(query: str, turns: list[dict]) -> Observation:
        hits, error = await _search(search, query, environment.depth(turns, query), timeout_s,
                                    environment.among(options))
        return environment.observation(turns, options, query, hits, error)
    return observe


@dataclass
class Cdir:
    """What CDIR needs for one request: the request's image and the image index's search."""
    image: object
    search_images: SearchImages
    threshold: float = THRESHOLD


@dataclass
class AgentResult:
    answer: str | None
    finish: str                                     # answer, or the episode's: stop, length, turn_limit, budget,
    #                                                   vision_token, the environment's
    transcript: str                                 # everything after the prompt: the model's and the environment's
    completion_tokens: int                          # tokens the model wrote
    turns: list[dict] = field(default_factory=list)  # per action: its record, training's (retrieval: query, error,
    #                                                   chunks [{id, doc_id, text}], page with paging, linked)
    confidence: float | None = None                 # of the first answer (CDIR's eta), None without one
    cdir: dict | None = None                        # fired, threshold, the case, confidence after; None: not asked

    def trace(self) -> dict:
        return {"finish": self.finish, "turns": self.turns, "transcript": self.transcript,
                "completion_tokens": self.completion_tokens, "confidence": self.confidence, "cdir": self.cdir}

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason: "stop" with an answer, else "length" (turns, tokens or context ran out)."""
        return "stop" if self.answer is not None else "length"


async def run_agent(generate: Generate, observe: Observe, tokenizer, grammar: Grammar, prompt_ids: list[int], *,
                    images: list = (), vision: ImageTokens | None = None, prefix: str = "", max_tokens: int,
                    max_model_len: int, stop: list[str], seed: int | None, timeout_s: float, cdir: Cdir | None = None,
                    emit: Emit = ignore) -> AgentResult:
    """Drive one episode over `prompt_ids` (vLLM's form: one placeholder per image of `images`) with training's episode
    loop (`actors.episode.play`). `prefix` is text already in the prompt that belongs to the model's first turn
    (a continued assistant message), so an action it opened is closed by the first generation. `max_tokens` bounds
    the model's tokens; the grammar's `max_response_tokens` bounds model and environment tokens together;
    `max_model_len` the whole context, image tokens included. `vision`: the policy's image tokens, needed when the
    prompt or the observations carry images. `cdir`: re-retrieve by image when the answer's confidence is below its
    threshold (an episode that ends without an answer has no confidence, and CDIR does not fire). `emit` sees each
    model turn and observation as it happens."""
    if images and vision is None:
        raise ValueError(f"the request has {len(images)} images, but the served model is text-only")
    arrays = [rgb_array(image) for image in images]
    grids = [vision.grid(a) for a in arrays]
    episode = Episode(task={}, group=0, seed=seed, images=arrays, image_grids=grids,
                      prompt_ids=vision.expand(list(prompt_ids), grids) if arrays else list(prompt_ids))
    result = await _episode(generate, observe, tokenizer, grammar, episode, vision, prefix, max_tokens, max_model_len,
                            stop, timeout_s, cdir, emit)
    if cdir is not None and result.cdir is None:
        result = dataclasses.replace(result, cdir={"fired": False, "threshold": cdir.threshold})
    return result


async def _episode(generate: Generate, observe: Observe, tokenizer, grammar: Grammar, episode: Episode,
                   vision: ImageTokens | None, prefix: str, max_tokens: int, max_model_len: int, stop: list[str],
                   timeout_s: float, cdir: Cdir | None, emit: Emit) -> AgentResult:
    """Training's episode loop (`actors.episode.play`) answered with the async engine and `observe`, each turn
    emitted; the result has a CDIR record only when the episode answered."""
    transcript, written = "", 0
    stops = sorted(set(stop) | set(grammar.stops()))

    def limit(ep: Episode) -> int:  # the request's own budgets: the tokens it may write, the model's context
        return min(max_tokens - written, max_model_len - len(ep.prompt_ids) - len(ep.response_ids))

    loop = play(episode, grammar, tokenizer, vision, limit, prefix)
    request = next_request(loop)
    while request is not None:
        if isinstance(request, Act):
            shown_from, images_before = len(episode.response_ids), len(episode.images)
            request = next_request(loop, await observe(request.action, episode.turns))
            shown = _decode(tokenizer, vision, episode.response_ids[shown_from:])
            transcript += shown
            emit({"kind": "observation", **episode.turns[-1], "turn": len(episode.turns) - 1,
                  "images": len(episode.images) - images_before, "text": shown})
            continue
        turn_start, history = len(episode.response_ids), transcript
        generation = await generate(request.prompt, request.max_tokens, stops, request.seed)
        transcript += generation.text
        written += len(generation.ids)
        emit({"kind": "model", "turn": len(episode.turns), "text": generation.text})
        seed, request = request.seed, next_request(loop, generation)
        if request is None and generation.stop_reason == f"</{grammar.answer_tag}>":
            confidence = answer_confidence(token_pieces(tokenizer, generation.ids), generation.logprobs,
                                           [1] * len(generation.ids), grammar.answer_tag)
            result = AgentResult(_answer(prefix + transcript, grammar), "answer", transcript, written, episode.turns,
                                 confidence, None if cdir is None else {"fired": False, "threshold": cdir.threshold})
            if cdir is not None and cdir_fires(confidence, cdir.threshold):
                return await _reanswer(result, cdir, generate, tokenizer, grammar, vision, episode, turn_start,
                                       history, prefix, max_tokens, max_model_len, stop, seed, timeout_s, emit)
            return result
    return AgentResult(None, episode.finish_reason, transcript, written, episode.turns)


def _decode(tokenizer, vision: ImageTokens | None, ids: list[int]) -> str:
    """Tokens as the transcript shows them: an image as one placeholder (vLLM's form)."""
    return tokenizer.decode(vision.collapse(ids) if vision else ids, skip_special_tokens=False)


async def _reanswer(first: AgentResult, cdir: Cdir, generate: Generate, tokenizer, grammar: Grammar,
                    vision: ImageTokens | None, episode: Episode, turn_start: int, history: str, prefix: str,
                    max_tokens: int, max_model_len: int, stop: list[str], seed: int | None, timeout_s: float,
                    emit: Emit) -> AgentResult:
    """Eqn. 7 of Med-RwR: the answer turn (from `turn_start` of the episode's response; `history` the transcript
    before it) is dropped, the most similar image-caption case joins the context after the reasoning history (as
    evaluation shows it, `actors.cdir.case_observation`: a multimodal model its image, then its caption; a text-only
    one the caption), and the model answers once more (the dropped turn's tokens still count as written). A failed
    image search, or an unreadable case image, keeps the first answer."""
    try:
        hit = (await asyncio.wait_for(cdir.search_images([cdir.image], 1), timeout_s))[0][0]
        case_ids, case_images, case_grids = case_observation(hit, tokenizer, grammar, vision)
    except Exception as e:  # noqa: BLE001  no case to add: the first answer stands, and the trace says why
        return dataclasses.replace(first, cdir={"fired": True, "threshold": cdir.threshold,
                                                "error": type(e).__name__})
    # the context to answer from again: the episode before its answer turn, then the case
    again = Episode(task=episode.task, group=episode.group, seed=seed, images=episode.images + case_images,
                    image_grids=episode.image_grids + case_grids,
                    prompt_ids=episode.prompt_ids + episode.response_ids[:turn_start] + case_ids)
    shown = _decode(tokenizer, vision, case_ids)
    transcript = history + shown
    emit({"kind": "cdir", "turn": len(first.turns), "case_id": hit["id"], "text": shown})
    written = first.completion_tokens
    room = min(max_tokens - written, max_model_len - len(again.prompt_ids))
    record = {"fired": True, "threshold": cdir.threshold, "case_id": hit["id"], "caption": hit["caption"],
              "score": hit["score"], "image_shown": bool(case_images)}
    if room <= 0:
        return dataclasses.replace(first, cdir={**record, "error": "no room to answer again"})
    answer_close = f"</{grammar.answer_tag}>"
    generation = await generate(again.engine_prompt(vision), room, sorted(set(stop) | {answer_close}), seed)
    transcript += generation.text
    emit({"kind": "model", "turn": len(first.turns), "text": generation.text})
    answered = generation.stop_reason == answer_close
    record["confidence_after"] = answer_confidence(token_pieces(tokenizer, generation.ids), generation.logprobs,
                                                   [1] * len(generation.ids), grammar.answer_tag) \
        if answered else None
    return AgentResult(_answer(prefix + transcript, grammar) if answered else None,
                       "answer" if answered else (generation.finish_reason or "length"), transcript,
                       written + len(generation.ids), first.turns, first.confidence, record)


async def _search(search: Search, query: str, top_k: int, timeout_s: float,
                  among: list[str] | None = None) -> tuple[list[dict] | None, str | None]:
    """The hits (then the candidates `among` names), or the error the model is shown instead (as in training: it can
    go on without them)."""
    if not query:
        return None, "empty query"
    try:
        asked = search([query], top_k, [among]) if among else search([query], top_k)
        return (await asyncio.wait_for(asked, timeout_s))[0], None
    except asyncio.TimeoutError:
        return None, "timeout"
    except Exception as e:  # noqa: BLE001  a failed retriever gives an observation, not a failed request
        return None, type(e).__name__


def _answer(text: str, grammar: Grammar) -> str | None:
    found = re.findall(rf"<{grammar.answer_tag}>(.*?)</{grammar.answer_tag}>", text, flags=re.S)
    return found[-1].strip() if found else None


def final_chunks(cid: str, model: str, result: AgentResult, trace: bool, prompt_tokens: int,
                 include_usage: bool) -> list[dict]:
    """The chunks after the episode's events: the answer, the finish reason (with the trace, if asked) and usage."""
    events = [chunk(cid, model, {"content": result.answer or ""}),
              chunk(cid, model, {}, result.finish_reason, **({"trace": result.trace()} if trace else {}))]
    return events + ([usage_chunk(cid, model, usage(prompt_tokens, result.completion_tokens))] if include_usage
                     else [])


async def stream_agent(episode: Callable[[Emit], Awaitable[AgentResult]], cid: str, model: str, *, trace: bool,
                       prompt_tokens: int, include_usage: bool,
                       finished: Callable[[AgentResult], None]) -> AsyncIterator[str]:
    """Server-sent events of one agent episode (`episode(emit)`), each turn's chunk as soon as the turn ends (see the
    module docstring), then `final_chunks` and `[DONE]`; `finished` gets the result. A client that goes away
    cancels the episode; an episode that fails ends the stream with an error event."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(episode(queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
        while (event := await queue.get()) is not None:
            shown = {k: v for k, v in event.items() if k != "text"}
            yield sse(chunk(cid, model, {"reasoning_content": event["text"]}, agent=shown))
        try:
            result = task.result()
        except Exception as e:  # noqa: BLE001  headers are sent: the error travels as an event
            log.exception("agent stream %s failed", cid)
            yield sse(APIError(500, f"agent episode failed: {type(e).__name__}").body())
        else:
            finished(result)
            for event in final_chunks(cid, model, result, trace, prompt_tokens, include_usage):
                yield sse(event)
        yield sse("[DONE]")
    finally:
        task.cancel()
