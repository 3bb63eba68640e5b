"""The trace viewer: what the trainer keeps of each step's episodes (traces.jsonl) and the page `medray traces` writes,
read as a person sees it (headless Chromium runs its script; the filters come from the URL hash)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from actors.trajectory import Trajectory
from learners.traces import TRACES, TraceLog, episode_rows, render

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (scripts/setup.sh installs "
                                                               "Debian's package when run as root)")


def medray_traces(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "learners.cli", "traces", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def seen(page: Path, tmp_path: Path, filters: str = "") -> dict:
    """The page after its script ran, with `filters` as the URL hash: the shown-episode counter, the step headings,
    the episodes' summaries and whether each is hidden."""
    dom = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom",
                          page.resolve().as_uri() + (f"#{filters}" if filters else "")],
                         capture_output=True, text=True, timeout=120).stdout
    episodes = re.findall(r'<details class="episode"([^>]*)>\s*<summary>(.*?)</summary>', dom, flags=re.S)
    return {"shown": int(re.search(r'<span id="shown">(\d+)</span>', dom).group(1)),
            "headings": [re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<h2>(.*?)</h2>", dom, flags=re.S)],
            "visible": [summary for attrs, summary in episodes if "hidden" not in attrs],
            "total": len(episodes)}


def trajectory(text: str, turns: list[dict], images: list, answer: str = "B") -> Trajectory:
    task = {"id": "case-1", "answer": answer, "options": {"A": "Marfan syndrome", "B": "Noonan syndrome"},
            "messages": [{"role": "system", "content": "Answer with a letter."},
                         {"role": "user", "content": "Short stature, <i>webbed neck</i>. Options: A, B."}]}
    return Trajectory(task=task, group=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[0.0] * 3,
                      loss_mask=[1, 0, 1], text=text, finish_reason="stop", weight_version=3, turns=turns,
                      images=images)


def test_rows_put_each_image_with_its_turn_and_the_page_escapes_model_text(tmp_path):
    xray, crop = np.zeros((60, 40, 3), np.uint8), np.full((20, 20, 3), 200, np.uint8)
    text = ("<tool_call>{\"name\": \"crop\"}</tool_call>\n<tool_response>\n<|vision_start|>" + "<|image_pad|>" * 5 +
            "<|vision_end|>a crop\n</tool_response>\n<answer>B</answer><script>alert(1)</script>")
    turns = [{"tool": "crop", "args": {"box": [0, 0, 10, 10]}, "error": None, "box": [0, 0, 10, 10]},
             {"query": "<img src=x onerror=alert(2)>", "error": None,
              "chunks": [{"id": "c1", "doc_id": "disease:1", "text": "Noonan <b>syndrome</b>"}]}]
    trained = [{"total": [1.5, 0.0], "components": {"accuracy": [1.0, 0.0], "query_semantic": [float("nan"), 0.2]}}]
    rows = episode_rows(4, "grpo", [trajectory(text, turns, [xray, crop])], trained, [0.9, -0.9], "tool_response")
    (row,) = rows
    assert len(row["images"]) == 1 and [len(t["images"]) for t in row["turns"]] == [1, 0]
    assert all(u.startswith("data:image/jpeg;base64,") for u in row["images"] + row["turns"][0]["images"])
    assert "[image]" in row["text"] and "<|image_pad|>" not in row["text"]
    assert (row["answer"], row["correct"], row["reward"], row["advantage"]) == ("B", True, 1.5, 0.9)
    assert row["components"] == {"accuracy": 1.0, "query_semantic": None}

    page = render(rows, "run <1>")
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "<b>syndrome" not in page and "<i>webbed" not in page and "run &lt;1&gt;" in page
    assert page.count("<img src=\"data:image/jpeg;base64,") == 2


def write_rows(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / TRACES).write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(step: int, stage: str, reward: float, correct: bool) -> dict:
    return {"step": step, "stage": stage, "group": 0, "id": f"case-{step}-{reward}", "prompt": [
        {"role": "user", "content": "question"}], "images": [], "turns": [], "text": "<answer>A</answer>",
            "gold": "A", "answer": "A" if correct else "B", "correct": correct, "finish": "stop", "tokens": 5,
            "reward": reward, "components": {"accuracy": float(correct)}, "advantage": reward - 1.0}


def test_trace_log_stays_bounded_over_the_whole_run_and_drops_redone_steps(tmp_path):
    cfg = SimpleNamespace(trace_episodes_per_step=2, trace_max_mb=4096 / 2 ** 20)  # 4 KiB: ~8 rows
    log = TraceLog(tmp_path, cfg)
    for step in range(1, 41):
        if log.due(step):
            log.write([row(step, "grpo", 1.0, True)] * 2)
    steps = sorted({json.loads(line)["step"] for line in (tmp_path / TRACES).read_text().splitlines()})
    assert (tmp_path / TRACES).stat().st_size <= 4096
    assert steps[-1] >= 32 and all(s % log.stride == 0 for s in steps) and log.stride > 1
    TraceLog(tmp_path, cfg, resume_step=16)
    assert max(json.loads(line)["step"] for line in (tmp_path / TRACES).read_text().splitlines()) <= 16


def test_a_run_directory_without_traces_gets_an_error_naming_what_is_missing(tmp_path):
    missing = medray_traces(tmp_path)
    assert missing.returncode == 2
    assert str(tmp_path / TRACES) in missing.stderr and "trace_episodes_per_step" in missing.stderr
    assert str(tmp_path / "nope") in medray_traces(tmp_path / "nope").stderr


@needs_chromium
def test_the_page_shows_steps_and_rewards_and_filters_by_reward_answer_and_stage(tmp_path):
    rows = [row(1, "warmup", 0.5, False), row(1, "warmup", 2.0, True), row(2, "grpo", 1.0, True),
            row(2, "grpo", 0.0, False), row(3, "grpo", 1.5, True)]
    write_rows(tmp_path / "run", rows)
    made = medray_traces(tmp_path / "run", "--out", tmp_path / "page.html")
    assert made.returncode == 0, made.stderr
    page = tmp_path / "page.html"

    everything = seen(page, tmp_path)
    assert everything["shown"] == everything["total"] == len(everything["visible"]) == 5
    assert everything["headings"] == ["step 1 warmup", "step 2 grpo", "step 3 grpo"]
    assert "reward +2.000" in everything["visible"][1] and "advantage +1.000" in everything["visible"][1]
    assert seen(page, tmp_path, "min=1")["shown"] == 3
    in_band = seen(page, tmp_path, "min=0.5&max=1.5")
    assert in_band["shown"] == len(in_band["visible"]) == 3 and "reward +2.000" not in "".join(in_band["visible"])
    wrong = seen(page, tmp_path, "answer=incorrect&stage=grpo")
    assert wrong["shown"] == 1 and "reward +0.000" in wrong["visible"][0] and "incorrect" in wrong["visible"][0]
    assert seen(page, tmp_path, "stage=warmup")["shown"] == 2


@pytest.mark.slow
@needs_chromium
def test_a_tiny_runs_episodes_reach_the_page(ray_session, tiny_model_path, tmp_path):
    from learners.config import load_config
    from learners.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [f"output_dir={out}", "total_steps=2", "rollout.prompts_per_step=2",
                                            "rollout.group_size=4", "rollout.max_new_tokens=16",
                                            "learner.micro_batch_size=8", "logging.progress_bar=false",
                                            "logging.tensorboard=false", "logging.trace_episodes_per_step=6"])
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (out / TRACES).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 6 + [2] * 6
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    names = {k.removeprefix("reward/") for k in logged if k.startswith("reward/")}
    assert all(set(r["components"]) == names and r["prompt"][-1]["content"] for r in rows)
    # the first group is whole: its advantages are its rewards, centred and scaled within it
    first = rows[:4]
    assert sum(r["advantage"] for r in first) == pytest.approx(0.0, abs=1e-4)
    assert len({r["group"] for r in first}) == 1 and rows[4]["group"] != rows[0]["group"]

    made = medray_traces(out)
    assert made.returncode == 0, made.stderr
    page = out / "traces.html"
    everything = seen(page, tmp_path)
    assert everything["shown"] == everything["total"] == 12
    assert [h.split()[:2] for h in everything["headings"]] == [["step", "1"], ["step", "2"]]
    assert f"reward {rows[0]['reward']:+.3f}" in everything["visible"][0]
    # a bar at the best reward keeps exactly the episodes that reached it; just above it, none
    best = max(r["reward"] for r in rows)
    at_best = seen(page, tmp_path, f"min={best!r}")
    assert at_best["shown"] == len(at_best["visible"]) == sum(r["reward"] == best for r in rows)
    assert seen(page, tmp_path, f"min={best + 1e-3!r}")["visible"] == []
