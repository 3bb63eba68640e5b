"""Agent mode of the Serve app: the retrieval loop, its trace, and its stream turn by turn.

The app of test_serve.py (its module fixture, deployed again for this module) over the tiny random model: `</query>`
is made certain with a logit bias (the random model would not write it), so every turn's shape is known.
"""
import json

import httpx
import pytest
from test_serve import KEY, client, server  # noqa: F401  (the deployed app and its OpenAI client)

QUERY = "progressive proximal muscle weakness in a boy"


def agent_request(tiny_model_path) -> dict:
    """A continued assistant turn that opened a query, one turn allowed, with its trace."""
    from transformers import AutoTokenizer

    close_query = AutoTokenizer.from_pretrained(tiny_model_path).convert_tokens_to_ids("</query>")
    return {"model": "medray-agent", "max_tokens": 16, "seed": 3, "logit_bias": {str(close_query): 100},
            "messages": [{"role": "user", "content": "A boy with calf pseudohypertrophy. Diagnosis?"},
                         {"role": "assistant", "content": f"<think>muscle disease</think><query>{QUERY}"}],
            "continue_final_message": True, "agent": {"trace": True, "max_turns": 1, "top_k": 2}}


def expected_hits(server) -> list[str]:
    from actors.retriever import LocalRetriever
    return [hit["id"] for hit in LocalRetriever(server["index"], config={"mode": "dense"}).search([QUERY], 2)[0]]


@pytest.mark.slow
def test_agent_mode_retrieves_and_returns_the_trace(server, client, tiny_model_path):  # noqa: F811
    """The loop must search, append the hits and continue until its turn limit."""
    request = agent_request(tiny_model_path)
    reply = client.chat.completions.create(
        **{k: request[k] for k in ("model", "max_tokens", "seed", "logit_bias", "messages")},
        extra_body={k: request[k] for k in ("continue_final_message", "agent")})
    trace = reply.model_extra["trace"]
    assert [turn["query"] for turn in trace["turns"]] == [QUERY]
    expected = expected_hits(server)
    assert [c["id"] for c in trace["turns"][0]["chunks"]] == expected and expected[0] == "dmd#0"
    assert trace["turns"][0]["error"] is None
    assert "<retrieve>" in trace["transcript"] and "Duchenne" in trace["transcript"]
    assert trace["finish"] == "turn_limit" and reply.choices[0].finish_reason == "length"

    streamed = list(client.chat.completions.create(model="medray-agent", max_tokens=4, stream=True,
                                                   messages=[{"role": "user", "content": "Diagnosis?"}]))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_agent_mode_streams_each_turn_as_it_ends(server, client, tiny_model_path):  # noqa: F811
    """Read chunk by chunk: the model's turn, the retriever's observation (with the query and its hits), the next
    turn, and only then the answer and the finish reason; the turns' text adds up to the trace's transcript."""
    events = []
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json={**agent_request(tiny_model_path),
                                                                           "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c.get("agent", {}).get("kind") for c in chunks] == [None, "model", "observation", "model", None, None]
    first, observation = chunks[1], chunks[2]
    assert first["choices"][0]["delta"]["reasoning_content"] == "</query>"
    assert observation["agent"]["query"] == QUERY and [c["id"] for c in observation["agent"]["chunks"]] == \
        expected_hits(server)
    shown = observation["choices"][0]["delta"]["reasoning_content"]
    assert shown.strip().startswith("<retrieve>") and shown.strip().endswith("</retrieve>") and "Duchenne" in shown
    answer, final = chunks[4], chunks[5]
    assert answer["choices"][0]["delta"] == {"content": ""}  # the turn limit came before an answer
    assert final["choices"][0]["finish_reason"] == "length" and final["trace"]["finish"] == "turn_limit"
    assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks) == \
        final["trace"]["transcript"]
