"""The quickstart on the real model (SmolLM2-135M-Instruct), shortened: base evaluation, an SFT cold-start step on
expert demonstrations, a GRPO step with retrieval, the evaluation of the result and the closing report, end to end
on the shared local Ray."""
import json

import pytest

from learners.config import load_config
from learners.trainer import Trainer

pytestmark = pytest.mark.slow

SHORT = ["total_steps=7", "stages.0.steps=6", "stages.0.sft.batch_size=8", "learner.lr=1e-4", "stages.1.steps=1",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.fidelity_check_every=1", "eval.limit=6",
         "eval.every=0", "checkpoint.every=100", "logging.progress_bar=false"]  # checkpoints at stage ends


@pytest.fixture(scope="module")
def short_quickstart(ray_session, real_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    trainer = Trainer(load_config("configs/quickstart.yaml", [*SHORT, f"output_dir={out}"]))
    trainer.fit()
    return out, trainer.report, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_quickstart_trains_the_real_model_and_reports_base_against_trained(short_quickstart):
    out, report, metrics = short_quickstart
    assert "| hpo:mcq_test | base (step 0) |" in report and "| hpo:mcq_test | after grpo (step 7) |" in report
    # eval.at_stage_end: the evaluation after the cold start, and what GRPO added to it
    assert "| hpo:mcq_test | after cold_start (step 6) |" in report and "grpo added " in report
    assert (out / "eval.md").read_text() == report
    steps = json.loads((out / "eval.json").read_text())["splits"]["hpo:mcq_test"]
    assert sorted(steps) == ["0", "6", "7"] and all(s["n"] == 6 for s in steps.values())
    assert steps["0"]["format_rate"]["mean"] == 0.0, "the base model does not know the answer grammar"
    for step in (0, 7):
        samples = (out / "eval" / f"step_{step}" / "hpo_mcq_test" / "samples.jsonl").read_text().splitlines()
        assert len(samples) == 6
    by_step = {m["step"]: m for m in metrics}
    assert by_step[0]["eval/hpo:mcq_test/format_rate"] == 0.0
    assert by_step[1]["stage_name"] == "cold_start" and by_step[1]["sft_loss"] > 0
    assert by_step[7]["stage_name"] == "grpo" and "reward_mean" in by_step[7]
    # the engine holds the learner's weights after a sync, to its dtype's rounding (a bfloat16 engine where the CPU
    # multiplies it natively: rollout.dtype auto)
    assert by_step[7]["fidelity_max_abs_diff"] <= load_config(out / "config.yaml").fidelity_tolerance()
    assert by_step[7]["mismatch/kl"] < 0.01, "engine and learner sample nearly the same distribution"
    assert "eval/hpo:mcq_test/accuracy" in by_step[7]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cold_start_trains_on_expert_demonstrations_in_the_models_own_tokens(short_quickstart):
    out, _, _ = short_quickstart
    demos = [json.loads(line) for line in (out / "stages" / "cold_start" / "demonstrations.jsonl").open()]
    assert len(demos) > 1000
    first = demos[0]["segments"]
    assert [s["role"] for s in first] == ["policy", "environment", "policy"]
    assert "<query>" in first[0]["text"] and "(option " in first[1]["text"] and "<answer>" in first[2]["text"]


def test_the_checkpoint_is_a_hugging_face_model_with_the_chat_template(short_quickstart):
    from transformers import AutoConfig, AutoTokenizer

    out, _, _ = short_quickstart
    latest = out / "checkpoints" / "latest"
    assert AutoConfig.from_pretrained(latest).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(latest)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_the_served_checkpoint_answers_as_an_agent_with_its_retrieval_trace(short_quickstart, monkeypatch):
    """The user's command, `serve run serve.app:app checkpoint=<run>/checkpoints/latest`, with nothing else: agent
    mode, the index and titles with option links come from the run. A held-out case through the stock openai client,
    its first turn the expert's (so that what is searched does not hang on a briefly trained policy), gets an answer
    in the grammar and its retrieval trace, the hits shown as in training."""
    import socket
    import time

    import httpx
    from openai import OpenAI
    from ray import serve

    from learners.data import load_tasks
    from serve.app import app
    from learners.expert import expert_query

    out, _, _ = short_quickstart
    key = "test-key-0123456789"
    monkeypatch.setenv("MEDRAY_API_KEY", key)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app({"checkpoint": str(out / "checkpoints" / "latest")}), name="quickstart", route_prefix="/",
                  blocking=False)
        deadline = time.monotonic() + 300
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the app did not become ready"
            time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["medray", "medray-agent"]
        task = load_tasks("hpo:mcq_test")[0]
        opening = f"<think>What is known about these findings? Look it up.</think>\n<query>{expert_query(task)}"
        reply = client.chat.completions.create(
            model="medray-agent", max_tokens=256, temperature=0,
            messages=[*task["messages"], {"role": "assistant", "content": opening}],
            extra_body={"continue_final_message": True, "agent": {"trace": True}})
    finally:
        serve.shutdown()
    trace = reply.model_extra["trace"]
    assert trace["turns"][0]["query"] == expert_query(task) and trace["turns"][0]["error"] is None
    observation = trace["transcript"].split("<retrieve>")[1].split("</retrieve>")[0]
    assert observation.strip().startswith("[1] ") and ": " not in observation, "titles only, as in training"
    assert f"{task['options'][task['answer']]} (option {task['answer']})" in observation, \
        "the gold disease, retrieved, is linked to its option"
    assert trace["finish"] == "answer" and reply.choices[0].message.content.strip() in task["options"]
