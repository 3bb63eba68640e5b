"""Model-backed image tools, one network resident per tool actor: BiomedCLIP zero-shot labels, segmentation (SAM /
MedSAM, SAM 2 / MedSAM2) and super-resolution (Swin2SR)."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image

from actors.tools.base import (BaseTool, ImageTool, LabelArgs, RegionArgs, ToolCall, ToolResult, ZoomInArgs,
                               register_tool, where)


class ModelImageTool(ImageTool):
    """An image tool with a network resident for the actor's life: `path` (a local weights directory; None: the tiny
    offline build of the same architecture) and `device` (None: cuda if there, else cpu) go to the function that
    `loader` names ("module:function", imported only when a tool is built: torch stays out of the rollout side)."""
    loader: ClassVar[str]

    def __init__(self, path: str | None = None, device: str | None = None, cache_size: int = 64):
        import importlib

        super().__init__(cache_size)
        module, function = self.loader.split(":")
        self.model = getattr(importlib.import_module(module), function)(path, device=device)

    @classmethod
    def check_options(cls, options: dict) -> None:
        super().check_options(options)
        path = options.get("path")
        if path is not None and not Path(path).is_dir():
            raise FileNotFoundError(f"option 'path': {path} is not a directory (the tool's weights)")


@register_tool
class BiomedCLIPLabels(ModelImageTool):
    """Zero-shot labels from BiomedCLIP (indexing.biomedclip): softmax over labels of the scaled cosine between the
    region's image embedding and "this is a photo of <label>"."""
    name = "biomedclip_labels"
    description = "Score candidate labels for the image or a box of it with BiomedCLIP zero-shot classification."
    Args = LabelArgs
    loader = "indexing.biomedclip:load_biomedclip"

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Calls that share a label list go through one zero_shot forward together."""
        results: list[ToolResult | None] = [None] * len(calls)
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(tuple(call.args.labels), []).append(i)
        for labels, rows in groups.items():
            try:
                regions = [self.region(calls[i]) for i in rows]
                probs = self.model.zero_shot([Image.fromarray(np.array(p)) for p, _ in regions], list(labels))
            except Exception as e:  # noqa: BLE001
                for i in rows:
                    results[i] = ToolResult(error=f"{type(e).__name__}: {e}")
                continue
            for i, (_, box), row in zip(rows, regions, probs):
                ranked = sorted(zip(labels, row.tolist()), key=lambda lp: -lp[1])
                listing = ", ".join(f"{label} {p:.2f}" for label, p in ranked)
                results[i] = ToolResult(text=f"biomedclip_labels: {where(calls[i].args.image, box)}: {listing}.",
                                        boxes=[box], measurements=dict(ranked))
        return results


def forward_batch(calls: list[ToolCall], prepare, forward, finish) -> list[ToolResult]:
    """A model-backed batch: `prepare(call)` per call (a failure is that call's error), ONE `forward` over every
    prepared input (a failure is the error of each call in it), then `finish(call, prepared, output)` per call."""
    results: list[ToolResult | None] = [None] * len(calls)
    ready = []
    for i, call in enumerate(calls):
        try:
            ready.append((i, prepare(call)))
        except Exception as e:  # noqa: BLE001  one unreadable image must not fail the other episodes' calls
            results[i] = ToolResult(error=f"{type(e).__name__}: {e}")
    try:
        outputs = forward([prepared for _, prepared in ready]) if ready else []
    except Exception as e:  # noqa: BLE001
        outputs = [e] * len(ready)
    for (i, prepared), output in zip(ready, outputs):
        results[i] = (ToolResult(error=f"{type(output).__name__}: {output}") if isinstance(output, Exception) else
                      BaseTool._guarded(finish, calls[i], prepared, output))
    return results


class SegmentArgs(ZoomInArgs):
    """The image and the box around the structure to segment (the segmenter's prompt)."""


def mask_result(call: ToolCall, mask: np.ndarray) -> ToolResult:
    """A full-image boolean mask as evidence: its area, its bounding box (the prompt box if it is empty) and the
    share of it inside the prompt box (a mask that spills far outside the box is a poor one)."""
    from tasks.imaging import mask_box

    prompt = list(call.args.box)
    area = int(mask.sum())
    box = mask_box(mask) if area else prompt
    x0, y0, x1, y1 = prompt
    inside = float(mask[y0:y1, x0:x1].sum() / area) if area else 0.0
    stats = {"area_px": float(area), "width_px": float(box[2] - box[0]) if area else 0.0,
             "height_px": float(box[3] - box[1]) if area else 0.0, "inside_box": inside}
    found = (f"mask of {area} px, bounding box [{', '.join(map(str, box))}] ({box[2] - box[0]} x {box[3] - box[1]} "
             f"px), {inside:.0%} of it inside the box" if area else "nothing segmented")
    return ToolResult(text=f"segment: {where(call.args.image, prompt)}: {found}.", boxes=[box], masks=[mask],
                      measurements=stats)


@register_tool
class Segment(ModelImageTool):
    """Box-prompted segmentation with SAM / MedSAM or SAM 2 / MedSAM2 (actors.segmentation): the whole image and the
    box in, the structure's full-image mask out."""
    name = "segment"
    description = "Segment the structure inside a box; returns its mask's area in pixels and its bounding box."
    Args = SegmentArgs
    loader = "actors.segmentation:load_segmenter"

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        def prepare(call: ToolCall) -> tuple[str, np.ndarray, list[int]]:
            path = call.context.images[call.args.image]
            return path, self.load(path), call.args.box

        def forward(inputs: list[tuple[str, np.ndarray, list[int]]]) -> list[np.ndarray]:
            paths, images, boxes = zip(*inputs)
            return self.model.segment(list(images), list(boxes), keys=list(paths))

        return forward_batch(calls, prepare, forward, lambda call, _, mask: mask_result(call, mask))


@register_tool
class SuperResolve(ModelImageTool):
    """Super-resolution with Swin2SR (actors.super_resolution): the box (or the whole image) upscaled by the
    model's factor (2 for the tiny default), as an image the policy looks at."""
    name = "super_resolve"
    description = "Upscale the image or a box of it with a super-resolution network to see fine detail."
    Args = RegionArgs
    loader = "actors.super_resolution:load_super_resolver"

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        def finish(call: ToolCall, region: tuple[np.ndarray, list[int]], out: np.ndarray) -> ToolResult:
            box = region[1]
            stats = {"width": float(out.shape[1]), "height": float(out.shape[0]), "scale": float(self.model.scale)}
            text = (f"super_resolve: {where(call.args.image, box)} upscaled x{self.model.scale} to "
                    f"{out.shape[1]} x {out.shape[0]} px.")
            return ToolResult(text=text, boxes=[box], measurements=stats, images=[Image.fromarray(out)])

        return forward_batch(calls, self.region, lambda regions: self.model.upscale([p for p, _ in regions]), finish)
