"""What a seeing policy's build trains and probes on: rendered imaging-world cases in memory, each image token's
finding, zoom-in crops, and the world's finding questions (tasks/vision_model.py)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tasks.imaging import FINDINGS, CaseResult
from tasks.imaging.world import IMAGE_SIZE

NONE = len(FINDINGS)  # an image token over no lesion


@dataclass
class RenderedPool:
    """Images (RGB, full resolution) with the lesions each holds, and the cases questions are made from."""
    images: list = field(default_factory=list)
    lesions: list = field(default_factory=list)  # per image: the lesions' descriptions (finding, box, stratum, ...)
    cases: list = field(default_factory=list)    # per image: a CaseResult (None for a pool read from task files)


def render_pool(builder, split: str, n: int, workers: int) -> RenderedPool:
    """Render `n` planned cases of `split` in `workers` processes."""
    from concurrent.futures import ProcessPoolExecutor

    specs = builder.plan(split, n)
    hpo_ids = {f.key: builder.hpo_id(f.key) for f in FINDINGS}
    pool = RenderedPool()
    with ProcessPoolExecutor(max(1, workers)) as ex:
        for spec, (image, lesions) in zip(specs, ex.map(_render, specs, [hpo_ids] * n, chunksize=16)):
            pool.images.append(image)
            pool.lesions.append(lesions)
            pool.cases.append(CaseResult(spec, f"{split}-{spec.index:05d}.png", lesions))
    return pool


def _render(spec, hpo_ids):
    """(RGB PIL image, lesion descriptions) of one case: what the processor and the questions take."""
    from PIL import Image
    from tasks.imaging import render_case
    rendered = render_case(spec)
    return Image.fromarray(rendered.image).convert("RGB"), [les.describe(hpo_ids[les.finding.key])
                                                           for les in rendered.lesions]


def pixels(image_processor, images: list) -> tuple:
    """(pixel_values, image_grid_thw) of `images` as the policy's processor makes them."""
    out = image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def token_targets(lesions: list[dict], side: int, flip_x: bool, flip_y: bool,
                  window: tuple[int, int, int] = (0, 0, IMAGE_SIZE)) -> list[int]:
    """For each of the `side` x `side` merged tokens (raster order) of the square `window` (x0, y0, size in
    full-resolution pixels: the whole image, or a zoom-in crop) flipped as asked, the finding whose lesion box
    overlaps the token most, or NONE; a token holding less than MIN_SHARE of a box does not count (a sliver of a
    lesion shows nothing)."""
    wx, wy, size = window
    span = size / side
    boxes = []
    for les in lesions:
        x0, y0, x1, y1 = les["box"]
        x0, x1, y0, y1 = x0 - wx, x1 - wx, y0 - wy, y1 - wy
        if flip_x:
            x0, x1 = size - x1, size - x0
        if flip_y:
            y0, y1 = size - y1, size - y0
        boxes.append((FINDING_INDEX[les["finding"]], x0, y0, x1, y1, MIN_SHARE * (x1 - x0) * (y1 - y0)))
    out = []
    for row in range(side):
        for col in range(side):
            best, label = 0.0, NONE
            for finding, x0, y0, x1, y1, least in boxes:
                area = max(0.0, min(x1, (col + 1) * span) - max(x0, col * span)) * \
                    max(0.0, min(y1, (row + 1) * span) - max(y0, row * span))
                if area >= least and area > best:
                    best, label = area, finding
            out.append(label)
    return out


FINDING_INDEX = {f.key: i for i, f in enumerate(FINDINGS)}
MIN_SHARE = 0.25


ZOOM_SIZES = (112, 224)  # crop sides in full-resolution pixels: what a zoom-in call shows, magnified 2-4x


def zoom_window(lesions: list[dict], rng: random.Random) -> tuple[int, int, int]:
    """A square crop (x0, y0, size) that holds one of the image's lesions, as a zoom-in call would take it."""
    x0, y0, x1, y1 = rng.choice(lesions)["box"]
    size = max(rng.randint(*ZOOM_SIZES), x1 - x0, y1 - y0)
    x = rng.randint(max(0, x1 - size), min(x0, IMAGE_SIZE - size))
    y = rng.randint(max(0, y1 - size), min(y0, IMAGE_SIZE - size))
    return x, y, size


def reply(metadata: dict, answer: str) -> str:
    """The policy's whole reply to a finding question: a thought naming the asked region's finding in words, then the
    answer (closed by encode)."""
    return f"<think>The {metadata['region']} of the image shows {metadata['hpo_name']}.</think><answer>{answer}"


def question_rows(builder, pool: RenderedPool, split: str, kinds=("finding_mcq", "finding_open")) -> list[tuple]:
    """(image index, chat messages, reply, lesion size) for the world's questions on the pool's cases."""
    made = builder.tasks(split, pool.cases)
    rows = []
    for kind in kinds:
        for i, task in enumerate(made[kind]):
            rows.append((i, [m.model_dump() for m in task.messages], reply(task.metadata, task.answer),
                         task.metadata["size_stratum"]))
    return rows


def held_out_pool(limit: int) -> tuple[RenderedPool, list[tuple]]:
    """The world's held-out finding questions (`imaging:finding_mcq_test`, the first `limit`) and their images."""
    from PIL import Image
    from tasks.catalog import load_tasks

    pool, rows = RenderedPool(), []
    for task in load_tasks("imaging:finding_mcq_test")[:limit]:
        with Image.open(task["images"][0]) as image:
            pool.images.append(image.convert("RGB"))
        pool.lesions.append(task["metadata"]["lesions"])
        pool.cases.append(None)
        rows.append((len(rows), task["messages"], reply(task["metadata"], task["answer"]),
                     task["metadata"]["size_stratum"]))
    return pool, rows
