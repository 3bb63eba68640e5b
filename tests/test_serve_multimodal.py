"""Images through the Serve endpoint, and CDIR in agent mode, on the tiny Qwen2.5-VL.

A deployment of its own (the module in tests/test_serve.py holds the text model's, and the test Ray has 2 CPUs):
serve.app:app on the tiny VL checkpoint with a BM25 index for agent mode and the imaging world's CDIR image index,
asked through the stock `openai` client with imaging-world scans as data URLs (random weights: the tests check what
reaches the model and what comes back, not what the model says).
"""
import base64
import json
import socket
import time

import pytest

from tasks.tiny_models import TinyModelConfig

KEY = "test-key-vl-0123456789"
VL = TinyModelConfig(arch="qwen2_5_vl")
MAX_MODEL_LEN, MAX_PROMPT_TOKENS = 256, 96


@pytest.fixture(scope="module")
def vl_model_path():
    from tasks.tiny_models import ensure_tiny_model
    return ensure_tiny_model(VL)


@pytest.fixture(scope="module")
def scan():
    """An imaging-world test scan: a 448 x 448 PNG the model sees at 84 px (9 image tokens)."""
    from tasks.build_imaging import ensure_imaging_world

    split = ensure_imaging_world(progress=False)["finding_mcq_test"]
    return split.parent / json.loads(split.read_text().splitlines()[0])["images"][0]


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(text: str, *urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


def test_cdir_settings_are_checked_when_the_app_is_built(tiny_model_path, vl_model_path, tmp_path):
    """CDIR needs agent mode, a multimodal checkpoint and an image index; each missing piece names its field."""
    from serve.config import ServeSettings

    def resolve(checkpoint, **agent):
        return ServeSettings(checkpoint=str(checkpoint), api_key=KEY, agent=agent).resolved()

    (tmp_path / "kb").mkdir()
    with pytest.raises(ValueError, match="agent.image_index_dir: CDIR runs in agent mode"):
        resolve(vl_model_path, image_index_dir=str(tmp_path))
    with pytest.raises(ValueError, match="agent.image_index_dir: .* is text-only"):
        resolve(tiny_model_path, index_dir=str(tmp_path / "kb"), image_index_dir=str(tmp_path))
    with pytest.raises(ValueError, match="agent.image_index_dir: .* is not an image index"):
        resolve(vl_model_path, index_dir=str(tmp_path / "kb"), image_index_dir=str(tmp_path))
    images = tmp_path / "images"  # what a replica would open, short of loading it
    images.mkdir()
    (images / "manifest.json").write_text(json.dumps({"format": 1, "kind": "image", "encoder": {
        "identity": "biomedclip", "path": str(tmp_path / "clip")}}))
    with pytest.raises(ValueError, match="agent.image_index_dir: .* has no docs.jsonl, offsets.npy, images.faiss"):
        resolve(vl_model_path, index_dir=str(tmp_path / "kb"), image_index_dir=str(images))
    for name in ("docs.jsonl", "offsets.npy", "images.faiss"):
        (images / name).touch()
    with pytest.raises(ValueError, match="agent.image_index_dir: .* embedded with BiomedCLIP .*clip, which is not a "
                                         "directory here"):
        resolve(vl_model_path, index_dir=str(tmp_path / "kb"), image_index_dir=str(images))
    with pytest.raises(ValueError, match="cdir_threshold"):
        resolve(vl_model_path, cdir_threshold=1.5)


def test_agent_cdir_shows_the_model_the_case_image_and_caption(vl_model_path, scan):
    """run_agent on the tiny VL tokenizer with a scripted model and the imaging world's image index: a low-confidence
    answer brings the case most like the request's scan, and the second turn's prompt holds its image (one
    placeholder, the image handed to the engine beside it) and caption; the trace names the case."""
    import asyncio
    import math

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from actors.cdir import case_image, case_text
    from actors.episode import Generation
    from actors.grammar import Grammar
    from actors.image_tokens import ImageTokens
    from actors.image_retriever import LocalImageRetriever
    from indexing.image_index import ensure_image_index
    from tasks.schema import chat_prompt_ids
    from actors.retrieval_env import RetrievalEnvironment
    from serve.agent import Cdir, retrieval_observer, run_agent

    tokenizer = AutoTokenizer.from_pretrained(vl_model_path)
    vision = ImageTokens.for_model(str(vl_model_path))
    retriever = LocalImageRetriever(ensure_image_index())
    grammar = Grammar(action_tag="query")
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Which finding?"}], num_images=1)
    calls = []

    async def generate(prompt, budget, stops, seed):  # answers at once, with confidence 0.3
        calls.append((prompt["prompt_token_ids"], prompt.get("multi_modal_data", {}).get("image", [])))
        new = tokenizer.encode("<answer>B</answer>", add_special_tokens=False)
        return Generation("<answer>B</answer>", new, [math.log(0.3)] * len(new), "stop", "</answer>")

    async def search(queries, top_k):
        raise AssertionError("the scripted model writes no query")

    async def search_images(images, top_k):
        return retriever.search(images, top_k)

    with Image.open(scan) as image:
        request_image = image.convert("RGB")
    observe = retrieval_observer(search, RetrievalEnvironment(None, top_k=3), 60)
    result = asyncio.run(run_agent(generate, observe, tokenizer, grammar, prompt,
                                   images=[request_image], vision=vision, max_tokens=64, max_model_len=512, stop=[],
                                   seed=0, timeout_s=60, cdir=Cdir(request_image, search_images)))
    hit = retriever.search([str(scan)], 1)[0][0]
    trace = result.trace()
    assert trace["confidence"] == pytest.approx(0.3) and trace["cdir"]["confidence_after"] == pytest.approx(0.3)
    assert trace["cdir"]["fired"] and trace["cdir"]["case_id"] == hit["id"] and trace["cdir"]["image_shown"]
    (first, first_images), (again, again_images) = calls
    assert first == prompt and first.count(vision.pad_id) == 1
    assert len(first_images) == 1 and np.array_equal(first_images[0], np.asarray(request_image))
    assert len(again_images) == 2 and np.array_equal(again_images[0], np.asarray(request_image))
    assert np.array_equal(np.asarray(again_images[1]), case_image(hit))
    shown = grammar.wrap_observation(vision.placeholder + case_text(hit))
    assert again[:len(prompt)] == prompt and tokenizer.decode(again[len(prompt):]) == shown
    assert trace["transcript"] == shown + "<answer>B</answer>" and result.answer == "B"


@pytest.fixture(scope="module")
def vl_server(ray_session, vl_model_path, tmp_path_factory):
    """serve.app:app on the tiny VL model, agent mode over a BM25 index, CDIR over the imaging world's image index."""
    from ray import serve

    from indexing.build_index import build_index
    from indexing.image_index import ensure_image_index
    from indexing.retrieval_index import IndexConfig
    from serve.app import app

    work = tmp_path_factory.mktemp("serve_vl")
    kb = work / "kb.jsonl"
    kb.write_text("".join(json.dumps({"id": f"{doc}#0", "doc_id": doc, "title": doc, "text": text, "source": "test"})
                          + "\n" for doc, text in [("abscess", "Lung abscess: a cavity with an air-fluid level."),
                                                   ("cyst", "Pulmonary cyst: a round lucency with a thin wall.")]))
    build_index(kb, work / "index", config=IndexConfig(kind="none"), progress=False)
    image_index = ensure_image_index()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"checkpoint": str(vl_model_path), "api_key": KEY, "engine.max_model_len": str(MAX_MODEL_LEN),
            "engine.kv_cache_gb": "1", "engine.threads": "2", "limits.max_tokens": "32",
            "limits.max_prompt_tokens": str(MAX_PROMPT_TOKENS), "agent.index_dir": str(work / "index"),
            "agent.retrieval": {"mode": "sparse"}, "agent.image_index_dir": str(image_index)}
    started = time.perf_counter()
    serve.run(app(args), name="medray-vl", route_prefix="/", blocking=False)
    print(f"deployed in {time.perf_counter() - started:.1f}s")
    yield {"url": f"http://127.0.0.1:{port}", "image_index": image_index}
    serve.shutdown()


@pytest.fixture
def client(vl_server):
    from openai import OpenAI
    return OpenAI(base_url=vl_server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_an_image_reaches_the_model_and_counts_its_tokens(client, scan):
    """A scan as a data URL gets an answer. Usage counts the prompt as vLLM ran it: 9 more tokens than the
    placeholder the text holds only when vLLM took the image and expanded it (with the delimiters: text-only + 11).
    Streaming gives the same text and usage."""
    ask = dict(model="medray", max_tokens=12, seed=5)
    text_only = client.chat.completions.create(messages=[{"role": "user", "content": "What is shown?"}], **ask)
    assert text_only.choices[0].message.content and text_only.usage.prompt_tokens > 0
    first = client.chat.completions.create(messages=image_message("What is shown?", data_url(scan)), **ask)
    assert first.choices[0].message.content and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 9 + 2
    streamed = list(client.chat.completions.create(messages=image_message("What is shown?", data_url(scan)),
                                                   stream=True, stream_options={"include_usage": True}, **ask))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        first.choices[0].message.content
    assert streamed[-1].usage.prompt_tokens == first.usage.prompt_tokens


@pytest.mark.slow
def test_bad_image_requests_get_4xx(vl_server, client, scan):
    """Each refusal names its cause; the prompt limit counts image tokens (4 scans: 36 of them and their 8 delimiters
    take the text over the limit of 96, while one scan fits)."""
    import httpx

    url = data_url(scan)
    truncated = "data:image/png;base64," + base64.b64encode(scan.read_bytes()[:5000]).decode()
    cases = {
        "truncated PNG": (image_message("What?", truncated), "could not be decoded"),
        "not base64": (image_message("What?", "data:image/png;base64,@@@"), "base64"),
        "placeholder typed as text": (image_message("What? <|image_pad|>", url), "image placeholder tokens"),
        "image tokens over the prompt limit": (image_message("What is shown? " * 12, *[url] * 4),
                                               f"more than the limit of {MAX_PROMPT_TOKENS}"),
        "too many images": (image_message("What?", *[url] * 5), "more than 4 images"),
    }
    for name, (messages, message) in cases.items():
        response = httpx.post(vl_server["url"] + "/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": "medray", "messages": messages, "max_tokens": 4})
        assert response.status_code == 400, f"{name}: {response.status_code} {response.text}"
        assert message in response.json()["error"]["message"], f"{name}: {response.text}"
    reply = client.chat.completions.create(model="medray", messages=image_message("What?", url), max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_agent_mode_runs_cdir_on_the_request_image(vl_server, client, scan, vl_model_path):
    """A logit bias on `<answer>` and `</answer>` makes the random model answer at once; the answer's confidence is
    the model's own probability of its first answer token (vLLM's raw log-prob, before the bias), far below 0.8 for a
    random model, so CDIR fires: the trace names the case the image index finds for the scan, shows its image and
    caption, and the confidence after the re-answer (which the engine produced with the case's image beside the
    request's)."""
    from transformers import AutoTokenizer

    from actors.image_retriever import LocalImageRetriever

    tokenizer = AutoTokenizer.from_pretrained(vl_model_path)
    open_answer, close_answer = tokenizer.convert_tokens_to_ids(["<answer>", "</answer>"])
    reply = client.chat.completions.create(
        model="medray-agent", max_tokens=16, seed=8, logit_bias={str(open_answer): 100, str(close_answer): 99},
        messages=image_message("Which finding is present?", data_url(scan)),
        extra_body={"agent": {"trace": True}})
    trace = reply.model_extra["trace"]
    cdir = trace["cdir"]
    assert cdir["threshold"] == 0.8 and "confidence" in trace
    assert cdir["fired"] == (trace["confidence"] is not None and trace["confidence"] < cdir["threshold"])
    assert cdir["fired"], f"the biased model was meant to answer: {trace['finish']} {trace['transcript']!r}"
    expected = LocalImageRetriever(vl_server["image_index"]).search([str(scan)], 1)[0][0]
    assert cdir["case_id"] == expected["id"] and cdir["caption"] == expected["caption"]
    assert cdir["score"] == pytest.approx(expected["score"], abs=1e-4)
    assert "confidence_after" in cdir and cdir["image_shown"]  # the case's image, then its caption
    assert "<|vision_start|><|image_pad|><|vision_end|>Similar case" in trace["transcript"]
