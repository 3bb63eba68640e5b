"""What the seeing policy's language model reads of perfect image tokens: its reading, apart from its tower.

    python benchmarks/bench_vision_reading.py [--name vision_reading] [--variants text vector asked cells] [--steps 100]
        [--every 50] [--lr 1e-3] [--limit 150]

The tower is replaced by an oracle: each of an image's 3 x 3 merged tokens (one per region a question names) is the
mean of the language model's own word embeddings of the finding whose large lesion lies in that region, or of "none"
(small lesions do not survive the policy's input: bench_vision_input.py). The language model, SmolLM2-135M-Instruct
wrapped in Qwen2.5-VL as the build wraps it (tasks/vision_model.py), learns through LoRA adapters of the build's
alignment rank on the imaging world's training finding questions (multiple choice and open, the build's alignment
data, loss on the answer), batches of 8; every --every steps it answers the first --limit held-out questions of
`imaging:finding_mcq_test` (the build's probe: the option letter of the model's greedy reply; chance 25%).
Variants:
- text: every image token is "none"; the question starts "The <region> of the image shows <finding>.";
- vector: as text, but the finding is one token whose embedding is the oracle's (the mean of its words'): a finding
  given as one vector, where the language model reads words;
- asked: only the asked region's token carries its finding: nothing to tell apart but the finding itself;
- cells: every large lesion's region carries its finding: the policy's task, with a perfect tower.
Prints held-out accuracy by variant, step and lesion size with 95% Wilson intervals; writes
benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import report  # noqa: E402
from learners.intervals import wilson_interval  # noqa: E402
from tasks.imaging.world import GRID  # noqa: E402

VARIANTS = ("text", "vector", "asked", "cells")
MARKER = "<|video_pad|>"  # the vector variant's placeholder: a token no prompt holds, read as text (no video)


def oracle_tower(tower):
    """A module in `tower`'s place (its dtype and merge size): its merged tokens are those set on it for the next
    forward."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class OracleTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dtype, self.spatial_merge_size, self.tokens = tower.dtype, tower.spatial_merge_size, None

        def forward(self, pixel_values, grid_thw=None, **_):
            return BaseModelOutputWithPooling(pooler_output=self.tokens)

    return OracleTower()


def oracle_tokens(task: dict, variant: str, word):
    """[GRID * GRID, hidden]: per region (raster order, as the merged tokens run), `word` of the finding shown there."""
    import torch
    shown = {} if variant in ("text", "vector") else {
        tuple(les["cell"]): les["hpo_name"] for les in task["metadata"]["lesions"] if les["stratum"] == "large"
        and (variant == "cells" or les["region"] == task["metadata"]["region"])}
    return torch.stack([word(shown.get((row, col), "none")) for row in range(GRID) for col in range(GRID)])


def asked_finding(task: dict) -> str:
    """The name of the finding in the region the question asks about."""
    return next(les["hpo_name"] for les in task["metadata"]["lesions"] if les["region"] == task["metadata"]["region"])


def told(task: dict, variant: str) -> dict:
    """The task, its question prefixed with the asked region's finding: in words (`text`) or as MARKER (`vector`)."""
    if variant not in ("text", "vector"):
        return task
    name = asked_finding(task) if variant == "text" else MARKER
    messages = [dict(m) for m in task["messages"]]
    messages[-1]["content"] = f"The {task['metadata']['region']} of the image shows {name}. {messages[-1]['content']}"
    return {**task, "messages": messages}


def run_variant(variant: str, args, text_dir: Path) -> list[dict]:
    """Train one variant's adapters for args.steps; its held-out accuracy by lesion size every args.every steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from PIL import Image
    from tasks.catalog import load_tasks
    from tasks.chat_format import save_processor
    from tasks.vision_data import RenderedPool, reply
    from tasks.vision_model import LANGUAGE_LINEARS, VisionRecipe, batches, cosine, encode, probe, wrap_language_model
    from transformers import AutoProcessor

    recipe = VisionRecipe()
    model, tokenizer = wrap_language_model(text_dir, recipe)
    with tempfile.TemporaryDirectory() as processor_dir:
        save_processor(tokenizer, Path(processor_dir))
        processor = AutoProcessor.from_pretrained(processor_dir)
    embed = model.model.language_model.embed_tokens.weight.detach()

    def word(text: str):
        return embed[tokenizer(f" {text}", add_special_tokens=False).input_ids].mean(0)

    tower = model.model.visual = oracle_tower(model.model.visual)
    marker, said = tokenizer.convert_tokens_to_ids(MARKER), {}

    def put_vectors(module, inputs, out):
        """Each row's MARKER embedding becomes its asked finding's oracle vector (a generated token holds none)."""
        held = inputs[0] == marker
        if not held.any():
            return out
        out = out.clone()
        out[held] = said["vectors"]
        return out

    if variant == "vector":
        model.model.language_model.embed_tokens.register_forward_hook(put_vectors)

    def show(chunk: list[dict]) -> None:
        """What the next forward sees of `chunk`: the oracle's image tokens and, for `vector`, the told findings."""
        tower.tokens = torch.cat([oracle_tokens(t, variant, word) for t in chunk])
        if variant == "vector":
            said["vectors"] = torch.stack([word(asked_finding(t)) for t in chunk])

    def tasks(specs: list[str], limit: int | None = None) -> list[dict]:
        return [told(t, variant) for spec in specs for t in load_tasks(spec)][:limit]

    train = tasks(["imaging:finding_mcq_train", "imaging:finding_open_train"])
    test = tasks(["imaging:finding_mcq_test"], args.limit)
    opening = "<think>" if args.think else "<answer>"

    def row(t: dict) -> tuple:
        """The build's question row, its reply after `opening`: thinking, the build's; else the letter alone."""
        answer = reply(t["metadata"], t["answer"]).removeprefix(opening) if args.think else t["answer"]
        return 0, t["messages"], answer, t["metadata"]["size_stratum"]

    blank = RenderedPool(images=[Image.new("RGB", (448, 448))])  # the oracle ignores pixels; only the grid counts

    for p in model.model.language_model.parameters():
        p.requires_grad_(False)
    model.model.language_model = get_peft_model(model.model.language_model, LoraConfig(
        r=recipe.align_lora_rank, lora_alpha=2 * recipe.align_lora_rank, target_modules=LANGUAGE_LINEARS))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = cosine(optimizer, args.steps)

    def held_out(step: int, started: float) -> list[dict]:
        right: dict[str, list[int]] = {}
        for i in range(0, len(test), 10):  # the oracle's tokens are set per forward, so probe 10 at a time
            chunk = test[i:i + 10]
            show(chunk)
            for stratum, got in probe(model, processor, [row(t) for t in chunk], blank, len(chunk), opening).items():
                counts = right.setdefault(stratum, [0, 0, 0])
                counts[0] += round(got["accuracy"] * got["n"])
                counts[1] += round(got["named"] * got["n"])
                counts[2] += got["n"]
        model.train()
        return [{"variant": variant, "answer": "thought" if args.think else "letter", "step": step,
                 "lesions": stratum, "accuracy": k / n, "interval": [round(x, 3) for x in wilson_interval(k, n)],
                 "named": named / n, "n": n, "train_s": round(time.time() - started)}
                for stratum, (k, named, n) in sorted(right.items())]

    draw = batches(len(train), 8, random.Random(f"{recipe.seed}:align"))
    started, rows = time.time(), []
    model.train()
    for step in range(1, args.steps + 1):
        picked = [train[i] for i in next(draw)]
        show(picked)
        model(**encode(processor, model, [row(t) for t in picked], blank, opening=opening)).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % args.every == 0 or step == args.steps:
            rows += held_out(step, started)
            print(f"{variant} step {step}: " + ", ".join(f"{r['lesions']} {r['accuracy']:.1%}" for r in rows[-2:]),
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch
    from tasks.model_aliases import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="vision_reading")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--think", action="store_true",
                        help="train and probe answers that name the asked finding before the letter")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    text_dir = Path(resolve_model("smollm2-135m-instruct"))
    rows = [r for variant in args.variants for r in run_variant(variant, args, text_dir)]
    report(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
