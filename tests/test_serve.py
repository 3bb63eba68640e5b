"""The Serve application: OpenAI-compatible chat and agent mode over the tiny model, held to its limits.

One app is deployed once for the module on the shared local Ray, on a loopback port of its own, with a real vLLM
engine and a real retriever over a six-document index (random weights: the tests check protocol and behaviour, not
what the model says). Agent mode's own tests (test_serve_agent.py) deploy the same app.
"""
import base64
import io
import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from serve.config import Limits, ServeSettings
from serve.images import load_image
from serve.protocol import APIError

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-0123456789"

DOCS = [
    ("marfan", "Marfan syndrome", "Marfan syndrome: tall stature, arachnodactyly, ectopia lentis and aortic root "
                                  "dilatation, caused by FBN1 variants."),
    ("dmd", "Duchenne muscular dystrophy", "Duchenne muscular dystrophy: progressive proximal muscle weakness, calf "
                                           "pseudohypertrophy and raised creatine kinase in boys."),
    ("pku", "Phenylketonuria", "Phenylketonuria: intellectual disability, seizures and a musty odour without "
                               "dietary phenylalanine restriction."),
    ("cf", "Cystic fibrosis", "Cystic fibrosis: recurrent lung infections, pancreatic insufficiency and salty sweat."),
    ("down", "Down syndrome", "Down syndrome: hypotonia, upslanted palpebral fissures, single palmar crease and "
                              "congenital heart defects."),
    ("nf1", "Neurofibromatosis type 1", "Neurofibromatosis type 1: cafe-au-lait macules, axillary freckling and "
                                        "neurofibromas."),
]


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- configuration and images (no Ray) ---------------

@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("serve*.yaml")), ids=lambda p: p.name)
def test_serve_configs_pass_serves_own_schema(path, tiny_model_path):
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert config.http_options.host == "127.0.0.1"
    for application in config.applications:
        assert application.import_path == "serve.app:app"
        args = {**application.args, "checkpoint": str(tiny_model_path)}
        from serve.app import nest_dotted
        assert "api_key" not in args, "keys belong in the environment, not in a config file"
        ServeSettings.model_validate(nest_dotted(args))


def test_builder_refuses_without_key_or_checkpoint(tiny_model_path, tmp_path, monkeypatch):
    from serve.app import app

    monkeypatch.delenv("MEDRAY_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        app({"checkpoint": str(tiny_model_path)})
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        app({"checkpoint": str(tmp_path), "api_key": KEY})
    monkeypatch.setenv("MEDRAY_API_KEY", KEY)
    built = app({"checkpoint": str(tiny_model_path), "engine.max_model_len": "256"})
    assert type(built).__name__ == "Application"


@pytest.mark.parametrize("field,value", [("logprobs", True), ("top_logprobs", 2), ("n", 2),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("response_format", {"type": "json_object"})])
def test_fields_that_change_the_answer_are_refused_by_name_not_ignored(field, value):
    from serve.protocol import parse_request

    body = {"model": "medray", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as refused:
        parse_request({**body, field: value})
    assert refused.value.status == 400 and refused.value.param == field
    assert parse_request({**body, "logprobs": False, "response_format": {"type": "text"}}).model == "medray"


def test_images_are_checked_before_use(tmp_path):
    limits = Limits(image_roots=[str(tmp_path / "images")], max_image_bytes=10_000, max_image_pixels=64 * 64)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "ok.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    assert load_image(data_url(png_bytes()), limits, "p").size == (8, 8)
    assert load_image(str(tmp_path / "images" / "ok.png"), limits, "p").size == (8, 8)
    assert load_image(f"file://{tmp_path}/images/ok.png", limits, "p").size == (8, 8)
    refused = {
        "data:image/png;base64,not*base64": "not valid base64",
        data_url(b"plain text, not an image"): "could not be decoded",
        data_url(png_bytes(), mime="text/html"): "is not accepted",
        data_url(png_bytes(65, 65)): "pixels",
        data_url(b"\0" * 20_000): "larger than",
        f"{tmp_path}/images/../secret.png": "outside the allowed image roots",
        f"file://{tmp_path}/secret.png": "outside the allowed image roots",
        "http://169.254.169.254/latest/meta-data": "not fetched",
    }
    for url, message in refused.items():
        with pytest.raises(APIError, match=message) as info:
            load_image(url, limits, "p")
        assert info.value.status == 400


# ---------------------------------------------------------------- the deployed app ----------------------------------

@pytest.fixture(scope="module")
def server(ray_session, tiny_model_path, tmp_path_factory):
    """Deploys serve.app:app (with agent mode over a tiny index) once; yields its base URL and the index dir."""
    from ray import serve

    from indexing.build_index import build_index
    from serve.app import app

    work = tmp_path_factory.mktemp("serve")
    kb = work / "kb.jsonl"
    kb.write_text("".join(json.dumps({"id": f"{doc}#0", "doc_id": doc, "title": title, "text": text, "source": "test"})
                          + "\n" for doc, title, text in DOCS))
    build_index(kb, work / "index", "minilm", progress=False)
    (work / "images").mkdir()
    (work / "images" / "scan.png").write_bytes(png_bytes())

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"checkpoint": str(tiny_model_path), "api_key": KEY, "engine.max_model_len": "256",
            "engine.kv_cache_gb": "1", "engine.threads": "2", "limits.max_tokens": "64",
            "limits.max_body_bytes": "200000", "limits.image_roots": [str(work / "images")],
            "agent.index_dir": str(work / "index"), "agent.retrieval": {"mode": "dense"}}
    started = time.perf_counter()
    serve.run(app(args), name="medray", route_prefix="/", blocking=False)
    print(f"deployed in {time.perf_counter() - started:.1f}s")
    yield {"url": f"http://127.0.0.1:{port}", "index": work / "index", "images": work / "images"}
    serve.shutdown()


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def raw_post(server, body: bytes | str, key: str | None = KEY, path: str = "/v1/chat/completions"):
    import httpx
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server["url"] + path, content=body, headers=headers, timeout=60)


def chat_body(**overrides) -> dict:
    return {"model": "medray", "messages": [{"role": "user", "content": "Tall stature and lens dislocation?"}],
            "max_tokens": 8, "seed": 1, **overrides}


def assert_still_serving(server, client) -> None:
    import httpx
    assert httpx.get(server["url"] + "/health", timeout=30).json() == {"status": "ok"}
    reply = client.chat.completions.create(**chat_body(max_tokens=2))
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_models_and_health(server, client):
    import httpx
    assert httpx.get(server["url"] + "/health", timeout=30).json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == ["medray", "medray-agent"]


@pytest.mark.slow
def test_chat_completion_with_the_openai_client(client):
    reply = client.chat.completions.create(**chat_body(max_tokens=12))
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "medray"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
    again = client.chat.completions.create(**chat_body(max_tokens=12))
    assert again.choices[0].message.content == choice.message.content, "a request seed makes sampling reproducible"


@pytest.mark.slow
def test_streaming_matches_the_completion(client):
    whole = client.chat.completions.create(**chat_body(max_tokens=12)).choices[0]
    chunks = list(client.chat.completions.create(**chat_body(max_tokens=12), stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.message.content
    assert finished == [whole.finish_reason]
    assert chunks[-1].usage.completion_tokens <= 12


@pytest.mark.slow
def test_api_key_is_required(server):
    import openai
    for key in (None, "wrong-key"):
        response = raw_post(server, json.dumps(chat_body()), key=key)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong-key", max_retries=0).models.list()


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_server_stays_up(server, client):
    png = png_bytes()
    image = lambda url: [{"role": "user", "content": [{"type": "text", "text": "what is this?"},  # noqa: E731
                                                      {"type": "image_url", "image_url": {"url": url}}]}]
    cases = {
        "malformed JSON": ('{"model": "medray", "messages": [', 400, "not valid JSON"),
        "not an object": ("[1, 2]", 400, "JSON object"),
        "missing messages": (json.dumps({"model": "medray"}), 400, "messages"),
        "unknown model": (json.dumps(chat_body(model="gpt-4")), 404, "does not exist"),
        "max_tokens over the limit": (json.dumps(chat_body(max_tokens=100_000)), 400, "above this server's limit"),
        "prompt too long": (json.dumps(chat_body(messages=[{"role": "user", "content": "word " * 2000}])), 400,
                            "more than the limit"),
        "bad base64 image": (json.dumps(chat_body(messages=image("data:image/png;base64,@@@"))), 400, "base64"),
        "path traversal": (json.dumps(chat_body(messages=image(f"{server['images']}/../../etc/passwd"))), 400,
                           "outside the allowed image roots"),
        "image to a text model": (json.dumps(chat_body(messages=image(data_url(png)))), 400, "text-only"),
        "image path to a text model": (json.dumps(chat_body(messages=image(str(server["images"] / "scan.png")))),
                                       400, "text-only"),
        "body too large": (json.dumps(chat_body(messages=image(data_url(b"\0" * 300_000)))), 413, "larger than"),
        "logit bias outside the vocabulary": (json.dumps(chat_body(logit_bias={"99999999": 5})), 400, "logit_bias"),
        "temperature out of range": (json.dumps(chat_body(temperature=7)), 400, "temperature"),
        "deeply nested JSON": ("[" * 50_000 + "]" * 50_000, 400, "nested too deeply"),
        "unpaired surrogate": (json.dumps(chat_body(messages=[{"role": "user", "content": "\ud800"}])), 400,
                               "not valid Unicode"),
        "body not UTF-8": (b'{"model": "medray\xff"}', 400, "not valid JSON"),
        "truncated image": (json.dumps(chat_body(messages=image(data_url(png[: len(png) // 2])))), 400,
                            "could not be decoded"),
        "huge prompt near the body limit": (json.dumps(chat_body(messages=[{"role": "user",
                                                                            "content": "word " * 39_000}])), 400,
                                            "more than the limit"),
    }
    for name, (body, status, message) in cases.items():
        response = raw_post(server, body)
        assert response.status_code == status, f"{name}: {response.status_code} {response.text}"
        assert message in response.json()["error"]["message"], f"{name}: {response.text}"
    assert raw_post(server, "{}", path="/v1/nowhere").status_code == 404
    assert_still_serving(server, client)


@pytest.mark.slow
def test_the_api_key_never_reaches_the_logs(server, client, ray_session):
    """Neither the server's key nor a wrong key a client presents is written to any log of the Ray session (Serve's
    controller, proxy and replica logs included), after successful, refused and failing requests."""
    wrong = "wrong-key-that-must-not-be-logged"
    client.chat.completions.create(**chat_body(max_tokens=2))
    raw_post(server, json.dumps(chat_body()), key=wrong)
    raw_post(server, '{"model": "medray", "messages": [')
    time.sleep(2)  # Ray flushes worker logs to files asynchronously
    logs = Path(ray_session._private.worker.global_worker.node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any("serve" in str(p) for p in files)
    for secret in (KEY, wrong):
        leaks = [p for p in files if secret.encode() in p.read_bytes()]
        assert not leaks, f"{secret} found in {leaks}"


@pytest.mark.slow
def test_bounded_loopback_load_has_no_server_errors(server):
    """240 requests, 8 at a time, within 300 s: valid chats (plain and streaming) mixed with malformed JSON, wrong
    keys, path traversal, bad base64, unknown models and over-long prompts. Every answer has the expected status;
    none is a 5xx and no connection fails."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    url = server["url"] + "/v1/chat/completions"
    image = lambda u: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}]}]  # noqa: E731
    kinds = [  # (name, body, key, expected status)
        ("chat", json.dumps(chat_body(max_tokens=4)), KEY, 200),
        ("stream", json.dumps(chat_body(max_tokens=4, stream=True)), KEY, 200),
        ("malformed JSON", '{"model": "medray", "messages": [', KEY, 400),
        ("wrong key", json.dumps(chat_body()), "not-the-key", 401),
        ("no key", json.dumps(chat_body()), None, 401),
        ("path traversal", json.dumps(chat_body(messages=image(f"{server['images']}/../../etc/passwd"))), KEY, 400),
        ("bad base64", json.dumps(chat_body(messages=image("data:image/png;base64,@@@"))), KEY, 400),
        ("unknown model", json.dumps(chat_body(model="gpt-4")), KEY, 404),
        ("prompt too long", json.dumps(chat_body(messages=[{"role": "user", "content": "word " * 2000}])), KEY, 400),
        ("deeply nested", "[" * 20_000 + "]" * 20_000, KEY, 400),
    ]
    plan = [kinds[i % len(kinds)] for i in range(240)]
    deadline = time.monotonic() + 300

    def send(http: httpx.Client, kind) -> tuple[str, int | str, int]:
        name, body, key, expected = kind
        if time.monotonic() > deadline:
            return name, "not sent: past the time limit", expected
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        try:
            response = http.post(url, content=body, headers=headers)
            if expected == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
            return name, response.status_code, expected
        except httpx.HTTPError as e:
            return name, f"{type(e).__name__}: {e}", expected

    started = time.perf_counter()
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=8)) as http, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda kind: send(http, kind), plan))
    seconds = time.perf_counter() - started
    server_errors = [r for r in results if not isinstance(r[1], int) or r[1] >= 500]
    wrong = [r for r in results if r[1] != r[2]]
    print(f"\n{len(results)} requests (8 concurrent) in {seconds:.1f} s: {len(results) / seconds:.1f} req/s, "
          f"{len(server_errors)} server errors or failed connections, {len(wrong)} unexpected statuses")
    assert not server_errors, server_errors[:5]
    assert not wrong, wrong[:5]


@pytest.mark.slow
def test_request_metrics_reach_rays_metrics_endpoint(server, client, ray_session):
    """What the dashboard's Metrics view (Prometheus/Grafana) scrapes: this node's Ray metrics export port."""
    import httpx
    client.chat.completions.create(**chat_body(max_tokens=2))
    raw_post(server, "{}", key="wrong-key")
    port = ray_session._private.worker.global_worker.node.metrics_export_port
    wanted = ['ray_medray_serve_requests_total{', 'route="/v1/chat/completions"', 'status="401"']
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
        if any(all(w in line for w in wanted) for line in lines) and any(
                line.startswith("ray_medray_serve_request_seconds_bucket") for line in lines):
            return
        time.sleep(3)
    pytest.fail("the serve metrics did not reach Ray's metrics endpoint within 60 s")


@pytest.mark.slow
def test_a_killed_replica_is_replaced(server, client):
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ChatServer" in a["name"]]
    assert len(replicas) == 1
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            assert_still_serving(server, client)
            break
        except Exception:  # noqa: BLE001  unavailable until Serve has started the new replica
            time.sleep(2)
    assert_still_serving(server, client)
