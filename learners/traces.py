"""A run's episodes, step by step: what the trainer keeps of them and the page that shows them.

Each GRPO step the trainer keeps its first `logging.trace_episodes_per_step` training episodes (whole groups first)
in output_dir/traces.jsonl, one line each: step, stage, task id, prompt, turns (queries and their hits, tool calls,
with the images the environment returned as data URLs), response text, answer, gold, correctness, total reward and
each component, advantage. The file stays under `logging.trace_max_mb` by thinning whole steps.

    medray traces <run_dir> [--out page.html]

writes one self-contained HTML page of them (inline CSS and script, images inline) that filters by reward, answer and
stage; the filters live in the page's URL hash (`#min=1&max=2&answer=incorrect&stage=grpo&open=all`), so a link
shows a filtered view.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import logging
import math
import os
import re
from pathlib import Path

TRACES = "traces.jsonl"
IMAGE_SIDE = 320  # longest side of an image kept in a trace: enough to see a crop, small on disk

log = logging.getLogger("medray.traces")


# ---- what the trainer keeps --------------------------------------------------------------------------------------
def episode_rows(step: int, stage: str, episodes: list, trained: list[dict], advantages: list[float],
                 observation_tag: str | None) -> list[dict]:
    """Trace rows of `episodes` (Trajectory), the first of a step's training batch: `trained` are the reward actors'
    score dicts of the batch in sample order, `advantages` one per sample of the batch; `observation_tag` (the
    grammar's) tells the turns' images apart."""
    from learners.evaluate import sample_record
    totals = [x for s in trained for x in s["total"]]  # as learners.metrics.sample_totals, which imports this module
    components = {k: [x for s in trained for x in s["components"][k]] for k in trained[0]["components"]}
    rows = []
    for i, t in enumerate(episodes):
        record = sample_record(t)
        text, per_turn = turn_images(record.pop("text"), len(t.turns), observation_tag)
        urls = [image_url(a) for a in t.images]
        first = max(len(urls) - sum(per_turn), 0)  # the task's images come first, then the environment's
        ends = [first + sum(per_turn[:j + 1]) for j in range(len(per_turn))]
        rows.append({"step": step, "stage": stage, "group": t.group, "id": t.task.get("id"),
                     "prompt": [{"role": m.get("role"), "content": m.get("content")} for m in t.task["messages"]],
                     "images": urls[:first],
                     "turns": [{**turn, "images": urls[end - n:end]} for turn, n, end in zip(t.turns, per_turn, ends)],
                     "text": text, "gold": t.task.get("answer"), **record, "finish": t.finish_reason,
                     "tokens": t.num_policy_tokens, "reward": totals[i],
                     "components": {k: finite(v[i]) for k, v in components.items()}, "advantage": advantages[i]})
    return rows


def finite(value: float) -> float | None:
    """A diagnostic component is NaN where it does not apply: None in JSON."""
    return None if isinstance(value, float) and math.isnan(value) else value


def plain(value):
    """A turn record's numpy value (a tool's box, score or measurement) as JSON takes it."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def turn_images(text: str, turns: int, observation_tag: str | None) -> tuple[str, list[int]]:
    """The response text with each image's token run shortened to `[image]`, and how many images each turn's
    observation holds (the i-th observation of the text answers the i-th turn)."""
    from actors.image_tokens import FAMILIES

    counts = [0] * turns
    layouts = {layout.start: layout for layout in FAMILIES.values()}
    if observation_tag and turns:
        for i, part in enumerate(text.split(f"<{observation_tag}>")[1:turns + 1]):
            counts[i] = sum(part.split(f"</{observation_tag}>")[0].count(start) for start in layouts)
    for layout in layouts.values():
        text = re.sub(f"{re.escape(layout.start)}(?:{re.escape(layout.pad)})*{re.escape(layout.end)}", "[image]", text)
    return text, counts


def image_url(array) -> str:
    """An RGB uint8 array as a JPEG data URL, its longest side at most IMAGE_SIDE."""
    from PIL import Image

    image = Image.fromarray(array).convert("RGB")
    image.thumbnail((IMAGE_SIDE, IMAGE_SIDE))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def line_step(line: str) -> float:
    """A JSON line's step (metrics.jsonl, traces.jsonl); a blank line or one torn by a killed driver counts as after
    every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class TraceLog:
    """output_dir/traces.jsonl. Steps are traced when divisible by `stride` (1 at first); a file past the bound keeps
    every other traced step and the stride doubles, so a long run stays covered from its start to its end. With
    `resume_step` the lines of later steps are dropped: they are traced again when redone."""

    def __init__(self, out: Path, cfg, resume_step: int | None = None):
        """`cfg`: the run's logging section (trace_episodes_per_step, trace_max_mb)."""
        self.path, self.episodes, self.stride = out / TRACES, cfg.trace_episodes_per_step, 1
        self.bound = int(cfg.trace_max_mb * 2 ** 20)
        if resume_step is not None and self.path.exists():
            self._rewrite(lambda step: step <= resume_step)
        self._bound()

    def due(self, step: int) -> bool:
        return self.episodes > 0 and step % self.stride == 0

    def record(self, step: int, stage: str, batch: list, trained: list[dict], advantages: list[float],
               observation_tag: str | None) -> None:
        """Trace step `step` when it is due: the first episodes of `batch` (its trajectory shares, object refs) with
        the rest as `episode_rows` takes them. A step not due costs nothing."""
        if not self.due(step):
            return
        import ray
        episodes: list = []
        for share in batch:  # the first shares only: the driver holds a few episodes, not the batch
            if len(episodes) >= self.episodes:
                break
            episodes += ray.get(share)
        self.write(episode_rows(step, stage, episodes[:self.episodes], trained, advantages, observation_tag))

    def write(self, rows: list[dict]) -> None:
        """Append a due step's rows, then keep the file within its bound."""
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row, default=plain) + "\n" for row in rows)
        self._bound()

    def _bound(self) -> None:
        while self.path.exists() and self.path.stat().st_size > self.bound:
            self.stride *= 2
            self._rewrite(lambda step: step % self.stride == 0)
            log.warning("%s is past logging.trace_max_mb: keeping the steps divisible by %d", self.path, self.stride)

    def _rewrite(self, keep) -> None:
        lines = [line for line in self.path.read_text().splitlines() if keep(line_step(line))]
        tmp = self.path.with_name(f".{TRACES}.tmp")  # a dot file: storage publishing skips it
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)


# ---- the page ----------------------------------------------------------------------------------------------------
def load(run_dir: Path) -> list[dict]:
    """The trace rows of `run_dir`, in file order; a FileNotFoundError or ValueError naming what is missing."""
    path = run_dir / TRACES
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; a GRPO run writes it when logging.trace_episodes_per_step > 0 "
                                f"(is {run_dir} a run's output_dir?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line_step(line) != math.inf]
    if not rows:
        raise ValueError(f"{path} holds no episodes")
    return rows


def esc(value) -> str:
    """Any value as HTML text: strings as they are, the rest as JSON; always escaped."""
    return html.escape(value if isinstance(value, str) else json.dumps(value), quote=True)


def number(value) -> str:
    return "n/a" if value is None else f"{value:+.3f}" if isinstance(value, float) else esc(value)


def images(urls: list[str]) -> str:
    """Only data URLs of images: a trace never makes the page fetch anything."""
    return "".join(f'<img src="{esc(u)}" alt="image">' for u in urls if u.startswith("data:image/"))


def render_turn(index: int, turn: dict) -> str:
    head = turn.get("query") or turn.get("tool") or turn.get("requested") or ""
    parts = [f'<div class="turn"><div class="head">turn {index + 1}: <b>{esc(head)}</b>']
    if turn.get("error"):
        parts.append(f' <span class="bad">error: {esc(turn["error"])}</span>')
    parts.append("</div>")
    if turn.get("args") is not None:
        parts.append(f"<pre>{esc(turn['args'])}</pre>")
    hits = turn.get("chunks") or []
    if hits:
        parts.append("<ol class=\"hits\">" + "".join(
            f"<li><span class=\"doc\">{esc(h.get('doc_id') or h.get('id'))}</span> {esc(h.get('text', ''))}</li>"
            for h in hits) + "</ol>")
    rest = {k: v for k, v in turn.items() if k not in ("query", "tool", "requested", "error", "args", "chunks",
                                                       "images")}
    if rest:
        parts.append('<pre class="extra">' + "\n".join(f"{esc(k)}: {esc(v)}" for k, v in rest.items()) + "</pre>")
    return "".join(parts) + images(turn.get("images", [])) + "</div>"


def render_episode(row: dict) -> str:
    correct = row.get("correct")
    verdict = "correct" if correct else "incorrect"
    components = "".join(f"<tr><td>{esc(k)}</td><td>{number(v)}</td></tr>" for k, v in row["components"].items())
    prompt = "".join(f'<div class="msg"><b>{esc(m["role"])}</b><pre>{esc(m["content"])}</pre></div>'
                     for m in row["prompt"])
    turns = "".join(render_turn(i, t) for i, t in enumerate(row["turns"])) or "<p>none</p>"
    return (f'<details class="episode" data-reward="{esc(row["reward"])}" data-correct="{int(bool(correct))}" '
            f'data-stage="{esc(row["stage"])}"><summary><span class="id">{esc(row["id"])}</span> '
            f'<span class="reward">reward {number(float(row["reward"]))}</span> '
            f'<span class="adv">advantage {number(float(row["advantage"]))}</span> '
            f'<span class="{"ok" if correct else "bad"}">{verdict}</span> '
            f'answer <code>{esc(row.get("answer") or "none")}</code> gold <code>{esc(row.get("gold"))}</code> '
            f'<span class="dim">{esc(row["finish"])}, {esc(row["tokens"])} tokens, group {esc(row["group"])}'
            f'</span></summary><div class="body"><h4>Prompt</h4>{prompt}{images(row.get("images", []))}'
            f"<h4>Turns</h4>{turns}<h4>Response</h4><pre>{esc(row['text'])}</pre>"
            f'<h4>Rewards</h4><table>{components}<tr class="total"><td>total</td><td>{number(float(row["reward"]))}'
            f'</td></tr><tr><td>advantage</td><td>{number(float(row["advantage"]))}</td></tr></table></div></details>')


def render(rows: list[dict], title: str) -> str:
    """The page: one section per step (in step order), its episodes collapsed under a one-line summary."""
    from learners.traces_page import PAGE

    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["step"], []).append(row)
    sections = "".join(
        f'<section class="step"><h2>step {step} <span class="dim">{esc(", ".join(sorted({r["stage"] for r in group})))}'
        f'</span></h2>{"".join(render_episode(r) for r in group)}</section>' for step, group in sorted(steps.items()))
    stages = "".join(f'<option value="{esc(s)}">{esc(s)}</option>' for s in sorted({r["stage"] for r in rows}))
    return PAGE.substitute(title=esc(title), total=len(rows), steps=len(steps), stages=stages, sections=sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medray traces", description="write a self-contained HTML page of a run's "
                                     "traced episodes (output_dir/traces.jsonl), by step")
    parser.add_argument("run_dir", type=Path, help="the run's output_dir")
    parser.add_argument("--out", type=Path, help="the page (default: <run_dir>/traces.html)")
    args = parser.parse_args(argv)
    try:
        rows = load(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"medray traces: {e}\n")
    out = args.out or args.run_dir / "traces.html"
    out.write_text(render(rows, f"{args.run_dir.resolve().name}: traced episodes"))
    print(f"{out}: {len(rows)} episodes of {len({r['step'] for r in rows})} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
