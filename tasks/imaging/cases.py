"""Cases: lesions placed in grid cells of a background, rendered to an image with every lesion's box and mask."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tasks.imaging.drawing import Background, BACKGROUNDS
from tasks.imaging.lesions import PAINTERS
from tasks.imaging.world import Finding, FINDINGS_BY_KEY, GRID, IMAGE_SIZE, INPUT_SIZE, MODALITIES, region_name


# ---- cases: placing lesions, rendering images ----------------------------------------------------------------------

CELL_MARGIN = 3
#: Lesions must lie inside this anatomy (a mask of the background), if any.
ALLOWED = {"chest_xray": "lung", "fracture": "bone", "bone_cyst": "bone", "osteolysis": "bone"}


def cell_edges(n: int = IMAGE_SIZE) -> list[int]:
    return [round(n * k / GRID) for k in range(GRID + 1)]


def _split_code(split: str) -> int:
    return int.from_bytes(hashlib.sha256(split.encode()).digest()[:4], "big")


@dataclass(frozen=True)
class LesionSpec:
    finding: str
    stratum: str


@dataclass(frozen=True)
class CaseSpec:
    """Everything that determines an image: its random stream and the lesions (the first is the target)."""

    seed: int
    split: str
    index: int
    modality: str
    lesions: tuple[LesionSpec, ...]

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "split": self.split,
            "index": self.index,
            "modality": self.modality,
            "lesions": [[ls.finding, ls.stratum] for ls in self.lesions],
        }

    @classmethod
    def from_json(cls, data: dict) -> CaseSpec:
        lesions = tuple(LesionSpec(f, s) for f, s in data["lesions"])
        return cls(data["seed"], data["split"], data["index"], data["modality"], lesions)


@dataclass
class Lesion:
    finding: Finding
    stratum: str
    cell: tuple[int, int]
    box: list[int]  # [x0, y0, x1, y1], pixel edges, x1/y1 exclusive
    mask: np.ndarray  # full-image boolean mask of the changed pixels

    @property
    def region(self) -> str:
        return region_name(*self.cell)

    def describe(self, hpo_id: str) -> dict:
        x0, y0, x1, y1 = self.box
        scale = INPUT_SIZE / IMAGE_SIZE
        return {
            "finding": self.finding.key,
            "hpo_id": hpo_id,
            "hpo_name": self.finding.hpo_name,
            "stratum": self.stratum,
            "region": self.region,
            "cell": list(self.cell),
            "box": self.box,
            "box_at_input": [round(v * scale, 2) for v in self.box],
            "size_px": max(x1 - x0, y1 - y0),
            "area_px": int(self.mask.sum()),
        }


@dataclass
class RenderedCase:
    spec: CaseSpec
    image: np.ndarray  # uint8, H x W (grayscale) or H x W x 3
    background: np.ndarray  # the same image without lesions
    lesions: list[Lesion]


def render_case(spec: CaseSpec) -> RenderedCase:
    """Draw the background, then each lesion in a free cell of its modality; deterministic in ``spec``.

    The target (first lesion) always fits; an extra lesion that fits in no free cell is left out, so
    ``len(result.lesions)`` may be less than ``len(spec.lesions)``."""
    rng = np.random.default_rng([spec.seed, _split_code(spec.split), spec.index])
    bg = BACKGROUNDS[spec.modality](rng)
    canvas = bg.image.copy()
    free = list(MODALITIES[spec.modality].cells)
    lesions: list[Lesion] = []
    for k, ls in enumerate(spec.lesions):
        finding = FINDINGS_BY_KEY[ls.finding]
        if finding.modality != spec.modality or ls.stratum not in finding.strata:
            raise ValueError(f"{ls} does not fit a {spec.modality} case")
        for i in rng.permutation(len(free)).tolist():
            placed = _place(rng, bg, finding, ls.stratum, free[i])
            if placed is not None:
                break
        else:
            if k == 0:
                raise RuntimeError(f"could not place the target {ls} in any cell of case {spec}")
            continue  # an extra lesion that fits nowhere is left out (deterministically: the same every render)
        lesion, (y0, x0, window) = placed
        free.remove(lesion.cell)
        canvas[y0 : y0 + window.shape[0], x0 : x0 + window.shape[1]] = window
        lesions.append(lesion)
    return RenderedCase(spec, canvas.astype(np.uint8), bg.image.astype(np.uint8), lesions)


def _place(rng, bg: Background, finding: Finding, stratum: str, cell: tuple[int, int], tries: int = 40):
    """Paint the lesion at random spots of ``cell`` until it fits: inside the cell (with margin) and its anatomy,
    with a box whose longer side lies in the stratum's range. Returns (Lesion, (y0, x0, new window)) or None."""
    n = bg.image.shape[0]
    edges = cell_edges(n)
    row, col = cell
    top, bottom = edges[row] + CELL_MARGIN, edges[row + 1] - CELL_MARGIN
    left, right = edges[col] + CELL_MARGIN, edges[col + 1] - CELL_MARGIN
    lo, hi = finding.size_range(stratum)
    allowed_key = ALLOWED.get(finding.key) or ALLOWED.get(finding.modality)
    allowed = bg.masks[allowed_key] if allowed_key else None
    painter = PAINTERS[finding.key]
    for _ in range(tries):
        size = rng.uniform(lo, hi)
        if bottom - top <= size or right - left <= size:
            return None
        cy = rng.uniform(top + size / 2, bottom - size / 2)
        cx = rng.uniform(left + size / 2, right - size / 2)
        if finding.modality == "chest_xray":  # cheap pre-check: the lesion's square lies in the lung
            h = size / 2
            if not allowed[int(cy - h) : int(cy + h) + 1, int(cx - h) : int(cx + h) + 1].all():
                continue
        stroke = painter(rng, bg, cy, cx, size, side=-1 if col == 0 else 1)
        h, w = stroke.delta.shape[:2]
        old = bg.image[stroke.y0 : stroke.y0 + h, stroke.x0 : stroke.x0 + w]
        new = np.clip(old + np.rint(stroke.delta).astype(np.int16), 0, 255).astype(np.int16)
        changed = new != old
        if changed.ndim == 3:
            changed = changed.any(axis=2)
        if not changed.any():
            continue
        lx0, ly0, lx1, ly1 = mask_box(changed)
        box = [stroke.x0 + lx0, stroke.y0 + ly0, stroke.x0 + lx1, stroke.y0 + ly1]
        x0, y0, x1, y1 = box
        if x0 < left or y0 < top or x1 > right or y1 > bottom:
            continue
        if not lo <= max(x1 - x0, y1 - y0) <= hi:
            continue
        if allowed is not None and (changed & ~allowed[stroke.y0 : stroke.y0 + h, stroke.x0 : stroke.x0 + w]).any():
            continue
        mask = np.zeros((n, n), bool)
        mask[stroke.y0 : stroke.y0 + h, stroke.x0 : stroke.x0 + w] = changed
        return Lesion(finding, stratum, cell, box, mask), (stroke.y0, stroke.x0, new)
    return None


def mask_box(mask: np.ndarray) -> list[int]:
    """The bounding box of a boolean mask as [x0, y0, x1, y1] pixel edges (x1, y1 exclusive)."""
    ys, xs = np.nonzero(mask)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
