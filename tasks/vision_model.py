"""A seeing policy built offline: SmolLM2-135M-Instruct's language weights inside Qwen2.5-VL, with a vision tower and
projector trained on the imaging world's training images.

    medray build-model smollm2-135m-vision        # or: python -m tasks.model_aliases smollm2-135m-vision

No vision-language model ships on the package index, so medray makes one. The language model starts as the text
alias's weights: Llama's attention is Qwen2's with zero q/k/v biases, and a text token gets the same position on all
three M-RoPE axes, so before any training a text-only prompt computes what SmolLM2 computes (tested). Four vision
tokens join the vocabulary. The vision tower (Qwen2.5-VL's ViT, small, random-initialised; its patch embedding Qwen's
linear map or the recipe's `patch_embedding: conv`, a small CNN, tasks/vision_arch.py) and its patch-merging projector
learn in two stages:

1. **Tower pre-training** (no language model): a linear read-out of each merged image token names the finding whose
   lesion lies under it (or none), on images flipped at random and, some of them, cropped around a lesion as a zoom-in
   call crops them. It is cheap, so it sees many rendered images.
2. **Alignment** (the language model in the loop): the projector's output is scaled to the size of the language
   model's word embeddings, then the tower and projector learn from the imaging world's finding questions (multiple
   choice and open) on training images, the loss on the reply alone, as in LLaVA's first stage. The reply first says
   what the asked region shows, then answers (`<think>The upper right of the image shows Osteolysis.</think>
   <answer>B</answer>`): a small language model learns to name what an image token holds long before it learns to
   pick a letter from it directly (benchmarks/bench_vision_reading.py). The language model is frozen, or
   (`align_lora_rank`) tuned through LoRA adapters merged into its weights at the end.

Training images are rendered from the imaging world's ``train`` split streams (never its test images) and shown at
the input size the policy sees (tasks/vision_data.py). The build ends with a probe on held-out images
(``imaging:finding_mcq_test``: the model's greedy reply, its letter and whether its thought names the finding), by
lesion size, written into the manifest.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.imaging.world import IMAGE_SIZE, INPUT_SIZE
from tasks.chat_format import expand_image_pads
from tasks.schema import chat_prompt_ids
from tasks.vision_arch import check_patch_embedding, vision_config_entry
from tasks.vision_data import (NONE, RenderedPool, held_out_pool, pixels, question_rows, render_pool, token_targets,
                               zoom_window)

@dataclass(frozen=True)
class VisionRecipe:
    """What shapes a seeing policy's build: the tower's size and both stages' data and steps."""
    depth: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    patch_size: int = 14  # pixels a side of the patch the patch embedding embeds
    merge_size: int = 2   # merged tokens gather merge_size x merge_size patches: one per cell of the 3 x 3 grid
    patch_embedding: str = "linear"  # Qwen's linear map, or "conv": a small CNN over each patch (tasks/vision_arch.py)
    pretrain_images: int = 3000
    pretrain_steps: int = 4000
    pretrain_batch: int = 32
    pretrain_lr: float = 6e-4
    zoom_share: float = 0.3  # pre-training images shown as a zoom-in crop around one of their lesions
    align_steps: int = 300
    align_batch: int = 8
    align_lr: float = 3e-4       # the tower's and projector's
    align_lora_rank: int = 16  # > 0: the language model learns too, through LoRA adapters merged into it afterwards
    align_lora_lr: float = 1e-3  # benchmarks/bench_vision_reading.py: the rate at which it learns to read image tokens
    probe_questions: int = 150
    seed: int = 0
    threads: int = 2

    def __post_init__(self):
        check_patch_embedding(self.patch_embedding, "VisionRecipe.patch_embedding")
        if self.patch_size * self.merge_size * 3 != INPUT_SIZE:
            raise ValueError(f"patch_size {self.patch_size} x merge_size {self.merge_size} must be {INPUT_SIZE // 3} "
                             f"px, a third of the {INPUT_SIZE}-px input: one merged token per cell questions name")

    def vision_config(self, out_hidden_size: int) -> dict:
        """Qwen2.5-VL's vision settings; every block attends to the whole image (a window as large as the input)."""
        return dict(depth=self.depth, hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
                    num_heads=self.num_heads, out_hidden_size=out_hidden_size, patch_size=self.patch_size,
                    spatial_merge_size=self.merge_size,
                    temporal_patch_size=2, window_size=INPUT_SIZE, fullatt_block_indexes=list(range(self.depth)),
                    **vision_config_entry(self.patch_embedding))


def wrap_language_model(text_dir: Path, recipe: VisionRecipe):
    """(model, tokenizer): Qwen2.5-VL with the text model's weights in its language model (biases zero, the new
    vision tokens' embeddings the mean of the others) and a random vision tower of `recipe`'s size and patch
    embedding (medray's class for a convolutional one, tasks/vision_arch.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2_5_VLConfig
    from tasks.chat_format import CHAT_TEMPLATE, VISION_TOKENS
    from tasks.vision_arch_hf import new_qwen2_5_vl

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tc = text.config
    if tc.model_type != "llama":
        raise ValueError(f"{text_dir}: a seeing policy wraps a Llama text model, not {tc.model_type!r}")
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in
           [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    head_dim = tc.hidden_size // tc.num_attention_heads
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_parameters["rope_theta"],
        rope_scaling={"type": "mrope", "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8]},
        tie_word_embeddings=tc.tie_word_embeddings, torch_dtype="float32",
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=tc.bos_token_id)
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=recipe.vision_config(tc.hidden_size),
                              tie_word_embeddings=tc.tie_word_embeddings, **ids)
    torch.manual_seed(recipe.seed)
    model = new_qwen2_5_vl(config).to(torch.float32)
    weights = text.model.state_dict()
    embed = weights["embed_tokens.weight"]
    extra = len(tokenizer) - embed.shape[0]
    weights["embed_tokens.weight"] = torch.cat([embed, embed.mean(0, keepdim=True).expand(extra, -1)])
    language = model.model.language_model
    missing, unexpected = language.load_state_dict(weights, strict=False)
    if unexpected or any(not k.endswith("_proj.bias") for k in missing):
        raise RuntimeError(f"weights of {text_dir} do not fit Qwen2.5-VL's language model: missing "
                           f"{[k for k in missing if not k.endswith('_proj.bias')][:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in language.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
    model.tie_weights()
    model.generation_config.eos_token_id = text_config["eos_token_id"]
    model.generation_config.pad_token_id = text_config["pad_token_id"]
    return model, tokenizer


def batches(n: int, size: int, rng: random.Random):
    """Endless shuffled batches of indices into a pool of `n` (at least `size`)."""
    if n < size:
        raise ValueError(f"{n} examples cannot fill a batch of {size}")
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for i in range(0, n - size + 1, size):
            yield order[i:i + size]


def pretrain_tower(model, image_processor, pool: RenderedPool, recipe: VisionRecipe, progress) -> dict:
    """Stage 1: the tower and projector learn to name the finding under each merged token (or none) through a
    linear read-out that is dropped afterwards, on images flipped at random and, `zoom_share` of them, cropped around
    a lesion as a zoom-in would (the targets moved with them). Empty
    tokens outnumber lesions, so they weigh EMPTY_WEIGHT in the loss. Returns the last 20 steps' mean loss and the
    share of lesion tokens named right."""
    import torch
    from PIL import Image

    visual = model.model.visual
    head = torch.nn.Linear(model.config.text_config.hidden_size, NONE + 1)
    weight = torch.ones(NONE + 1)
    weight[NONE] = EMPTY_WEIGHT
    params = list(visual.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=recipe.pretrain_lr, weight_decay=0.01)
    schedule = cosine(optimizer, recipe.pretrain_steps)
    rng = random.Random(f"{recipe.seed}:pretrain")
    draw = batches(len(pool.images), recipe.pretrain_batch, rng)
    visual.train()
    recent = []
    for _ in range(recipe.pretrain_steps):
        images, targets = [], []
        for i in next(draw):
            flip_x, flip_y = rng.random() < 0.5, rng.random() < 0.5
            window = zoom_window(pool.lesions[i], rng) if rng.random() < recipe.zoom_share else (0, 0, IMAGE_SIZE)
            x, y, size = window
            image = pool.images[i].crop((x, y, x + size, y + size))
            if flip_x:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            if flip_y:
                image = image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
            images.append(image)
            targets.append((flip_x, flip_y, window, i))
        values, grids = pixels(image_processor, images)
        # each image's token grid is the processor's, not assumed: a crop's may differ from a whole image's
        labels = torch.tensor([label for (fx, fy, window, i), (_, side, _) in zip(targets, grids.tolist())
                               for label in token_targets(pool.lesions[i], side // visual.spatial_merge_size, fx,
                                                          fy, window)])
        logits = head(visual(values, grid_thw=grids).pooler_output)
        loss = torch.nn.functional.cross_entropy(logits, labels, weight=weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        lesion = labels != NONE
        named = (logits.argmax(-1)[lesion] == labels[lesion]).float().mean().item()
        recent = (recent + [(loss.item(), named)])[-20:]
        progress.set_postfix_str(f"tower pre-training loss {loss.item():.3f}, lesion tokens named {named:.0%}")
        progress.update(1)
    return {"loss": sum(r[0] for r in recent) / len(recent), "lesion_tokens_named": sum(r[1] for r in recent) /
            len(recent)}


EMPTY_WEIGHT = 0.2


def cosine(optimizer, steps: int, warmup: int = 10):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) *
                                             0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def encode(processor, model, rows, pool: RenderedPool, with_answer: bool = True, opening: str = ""):
    """The model's inputs for `rows` as the rollout builds them (the chat prompt's ids, the image's full run of pads)
    followed by `opening` and, `with_answer`, the reply, `</answer>` and the end of the turn, right-padded with labels
    on the reply's tokens alone; without the answer, left-padded, so that every prompt ends where generation starts."""
    import torch

    tokenizer, image_processor = processor.tokenizer, processor.image_processor
    values, grids = pixels(image_processor, [pool.images[r[0]] for r in rows])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merged = model.config.vision_config.spatial_merge_size ** 2
    opened = tokenizer.encode(opening, add_special_tokens=False)
    ids, ends = [], []
    for (_, messages, answer, _), grid in zip(rows, grids.tolist()):
        prompt = expand_image_pads(chat_prompt_ids(tokenizer, messages, 1), pad, [math.prod(grid) // merged]) + opened
        ends.append(len(prompt))
        tail = tokenizer.encode(f"{answer}</answer><|im_end|>", add_special_tokens=False) if with_answer else []
        ids.append(prompt + tail)
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), model.config.text_config.pad_token_id)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    labels = torch.full((len(ids), width), -100)
    for b, (x, end) in enumerate(zip(ids, ends)):
        at = 0 if with_answer else width - len(x)
        input_ids[b, at:at + len(x)] = torch.tensor(x)
        attention[b, at:at + len(x)] = 1
        labels[b, end:len(x)] = input_ids[b, end:len(x)]
    # mm_token_type_ids gives image tokens their 3-D M-RoPE positions, as vLLM does (learners/batches.py)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "pixel_values": values, "image_grid_thw": grids,
              "mm_token_type_ids": (input_ids == pad).int()}
    return {**inputs, "labels": labels} if with_answer else inputs


def align(model, processor, rows: list[tuple], pool: RenderedPool, recipe: VisionRecipe, progress) -> dict:
    """Stage 2: the tower and projector learn from questions on training images through the language model, the loss
    on the answer alone; the language model is frozen, or with `align_lora_rank` learns through LoRA adapters that are
    merged into its weights at the end. Returns the last 20 steps' mean loss."""
    import torch

    for p in model.model.language_model.parameters():
        p.requires_grad_(False)
    match_embedding_scale(model, processor, pool)
    groups = [{"params": list(model.model.visual.parameters()), "lr": recipe.align_lr}]
    if recipe.align_lora_rank:
        from peft import LoraConfig, get_peft_model
        adapted = get_peft_model(model.model.language_model, LoraConfig(
            r=recipe.align_lora_rank, lora_alpha=2 * recipe.align_lora_rank, target_modules=LANGUAGE_LINEARS))
        model.model.language_model = adapted
        groups.append({"params": [p for p in adapted.parameters() if p.requires_grad], "lr": recipe.align_lora_lr})
    params = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    schedule = cosine(optimizer, recipe.align_steps)
    draw = batches(len(rows), recipe.align_batch, random.Random(f"{recipe.seed}:align"))
    model.train()
    recent = []
    for step in range(recipe.align_steps):
        loss = model(**encode(processor, model, [rows[i] for i in next(draw)], pool)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        recent = (recent + [loss.item()])[-20:]
        progress.set_postfix_str(f"alignment loss {loss.item():.3f}")
        progress.update(1)
    if recipe.align_lora_rank:
        model.model.language_model = model.model.language_model.merge_and_unload()
    model.eval()
    return {"loss": sum(recent) / len(recent)}


LANGUAGE_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def match_embedding_scale(model, processor, pool: RenderedPool, images: int = 32) -> None:
    """Scale the projector's last layer so that image tokens have the root-mean-square size of the language model's
    token embeddings: the frozen model then reads them at the scale it reads words."""
    import torch

    with torch.no_grad():
        values, grids = pixels(processor.image_processor, pool.images[:images])
        merged = model.model.visual(values, grid_thw=grids).pooler_output
        words = model.model.language_model.embed_tokens.weight
        ratio = words.pow(2).mean().sqrt() / merged.pow(2).mean().sqrt()
        last = model.model.visual.merger.mlp[-1]
        last.weight.mul_(ratio)
        last.bias.mul_(ratio)


def probe(model, processor, rows: list[tuple], pool: RenderedPool, batch: int = 10, opening: str = "") -> dict:
    """By lesion size, over `rows` (finding_mcq questions with the expected reply): the share answered with the right
    option letter, and the share whose thought (`<think>`) names the right finding, from the model's greedy reply."""
    import torch

    right: dict[str, list[tuple[bool, bool]]] = {}
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            inputs = encode(processor, model, chunk, pool, with_answer=False, opening=opening)
            out = model.generate(**inputs, max_new_tokens=PROBE_TOKENS, do_sample=False)
            for b, (_, _, expected, stratum) in enumerate(chunk):
                said = opening + processor.tokenizer.decode(out[b, inputs["input_ids"].shape[1]:])
                expected = opening + expected
                letter = re.search(r"<answer>\s*([ABCD])\b", said)
                right.setdefault(stratum, []).append((
                    bool(letter) and letter.group(1) == expected.rsplit("<answer>", 1)[-1],
                    "</think>" in expected and said.split("</think>")[0] == expected.split("</think>")[0]))
    return {stratum: {"accuracy": sum(a for a, _ in v) / len(v), "named": sum(n for _, n in v) / len(v), "n": len(v)}
            for stratum, v in sorted(right.items())}


PROBE_TOKENS = 40  # a finding question's reply: its thought and answer are ~25 tokens


def build_vision_model(text_dir: Path, out: Path, recipe: VisionRecipe, show_progress: bool = True) -> dict:
    """Write a seeing policy built from the text model at `text_dir` into `out` (model, tokenizer, processor);
    returns what the build measured: each stage's last losses and the held-out probe by lesion size."""
    import torch
    from tqdm import tqdm
    from transformers import AutoProcessor
    from tasks.hpo import load_hpo_snapshot
    from tasks.imaging import ImagingTaskBuilder
    from tasks.chat_format import save_processor

    torch.set_num_threads(recipe.threads)
    model, tokenizer = wrap_language_model(text_dir, recipe)
    save_processor(tokenizer, out, recipe.patch_size, recipe.merge_size)
    processor = AutoProcessor.from_pretrained(out)
    builder = ImagingTaskBuilder(load_hpo_snapshot(), seed=0)
    with tqdm(total=recipe.pretrain_steps + recipe.align_steps, desc="seeing policy", unit="step",
              disable=not show_progress, mininterval=5) as progress:
        progress.set_postfix_str(f"rendering {recipe.pretrain_images} training images")
        pool = render_pool(builder, "train", recipe.pretrain_images, recipe.threads)
        report = {"pretrain": pretrain_tower(model, processor.image_processor, pool, recipe, progress)}
        rows = question_rows(builder, pool, "train")
        report["align"] = align(model, processor, rows, pool, recipe, progress)
        progress.set_postfix_str("probing held-out images")
        held_out, questions = held_out_pool(recipe.probe_questions)
        report["probe"] = {"data": "imaging:finding_mcq_test", **probe(model, processor, questions, held_out)}
    for p in model.parameters():
        p.requires_grad_(True)
    model.save_pretrained(out, safe_serialization=True)
    return report
