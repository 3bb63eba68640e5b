"""Medical image tools for tool-using policies (MedVistaGym's Gym, MedVR's zoom-in): one interface, a registry, and
the tools that run offline.

A tool is a :class:`BaseTool` subclass: a ``name``, a ``description``, a pydantic model ``Args`` whose JSON schema is
what the policy is told to write, :meth:`BaseTool.validate` (raw JSON arguments + the task's images -> typed
arguments, or a :class:`ToolArgumentError` whose message the policy reads), and :meth:`BaseTool.run_batch` (many
validated calls -> one :class:`ToolResult` each; a failing call gives a result with ``error``, never an exception for
the whole batch). Validation is a classmethod: it needs no model, so the rollout side rejects bad calls before they
reach a tool actor. Construction loads whatever the tool keeps resident (weights, a retriever handle); images are read
from the task's absolute ``images`` paths and kept in a small per-tool LRU cache.

Coordinates are pixels of the full-resolution image, ``[x0, y0, x1, y1]`` with x1/y1 exclusive (the imaging world's
convention): ``image[y0:y1, x0:x1]`` is the region.

Model-backed tools load their network once per tool actor and run one forward per batch: ``biomedclip_labels``
(BiomedCLIP), ``segment`` (SAM / MedSAM, SAM 2 / MedSAM2, actors.segmentation) and ``super_resolve`` (Swin2SR,
actors.super_resolution). Without options they build a tiny random model of the real architecture, so recipes and
tests run offline; on a cluster with weights, point them at a local Hugging Face directory, e.g.
``tools: {segment: {num_gpus: 1, options: {path: /models/medsam-vit-base}}}`` in the recipe's ToolsConfig
(``actors.gym``), and list the tool in ``allowed``. Masks travel in ``ToolResult.masks`` (boolean arrays),
super-resolved crops in ``ToolResult.images``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, ClassVar, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.extras import require


class ToolArgumentError(ValueError):
    """A call the tool cannot run; the message is written for the policy to read and correct."""


@dataclass
class ToolResult:
    """Structured evidence from one call: text the policy reads, boxes (``[x0, y0, x1, y1]`` full-resolution pixels)
    with a score each where the tool ranks them, boolean masks, named measurements, PIL images (crops, enhanced
    regions), or the error that replaced them."""
    text: str = ""
    boxes: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    measurements: dict[str, float] = field(default_factory=dict)
    images: list = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class ToolContext:
    """What a call may refer to: the task's images (absolute paths, in order)."""
    images: tuple[str, ...] = ()

    @classmethod
    def from_task(cls, task: dict) -> ToolContext:
        return cls(tuple(task.get("images") or ()))

    def size(self, index: int) -> tuple[int, int]:
        """(width, height) of image ``index``, read from the file header only."""
        return image_size(self.images[index])


@dataclass(frozen=True)
class ToolCall:
    """A validated call: typed arguments and the context they were validated against."""
    args: BaseModel
    context: ToolContext


@lru_cache(maxsize=4096)
def image_size(path: str) -> tuple[int, int]:
    with Image.open(path) as im:
        return im.size


def load_image(path: str) -> np.ndarray:
    """Pixels as uint8, H x W (grayscale) or H x W x 3, read-only so that a cached image cannot be altered."""
    with Image.open(path) as im:
        arr = np.asarray(im if im.mode in ("L", "RGB") else im.convert("RGB"))
    arr.flags.writeable = False
    return arr


Box = Annotated[list[int], Field(min_length=4, max_length=4,
                                 description="[x0, y0, x1, y1] in full-resolution pixels, x1 and y1 exclusive")]


class ToolArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageArgs(ToolArgs):
    image: int = Field(0, ge=0, description="which of the task's images (0 is the first)")


class RegionArgs(ImageArgs):
    box: Box | None = Field(None, description="[x0, y0, x1, y1] in full-resolution pixels; omit for the whole image")


class ZoomInArgs(ImageArgs):
    box: Box


class EnhanceArgs(RegionArgs):
    method: Literal["clahe", "denoise", "brighten"]


class FindRegionsArgs(RegionArgs):
    max_regions: int = Field(5, ge=1, le=20)


class LabelArgs(RegionArgs):
    labels: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(min_length=2, max_length=16)


class QueryArgs(ToolArgs):
    query: str = Field(min_length=1, max_length=512)


def describe_validation_error(error: ValidationError) -> str:
    """pydantic's errors as the policy should read them: 'box: List should have at least 4 items; ...'."""
    parts = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "arguments"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def check_box(box: list[int], size: tuple[int, int], image: int) -> None:
    """A box must be non-empty and lie inside the image: 0 <= x0 < x1 <= width, 0 <= y0 < y1 <= height."""
    x0, y0, x1, y1 = box
    width, height = size
    if x0 >= x1 or y0 >= y1:
        raise ToolArgumentError(f"box {box} is empty: need x0 < x1 and y0 < y1")
    if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
        raise ToolArgumentError(f"box {box} lies outside image {image} ({width} x {height} px): need "
                                f"0 <= x0 < x1 <= {width} and 0 <= y0 < y1 <= {height}")


class BaseTool:
    """One tool: a name, a description, typed arguments, validation, batched execution (see the module doc)."""
    name: ClassVar[str]
    description: ClassVar[str]
    Args: ClassVar[type[ToolArgs]]

    @classmethod
    def schema(cls) -> dict:
        """The function description a policy's prompt lists: name, description, JSON schema of the arguments."""
        return {"name": cls.name, "description": cls.description, "parameters": cls.Args.model_json_schema()}

    @classmethod
    def validate(cls, args, context: ToolContext) -> ToolArgs:
        """Raw arguments (a JSON object) -> typed arguments, or ToolArgumentError saying what to fix."""
        if not isinstance(args, dict):
            raise ToolArgumentError(f"{cls.name}: arguments must be a JSON object, got {type(args).__name__}")
        try:
            typed = cls.Args.model_validate(args)
        except ValidationError as e:
            raise ToolArgumentError(f"{cls.name}: {describe_validation_error(e)}") from None
        cls.check(typed, context)
        return typed

    @classmethod
    def check(cls, args: ToolArgs, context: ToolContext) -> None:
        """Checks that need the task (image index, box inside the image); raise ToolArgumentError."""

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; an exception in one call becomes that call's error."""
        return [self._guarded(self.run, call) for call in calls]

    def run(self, call: ToolCall) -> ToolResult:
        raise NotImplementedError

    @staticmethod
    def _guarded(fn, *args) -> ToolResult:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  one bad call must not fail the batch of other episodes
            return ToolResult(error=f"{type(e).__name__}: {e}")


TOOLS: dict[str, type[BaseTool]] = {}


def register_tool(cls: type[BaseTool]) -> type[BaseTool]:
    """Class decorator: make a tool available by its ``name`` to configs and the Gym."""
    if cls.name in TOOLS and TOOLS[cls.name] is not cls:
        raise ValueError(f"tool {cls.name!r} is already registered by {TOOLS[cls.name].__qualname__}")
    TOOLS[cls.name] = cls
    return cls


def tool_class(name: str) -> type[BaseTool]:
    if name not in TOOLS:
        raise KeyError(f"unknown tool {name!r}; registered: {sorted(TOOLS)}")
    return TOOLS[name]


def make_tool(name: str, **kwargs) -> BaseTool:
    """An instance of the registered tool ``name``, its resources loaded (kwargs go to its constructor)."""
    return tool_class(name)(**kwargs)


# ---- image tools -------------------------------------------------------------------------------------------------


class ImageTool(BaseTool):
    """A tool over one of the task's images, optionally restricted to a box; images are cached per tool."""
    Args = RegionArgs

    def __init__(self, cache_size: int = 64):
        self.load = functools.lru_cache(maxsize=cache_size)(load_image)

    @classmethod
    def check(cls, args: ImageArgs, context: ToolContext) -> None:
        if not context.images:
            raise ToolArgumentError(f"{cls.name}: this question has no image")
        if args.image >= len(context.images):
            raise ToolArgumentError(f"{cls.name}: image {args.image} does not exist; the question has "
                                    f"{len(context.images)} image(s), numbered from 0")
        if getattr(args, "box", None) is not None:
            check_box(args.box, context.size(args.image), args.image)

    def region(self, call: ToolCall) -> tuple[np.ndarray, list[int]]:
        """The pixels the call is about (the box, else the whole image) and that box."""
        pixels = self.load(call.context.images[call.args.image])
        box = call.args.box or [0, 0, pixels.shape[1], pixels.shape[0]]
        x0, y0, x1, y1 = box
        return pixels[y0:y1, x0:x1], list(box)


def intensity(pixels: np.ndarray) -> np.ndarray:
    """Grayscale intensity as float32 (the channel mean for RGB)."""
    return pixels.astype(np.float32) if pixels.ndim == 2 else pixels.astype(np.float32).mean(axis=2)


def where(image: int, box: list[int]) -> str:
    return f"image {image} region [{', '.join(map(str, box))}] ({box[2] - box[0]} x {box[3] - box[1]} px)"


@register_tool
class ZoomIn(ImageTool):
    """MedVR's zoom-in: the box cropped from the full-resolution image (no resampling; the policy's image
    processor scales it)."""
    name = "zoom_in"
    description = "Crop a region of the full-resolution image to look at it closely."
    Args = ZoomInArgs

    def run(self, call: ToolCall) -> ToolResult:
        crop, box = self.region(call)
        gray = intensity(crop)
        stats = {"width": float(crop.shape[1]), "height": float(crop.shape[0]),
                 "mean_intensity": float(gray.mean()), "std_intensity": float(gray.std())}
        text = (f"zoom_in: {where(call.args.image, box)} at full resolution; mean intensity "
                f"{stats['mean_intensity']:.1f}, contrast (std) {stats['std_intensity']:.1f}.")
        return ToolResult(text=text, boxes=[box], measurements=stats, images=[Image.fromarray(np.array(crop))])


def enhance_pixels(pixels: np.ndarray, method: str) -> np.ndarray:
    """uint8 pixels enhanced with scikit-image: CLAHE (contrast-limited adaptive histogram equalisation, on the value
    channel for colour), total-variation denoising (Chambolle), or gamma 0.6 brightening."""
    require("skimage", "vision")
    from skimage import exposure, restoration, util

    image = util.img_as_float(pixels)
    if method == "clahe":
        out = exposure.equalize_adapthist(image, clip_limit=0.02)
    elif method == "denoise":
        out = restoration.denoise_tv_chambolle(image, weight=0.06, channel_axis=-1 if image.ndim == 3 else None)
    elif method == "brighten":
        out = exposure.adjust_gamma(image, 0.6)
    else:
        raise ValueError(f"unknown enhancement {method!r}")
    return util.img_as_ubyte(np.clip(out, 0.0, 1.0))


@register_tool
class Enhance(ImageTool):
    name = "enhance"
    description = ("Enhance the image or a box of it: 'clahe' (local contrast), 'denoise' (smooth noise, keep edges) "
                   "or 'brighten' (lift dark tones).")
    Args = EnhanceArgs

    def run(self, call: ToolCall) -> ToolResult:
        pixels, box = self.region(call)
        out = enhance_pixels(pixels, call.args.method)
        before, after = intensity(pixels), intensity(out)
        stats = {"mean_before": float(before.mean()), "mean_after": float(after.mean()),
                 "std_before": float(before.std()), "std_after": float(after.std())}
        text = (f"enhance ({call.args.method}): {where(call.args.image, box)}; mean intensity "
                f"{stats['mean_before']:.1f} -> {stats['mean_after']:.1f}, contrast (std) "
                f"{stats['std_before']:.1f} -> {stats['std_after']:.1f}.")
        return ToolResult(text=text, boxes=[box], measurements=stats, images=[Image.fromarray(out)])


def anatomy_orientation(gray: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The direction along which the image varies least (radians, per pixel) and how clearly it does: the structure
    tensor of gradients taken at sigma 3 px and averaged over sigma 10 px, and its coherence (l1 - l2) / (l1 + l2),
    about 1 along a bone's cortex or a rib, near 0 in isotropic texture. Gradients at 3 px barely see lines 1-2 px
    wide or small blobs, so the direction is that of the anatomy, not of a fracture line or a lesion lying across it.
    Computed at half resolution (the field is smooth) and repeated back to full size."""
    from scipy import ndimage

    half = gray[::2, ::2]
    gy = ndimage.gaussian_filter(half, 1.5, order=(1, 0))
    gx = ndimage.gaussian_filter(half, 1.5, order=(0, 1))
    jxx, jxy, jyy = (ndimage.gaussian_filter(g, 5.0) for g in (gx * gx, gx * gy, gy * gy))
    tangent = 0.5 * np.arctan2(2 * jxy, jxx - jyy) + np.pi / 2  # the gradient's direction, turned a right angle
    coherence = np.hypot(jxx - jyy, 2 * jxy) / (jxx + jyy + 1e-6)
    full = [np.repeat(np.repeat(a, 2, axis=0), 2, axis=1)[:gray.shape[0], :gray.shape[1]] for a in (tangent, coherence)]
    return full[0], full[1]


def streamline_median(gray: np.ndarray, tangent: np.ndarray, coherence: np.ndarray, samples: int = 15,
                      step: float = 4.0, min_coherence: float = 0.7) -> np.ndarray:
    """Per pixel, the median of `samples` pixels `step` px apart on the path through it that follows the anatomy:
    from the pixel, both ways along `tangent`, turning with it wherever the structure is clearly oriented
    (coherence >= min_coherence) and running straight elsewhere (in isotropic tissue the tangent is noise, and a
    wandering path would pile its samples onto a lesion). Oriented anatomy, straight or curved (a bone's cortex and
    its flared end, ribs, the soft-tissue edge), is reproduced; what the path merely crosses is not, if it is shorter
    than half the path (about 28 of 56 px): a blob, a lucency inside a bone, a fracture line across the shaft.
    Paths that leave the image repeat its border pixels."""
    h, w = gray.shape
    flat, cos_t, sin_t = gray.ravel(), np.cos(tangent).ravel(), np.sin(tangent).ravel()
    oriented = coherence.ravel() >= min_coherence
    rows, cols = (a.ravel().astype(np.float32) for a in np.mgrid[0:h, 0:w])
    stack = np.empty((samples, h * w), np.float32)
    stack[0] = flat
    for side, sign in enumerate((1.0, -1.0)):
        y, x, dy, dx = rows.copy(), cols.copy(), sign * sin_t, sign * cos_t
        for k in range(1 + side, samples, 2):
            y += step * dy
            x += step * dx
            at = np.clip(y + 0.5, 0, h - 0.5).astype(np.intp) * w + np.clip(x + 0.5, 0, w - 0.5).astype(np.intp)
            stack[k] = flat[at]
            ny, nx = sin_t[at], cos_t[at]
            back = ny * dy + nx * dx < 0  # the tangent has no sign: keep going the way the path goes
            np.negative(ny, out=ny, where=back)
            np.negative(nx, out=nx, where=back)
            turn = oriented[at]
            np.copyto(dy, ny, where=turn)
            np.copyto(dx, nx, where=turn)
    rows_of_samples = np.ascontiguousarray(stack.T)  # partition is fastest along contiguous rows
    return np.partition(rows_of_samples, samples // 2, axis=1)[:, samples // 2].reshape(h, w)


def box_iou(a: list[int], b: list[int]) -> float:
    """Intersection over union of two [x0, y0, x1, y1] boxes."""
    w = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union else 0.0


def outlier_components(residual: np.ndarray, threshold: float, min_area: int) -> list[tuple[list[int], float]]:
    """Connected components of the pixels where |r - median r| exceeds `threshold` robust sigmas of their
    neighbourhood's noise floor: the larger of the image's MAD and the lower quartile of |r - median r| within about
    32 px, so textured tissue (trabecular bone, lung markings) does not flood the mask, while a lesion covering most
    of that window does not raise its own floor. The mask is opened, then closed; components of at least `min_area`
    px are scored by contrast against the whole image (mean of |r - median r| / (1.4826 MAD) times sqrt(area)), so a
    faint patch of texture does not outrank a strong lesion. Returns (box, score), best first."""
    from scipy import ndimage

    deviation = np.abs(residual - np.median(residual))
    mad = np.median(deviation) + 1e-6
    quarter = deviation[::4, ::4]
    floor = ndimage.percentile_filter(quarter, 25, size=min(8, *quarter.shape))
    floor = np.repeat(np.repeat(floor, 4, axis=0), 4, axis=1)[:residual.shape[0], :residual.shape[1]]
    mask = deviation > threshold * 1.4826 * np.maximum(mad, floor)
    mask = ndimage.binary_closing(ndimage.binary_opening(mask))
    z = deviation / (1.4826 * mad)
    labels, _ = ndimage.label(mask)
    area = np.bincount(labels.ravel())
    score = np.bincount(labels.ravel(), z.ravel()) / np.sqrt(np.maximum(area, 1))  # mean z * sqrt(area)
    found = [([sl[1].start, sl[0].start, sl[1].stop, sl[0].stop], float(score[i]))
             for i, sl in enumerate(ndimage.find_objects(labels), start=1) if area[i] >= min_area]
    found.sort(key=lambda item: (-item[1], item[0]))
    return found


def candidate_regions(pixels: np.ndarray, max_regions: int, threshold: float = 4.0,
                      min_area: int = 15) -> list[tuple[list[int], float]]:
    """Blobs and lines that the surrounding anatomy does not explain, at two scales. Background: the median along
    the anatomy (:func:`streamline_median`), which keeps elongated anatomy (cortex, ribs, edges) that an isotropic
    median window would flag, and removes whatever crosses it. Residual r = G_1 * (I - background); fine residual
    r - G_1.5 * r. The best half of the slots (rounded up) go to :func:`outlier_components` of r, the rest to those of
    the fine residual that do not repeat a kept box (IoU >= 0.5), then to r's next ones. Returns (box, score), in
    that order; boxes in the input's pixel coordinates."""
    from scipy import ndimage

    gray = intensity(pixels)
    if min(gray.shape) < 4:
        return []
    tangent, coherence = anatomy_orientation(gray)
    residual = ndimage.gaussian_filter(gray - streamline_median(gray, tangent, coherence), 1.0)
    coarse = outlier_components(residual, threshold, min_area)
    # A small lesion (6-12 px: a bone cyst's ring, a crack, a small nodule) is a faint spot on the residual's
    # trabecular or lung texture, whose blotches are wider; removing what is smooth at 1.5 px leaves the spot on top.
    fine = outlier_components(residual - ndimage.gaussian_filter(residual, 1.5), threshold, min_area)
    # Large lesions rank first at r's scale: leaving r only 2 of 5 slots cost chest recall on them (0.84 -> 0.78).
    found = coarse[:(max_regions + 1) // 2]
    for candidate in fine + coarse[len(found):]:
        if len(found) == max_regions:
            break
        if all(box_iou(candidate[0], kept) < 0.5 for kept, _ in found):
            found.append(candidate)
    return found


@register_tool
class FindRegions(ImageTool):
    name = "find_regions"
    description = "Find candidate abnormal regions (blobs that stand out from the background); returns scored boxes."
    Args = FindRegionsArgs

    def run(self, call: ToolCall) -> ToolResult:
        pixels, (ox, oy, _, _) = self.region(call)
        found = [([x0 + ox, y0 + oy, x1 + ox, y1 + oy], score)
                 for (x0, y0, x1, y1), score in candidate_regions(pixels, call.args.max_regions)]
        listing = "; ".join(f"[{', '.join(map(str, b))}] score {s:.1f}" for b, s in found) or "none"
        return ToolResult(text=f"find_regions: image {call.args.image}: {len(found)} candidate region(s): {listing}.",
                          boxes=[b for b, _ in found], scores=[s for _, s in found])


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


@register_tool
class BiomedCLIPLabels(ModelImageTool):
    """Zero-shot labels from BiomedCLIP (actors.biomedclip): softmax over labels of the scaled cosine between the
    region's image embedding and "this is a photo of <label>"."""
    name = "biomedclip_labels"
    description = "Score candidate labels for the image or a box of it with BiomedCLIP zero-shot classification."
    Args = LabelArgs
    loader = "actors.biomedclip:load_biomedclip"

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


@register_tool
class RetrieveKnowledge(BaseTool):
    """Knowledge-base search through a Retriever actor (or a ShardedRetriever) handle held for the tool's life."""
    name = "retrieve_knowledge"
    description = "Search the medical knowledge base; returns the best matching passages."
    Args = QueryArgs

    def __init__(self, retriever, top_k: int = 3):
        self.retriever, self.top_k = retriever, top_k

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Every query of the batch in one search call."""
        import ray

        from actors.environment import retrieval_text

        queries = [call.args.query for call in calls]
        search = getattr(self.retriever, "search_async", None)
        try:
            hits = ray.get(search(queries, self.top_k) if search else
                           self.retriever.search.remote(queries, self.top_k))
        except Exception as e:  # noqa: BLE001
            return [ToolResult(error=f"retrieval failed ({type(e).__name__})") for _ in calls]
        return [ToolResult(text=f"retrieve_knowledge: {retrieval_text(h[:self.top_k], None)}",
                           measurements={"hits": float(len(h))}) for h in hits]
