"""The served agent with tools (MedVR / MedVistaGym): a tool policy served from a checkpoint whose run.yaml names its
grammar and tools, the Tools deployment running the Gym's checks and tools, image observations reaching the engine,
and the episode streamed turn by turn.

The tiny Qwen2.5-VL's random weights would never close a tool call: the request continues an assistant turn that
opened one, and a logit bias makes `</tool_call>` certain, so each turn's shape is known.
"""
import json
import shutil
import time

import httpx
import pytest
import yaml
from test_serve_multimodal import data_url, image_message, scan, vl_model_path  # noqa: F401  (fixtures)
from test_serve import free_port

KEY = "test-key-tools-0123456789"
GRAMMAR = {"action_tag": "tool_call", "observation_tag": "tool_response", "answer_tag": "answer", "max_turns": 6,
           "max_response_tokens": 512, "max_observation_tokens": 128}
RUN = {"rollout": {"grammar": GRAMMAR}, "tools": {"tools": {"zoom_in": {"num_cpus": 0.25}}, "max_tool_calls": 6}}
ZOOM = '{"name": "zoom_in", "arguments": {"box": [0, 0, 224, 224]}}'


@pytest.fixture(scope="module")
def tool_checkpoint(vl_model_path, tmp_path_factory):  # noqa: F811
    """The tiny VL model as a MedVR run's checkpoint: its run.yaml has the tool grammar and the tools."""
    checkpoint = tmp_path_factory.mktemp("medvr") / "step_30"
    shutil.copytree(vl_model_path, checkpoint)
    (checkpoint / "run.yaml").write_text(yaml.safe_dump(RUN))
    return checkpoint


def test_tools_come_from_the_run_and_are_checked_when_the_app_is_built(tool_checkpoint, tiny_model_path, tmp_path):
    from serve.config import ServeSettings

    def resolve(checkpoint, **agent):
        return ServeSettings(checkpoint=str(checkpoint), api_key=KEY, agent=agent).resolved().agent

    agent = resolve(tool_checkpoint)
    assert agent.enabled and agent.tools["tools"].keys() == {"zoom_in"} and agent.index_dir is None
    assert agent.grammar.action_tag == "tool_call" and agent.grammar.observation_tag == "tool_response"
    with pytest.raises(ValueError, match="agent.tools: the tools show images .* is text-only"):
        resolve(tiny_model_path, tools={"tools": {"zoom_in": {}}})
    assert resolve(tiny_model_path, tools={"tools": {"zoom_in": {}}, "observe_images": False}).enabled
    with pytest.raises(ValueError, match="agent.tools: retrieve_knowledge needs agent.index_dir"):
        resolve(tool_checkpoint, tools={"tools": {"retrieve_knowledge": {}}})
    with pytest.raises(ValueError, match=r"agent.tools: .*unknown tool\(s\) \['saw'\]"):
        resolve(tool_checkpoint, tools={"tools": {"saw": {}}})
    with pytest.raises(ValueError, match=r"agent.tools.tools.segment.options: option 'path': .*nowhere is not a "
                                         r"directory"):
        resolve(tool_checkpoint, tools={"tools": {"segment": {"options": {"path": str(tmp_path / "nowhere")}}}})
    with pytest.raises(ValueError, match=r"agent.tools.tools.zoom_in.options: unknown option\(s\) \['size'\]"):
        resolve(tool_checkpoint, tools={"tools": {"zoom_in": {"options": {"size": 64}}}})


@pytest.fixture(scope="module")
def tool_server(ray_session, tool_checkpoint):
    from ray import serve

    from serve.app import app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"checkpoint": str(tool_checkpoint), "api_key": KEY, "engine.max_model_len": "512",
            "engine.kv_cache_gb": "1", "engine.threads": "2", "limits.max_tokens": "32"}
    started = time.perf_counter()
    serve.run(app(args), name="medray-tools", route_prefix="/", blocking=False)
    print(f"deployed in {time.perf_counter() - started:.1f}s")
    yield {"url": f"http://127.0.0.1:{port}"}
    serve.shutdown()


def tool_request(checkpoint, scan_path, call: str, **agent) -> dict:  # noqa: F811
    from transformers import AutoTokenizer

    close = AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("</tool_call>")
    return {"model": "medray-agent", "max_tokens": 16, "seed": 2, "logit_bias": {str(close): 100},
            "messages": image_message("Which finding is in this scan?", data_url(scan_path)) +
            [{"role": "assistant", "content": f"<think>look closer</think><tool_call>{call}"}],
            "continue_final_message": True, "agent": {"trace": True, "max_turns": 1, **agent}}


def sse_chunks(url: str, body: dict) -> list[dict]:
    """The stream's chunks as they arrive, line by line; it must end with [DONE]."""
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=180) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.slow
def test_a_tool_call_is_run_and_its_crop_reaches_the_next_turn(tool_server, tool_checkpoint, scan):  # noqa: F811
    chunks = sse_chunks(tool_server["url"], tool_request(tool_checkpoint, scan, ZOOM))
    assert not any("error" in c for c in chunks), chunks
    assert [c.get("agent", {}).get("kind") for c in chunks] == [None, "model", "observation", "model", None, None]
    observation = chunks[2]["agent"]
    assert observation["tool"] == "zoom_in" and observation["box"] == [0, 0, 224, 224]
    assert observation["error"] is None and observation["images"] == 1
    assert observation["measurements"]["width"] == 224.0
    shown = chunks[2]["choices"][0]["delta"]["reasoning_content"]
    assert "<tool_response>" in shown and "<|vision_start|><|image_pad|><|vision_end|>" in shown
    assert "zoom_in: " in shown and shown.count("<|image_pad|>") == 1  # vLLM's form: one pad per image
    # The turn after the observation ran on the engine with the crop as a second image: a placeholder without its
    # image would have been refused, and the stream would end in an error event.
    assert chunks[3]["choices"][0]["delta"]["reasoning_content"] == "</tool_call>"
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["trace"]["finish"] == "turn_limit"
    assert [t.get("tool") for t in final["trace"]["turns"]] == ["zoom_in"]


@pytest.mark.slow
def test_a_bad_tool_call_gets_the_gyms_error_and_the_episode_goes_on(tool_server, tool_checkpoint, scan):  # noqa: F811
    body = tool_request(tool_checkpoint, scan, '{"name": "saw", "arguments": {}}')
    reply = httpx.post(tool_server["url"] + "/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=180).json()
    turn = reply["trace"]["turns"][0]
    assert turn["requested"] == "saw" and "tool" not in turn
    assert turn["error"] == "tool 'saw' does not exist; available tools: zoom_in"
    assert "error: tool 'saw' does not exist" in reply["trace"]["transcript"]
    assert reply["trace"]["finish"] == "turn_limit"
