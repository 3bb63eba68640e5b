"""The tool interface: calls, results, argument schemas, :class:`BaseTool`, its registry and image tools' common base.

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
import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, ClassVar, Literal

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Constructor `options` (a config's `tools.<name>.options`) checked without building the tool: every one
        a name the constructor takes. Raises ValueError (or FileNotFoundError for a path) naming the option."""
        taken = inspect.signature(cls).parameters
        unknown = sorted(set(options) - set(taken))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; {cls.name} takes {sorted(taken)}")

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
