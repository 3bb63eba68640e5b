"""Synthetic medical images with known lesions, the questions asked about them, and an image-caption corpus (CDIR).

Three image families, all ``IMAGE_SIZE`` x ``IMAGE_SIZE`` (448) pixels, drawn with numpy/scipy from a per-image seed:

- ``chest_xray``: a grayscale frontal chest radiograph (lungs, ribs, clavicles, spine, heart, vessel markings, noise).
- ``bone_xray``: a grayscale radiograph of both femora (cortex, trabecular medulla, soft tissue, air).
- ``pathology``: an RGB H&E-like tissue section (eosinophilic stroma, hematoxylin nuclei, clear spaces).

Each image carries one *target* lesion (what the questions ask about) and 0-2 other lesions of other kinds in other
regions. Every lesion kind is an HPO phenotype looked up in the snapshot by name (:data:`FINDINGS`), so the
knowledge base holds its description (``term:HP:...``) and the diseases annotated with it (``disease:...``):
answering needs the image (which finding is where) and retrieval (what it means, which condition it belongs to).

Exactness. A lesion is drawn as an integer change to the pixels of the finished background; its mask is, by
construction, exactly the set of pixels whose value it changes (after rounding and clipping), and its box is that
mask's bounding box in pixel-edge coordinates ``[x0, y0, x1, y1]`` (``x1``/``y1`` exclusive): ``image[y0:y1, x0:x1]``
is the tightest crop holding the lesion. :func:`render_case` re-creates any image, its masks and the lesion-free
background from the case's spec (stored in every task's ``metadata["case"]``).

Size strata. ``small`` lesions span 6-12 px at full resolution, i.e. at most 3 px at the assumed model input of
``INPUT_SIZE`` (112) px: they need a zoom-in (a crop of the full-resolution image) to be recognised. ``large`` lesions
span 28-72 px (7-18 px at the input size) and are visible without one. (Spans are the longer side of the box.)

Regions. Questions name the lesion's cell of a 3 x 3 grid over the image, in image coordinates ("the upper right of
the image"); every lesion box lies inside one cell (with a margin), and different lesions of an image occupy
different cells, so each question has one answer.

Questions (one case = one image; see :class:`ImagingTaskBuilder`):

- ``finding_mcq``: "What finding is present in the <region> of the image?" -> 4 HPO finding names of the same image
  family (the image's other findings first among the distractors), answer a letter.
- ``finding_open``: the same question, open-ended; the answer is the HPO term name, references add its synonyms.
- ``condition_mcq``: "The lesion in the <region> ... is a recognised feature of which of these conditions?" -> 4
  diseases; the answer is annotated in HPO with the finding (or a descendant), no distractor is. Diseases are split
  into train and test before any question is made (as in the HPO world), so a test condition never appears in
  training and can only be answered by retrieving. Findings annotated to no eligible disease get no such question.

Image paths in task files are relative to the world directory (POSIX, e.g. ``images/train/train-00000.png``); use
:func:`tasks.schema.resolve_image_paths` to make them absolute. The images attach to the first user message, in order; the message
text holds no placeholder token.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from tasks.schema import Message, Task, option_listing

IMAGE_SIZE = 448
INPUT_SIZE = 112
GRID = 3
BACKGROUND_RANGE = (30, 225)
LETTERS = "ABCD"

SIZE_STRATA = {"small": (6, 12), "large": (28, 72)}
ROW_NAMES = ("upper", "middle", "lower")
COL_NAMES = ("left", "central", "right")


def region_name(row: int, col: int) -> str:
    """The 3 x 3 cell in words: 'upper left', 'center', 'lower central', ..."""
    if row == 1 and col == 1:
        return "center"
    return f"{ROW_NAMES[row]} {COL_NAMES[col]}"


@dataclass(frozen=True)
class Modality:
    key: str
    label: str  # in a question: "This is a {label}."
    channels: int
    cells: tuple[tuple[int, int], ...]  # (row, col) cells lesions may occupy


_SIDE_CELLS = tuple((r, c) for r in range(GRID) for c in (0, GRID - 1))  # lungs / femora: left and right columns
MODALITIES = {
    "chest_xray": Modality("chest_xray", "frontal chest radiograph", 1, _SIDE_CELLS),
    "bone_xray": Modality("bone_xray", "radiograph of both femora", 1, _SIDE_CELLS),
    "pathology": Modality("pathology", "H&E-stained tissue section", 3,
                          tuple((r, c) for r in range(GRID) for c in range(GRID))),
}


@dataclass(frozen=True)
class Finding:
    """A lesion kind: how it is drawn (``key``), where (``modality``), what HPO calls it, which sizes it comes in."""

    key: str
    modality: str
    hpo_name: str
    strata: tuple[str, ...]
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # overrides SIZE_STRATA per stratum
    looks: str = ""  # what it looks like, for captions

    def size_range(self, stratum: str) -> tuple[int, int]:
        return self.sizes.get(stratum, SIZE_STRATA[stratum])


FINDINGS: tuple[Finding, ...] = (
    Finding("nodule", "chest_xray", "Pulmonary nodule", ("small", "large"), {"large": (28, 48)},
            "a round soft-tissue opacity"),
    Finding("calcified_nodule", "chest_xray", "Calcified pulmonary nodule", ("small", "large"), {"large": (28, 36)},
            "a very dense, sharply marginated round opacity"),
    Finding("cyst", "chest_xray", "Pulmonary cyst", ("small", "large"), {"large": (28, 56)},
            "a round lucency with a thin regular wall"),
    Finding("abscess", "chest_xray", "Lung abscess", ("large",), {"large": (32, 60)},
            "a thick-walled cavity with an air-fluid level"),
    Finding("mass", "chest_xray", "Neoplasm of the lung", ("large",), {"large": (50, 72)},
            "a large lobulated, spiculated opacity"),
    Finding("fracture", "bone_xray", "Long-bone fracture", ("small", "large"), {"large": (40, 70)},
            "a lucent fracture line through the cortex"),
    Finding("bone_cyst", "bone_xray", "Bone cyst", ("small", "large"), {"large": (28, 44)},
            "a well-defined oval medullary lucency with a thin sclerotic rim"),
    Finding("osteoma", "bone_xray", "Osteoma", ("small", "large"), {"large": (28, 40)},
            "a dense bony outgrowth from the cortex"),
    Finding("osteolysis", "bone_xray", "Osteolysis", ("small", "large"), {"large": (28, 48)},
            "a patch of moth-eaten bone destruction"),
    Finding("carcinoma", "pathology", "Carcinoma", ("small", "large"), {"large": (32, 64)},
            "a cluster of enlarged, crowded, hyperchromatic atypical nuclei"),
    Finding("necrosis", "pathology", "Hepatic necrosis", ("small", "large"), {"large": (36, 72)},
            "a pale eosinophilic patch without intact nuclei, with nuclear debris"),
    Finding("granuloma", "pathology", "Granuloma", ("large",), {"large": (40, 72)},
            "a round aggregate of pale epithelioid histiocytes rimmed by lymphocytes"),
    Finding("calcification", "pathology", "Ectopic calcification", ("small", "large"), {"large": (28, 44)},
            "a dense dark-purple laminated calcium deposit"),
    Finding("steatosis", "pathology", "Macrovesicular hepatic steatosis", ("small", "large"), {"large": (32, 60)},
            "a group of large clear fat vacuoles"),
)
FINDINGS_BY_KEY = {f.key: f for f in FINDINGS}


# ---- drawing primitives ----------------------------------------------------------------------------------------


def _grid(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates (y, x) as float32 arrays."""
    y, x = np.mgrid[0:n, 0:n].astype(np.float32)
    return y, x


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], sigma: float | tuple) -> np.ndarray:
    """Gaussian-filtered white noise scaled to unit standard deviation.

    Wide filters run on a coarser grid (a factor of about sigma/2 per axis) and are upsampled linearly: the same
    look at a fraction of the cost.
    """
    sy, sx = (sigma, sigma) if np.isscalar(sigma) else sigma
    fy, fx = max(1, int(sy // 2)), max(1, int(sx // 2))
    small = (-(-shape[0] // fy) + 1, -(-shape[1] // fx) + 1)
    noise = ndimage.gaussian_filter(rng.standard_normal(small).astype(np.float32), (sy / fy, sx / fx))
    if (fy, fx) != (1, 1):
        size = (small[1] * fx, small[0] * fy)
        noise = np.asarray(Image.fromarray(noise, mode="F").resize(size, Image.Resampling.BILINEAR))
    noise = noise[: shape[0], : shape[1]]
    return noise / (noise.std() + 1e-6)


def _soft(d: np.ndarray, width: float) -> np.ndarray:
    """1 inside (d < 0), 0 outside, a linear ramp of ``width`` px around d = 0."""
    ramp = 0.5 - d / max(width, 1e-3)
    return np.minimum(np.maximum(ramp, 0.0, out=ramp), 1.0, out=ramp)


def _ellipse_distance(y, x, cy, cx, ry, rx, angle=0.0):
    """Signed distance-like value (in px along the minor axis) of an ellipse: < 0 inside."""
    c, s = np.cos(angle), np.sin(angle)
    u = (x - cx) * c + (y - cy) * s
    v = -(x - cx) * s + (y - cy) * c
    r = np.sqrt((u / rx) ** 2 + (v / ry) ** 2)
    return (r - 1.0) * min(rx, ry)


def _blob(y, x, cy, cx, radius, rng, lobes=0.15, harmonics=(2, 3, 5)):
    """Signed distance (px) of a lobulated blob: radius modulated by a few random harmonics of the angle."""
    theta = np.arctan2(y - cy, x - cx)
    mod = np.ones_like(theta)
    for k in harmonics:
        mod += lobes / len(harmonics) * 2 * rng.uniform(-1, 1) * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    return np.hypot(y - cy, x - cx) - radius * mod


def _segment_distance(y, x, y0, x0, y1, x1):
    """Distance of each pixel centre to the segment (y0, x0)-(y1, x1)."""
    dy, dx = y1 - y0, x1 - x0
    t = ((y - y0) * dy + (x - x0) * dx) / max(dy * dy + dx * dx, 1e-6)
    t = np.minimum(np.maximum(t, 0.0, out=t), 1.0, out=t)
    return np.hypot(y - (y0 + t * dy), x - (x0 + t * dx))


def _polyline_distance(y, x, points):
    return np.min([_segment_distance(y, x, *points[i], *points[i + 1]) for i in range(len(points) - 1)], axis=0)


# ---- backgrounds -------------------------------------------------------------------------------------------------


@dataclass
class Background:
    """A lesion-free image (uint8, H x W or H x W x 3) and the anatomy lesions are placed in."""

    image: np.ndarray
    masks: dict[str, np.ndarray]  # boolean anatomy masks: 'lung', 'bone', 'medulla', 'tissue', ...
    info: dict  # geometry the lesion painters use (bone axes, ...)


def _finish(img: np.ndarray) -> np.ndarray:
    lo, hi = BACKGROUND_RANGE
    return np.clip(np.rint(img), lo, hi).astype(np.int16)


def chest_background(rng: np.random.Generator, n: int = IMAGE_SIZE) -> Background:
    y, x = _grid(n)
    u, v = x / n, y / n
    img = np.full((n, n), 118.0, np.float32) + 10 * _smooth_noise(rng, (n, n), 40)
    body = _soft(np.abs(u - 0.5) - rng.uniform(0.44, 0.47), 0.02) * _soft(-v + 0.02, 0.02)
    img = 40 + (img - 40) * body
    lung = np.zeros((n, n), np.float32)
    hard = np.zeros((n, n), bool)
    for side in (-1, 1):
        cx = 0.5 + side * rng.uniform(0.205, 0.225)
        cy, ry, rx = rng.uniform(0.46, 0.49), rng.uniform(0.31, 0.34), rng.uniform(0.150, 0.165)
        d = _ellipse_distance(v, u, cy, cx, ry, rx, angle=side * rng.uniform(0.02, 0.08))
        dome = v - (cy + ry * 0.78 - 0.06 * ((u - cx) / rx) ** 2)  # flatten the base into a diaphragm dome
        medial = side * (0.5 - u) + 0.075  # keep the mediastinum
        dist = np.maximum(np.maximum(d, dome), medial) * n
        lung = np.maximum(lung, _soft(dist, 10.0))
        hard |= dist < -8  # lesions stay >= 8 px inside the lung outline
    img -= 62 * lung
    heart_d = _ellipse_distance(v, u, rng.uniform(0.62, 0.66), rng.uniform(0.55, 0.58), 0.13, rng.uniform(0.12, 0.14))
    img += 40 * _soft(heart_d * n, 12.0) * lung
    img += 28 * _soft((np.abs(u - 0.5) - 0.035) * n, 4.0)  # spine
    img += 8 * np.cos(v * n / 14.0 * 2 * np.pi) ** 8 * _soft((np.abs(u - 0.5) - 0.035) * n, 3.0)  # vertebral plates
    y0, spacing = rng.uniform(0.14, 0.17), rng.uniform(0.058, 0.064)
    xs = np.abs(u - 0.5)  # 0 at the spine, growing laterally
    curve = y0 - 0.09 * np.sin(np.clip(xs, 0, 0.5) / 0.5 * np.pi * 0.9) + 0.12 * xs**2
    k = np.clip(np.rint((v - curve) / spacing), 0, 9)  # the nearest of 10 ribs
    ribs = _soft((np.abs(v - curve - k * spacing) - 0.0095) * n, 2.5) * (xs > 0.03)
    img += 20 * ribs * (0.35 + 0.65 * lung)
    top = int(0.22 * n)  # clavicles live in the top band
    for side in (-1, 1):
        pts = [(0.13, 0.5 + side * 0.05), (0.10, 0.5 + side * 0.22), (0.115, 0.5 + side * 0.38)]
        d = _polyline_distance(v[:top], u[:top], [(py + rng.uniform(-0.01, 0.01), px) for py, px in pts]) * n
        img[:top] += 30 * _soft(d - 6, 3.0)
    vessels = _smooth_noise(rng, (n, n), 2.5) * 0.6 + _smooth_noise(rng, (n, n), 6) * 0.4
    img += 7 * vessels * lung
    img += rng.normal(0, 1.2, (n, n))
    return Background(_finish(img), {"lung": hard}, {})


def bone_background(rng: np.random.Generator, n: int = IMAGE_SIZE) -> Background:
    y, x = _grid(n)
    img = np.full((n, n), 92.0, np.float32) + 8 * _smooth_noise(rng, (n, n), 30)
    limbs = np.zeros((n, n), np.float32)
    bone = np.zeros((n, n), bool)
    medulla = np.zeros((n, n), bool)
    axes = []
    for side in (-1, 1):
        cx0 = n / 2 + side * rng.uniform(0.29, 0.31) * n
        tilt = rng.uniform(-0.025, 0.025)
        cx = cx0 + tilt * (y - n / 2)
        limb_w = rng.uniform(0.17, 0.19) * n
        limbs = np.maximum(limbs, _soft(np.abs(x - cx) - limb_w, 6.0))
        half = rng.uniform(25, 29)
        flare = half + 10 * np.clip((n * 0.12 - y) / (n * 0.12), 0, 1) ** 2  # metaphyseal flare at the top
        cortex_t = rng.uniform(6.5, 8.0)
        dist = np.abs(x - cx)
        shaft = _soft(dist - flare, 1.5)
        inner = _soft(dist - (flare - cortex_t), 1.5)
        trabecular = 145 + 10 * _smooth_noise(rng, (n, n), (6, 1.2))
        img = img * (1 - shaft) + (205 + 6 * _smooth_noise(rng, (n, n), (8, 2))) * shaft
        img = img * (1 - inner) + trabecular * inner
        bone |= dist < flare - 0.5
        medulla |= dist < flare - cortex_t - 1.5
        axes.append({"x0": float(cx0), "tilt": float(tilt), "half": float(half), "cortex": float(cortex_t)})
    img = 36 + (img - 36) * np.maximum(limbs, bone)
    img += rng.normal(0, 1.2, (n, n))
    return Background(_finish(img), {"bone": bone, "medulla": medulla}, {"axes": axes})


H_COLOR = np.array([78, 48, 140], np.float32)  # hematoxylin (nuclei)
E_COLOR = np.array([236, 170, 200], np.float32)  # eosin (stroma, cytoplasm)


def _disc_kernel(ry: float, rx: float, angle: float) -> np.ndarray:
    r = int(np.ceil(max(ry, rx))) + 1
    yy, xx = np.mgrid[-r : r + 1, -r : r + 1].astype(np.float32)
    return _soft(_ellipse_distance(yy, xx, 0, 0, ry, rx, angle), 1.2)


def _stamp_max(canvas: np.ndarray, kernel: np.ndarray, cy: int, cx: int) -> None:
    """canvas = max(canvas, kernel centred at (cy, cx)), clipped at the canvas border."""
    r = kernel.shape[0] // 2
    y0, x0 = cy - r, cx - r
    ys, xs = max(0, -y0), max(0, -x0)
    y1, x1 = min(canvas.shape[0], y0 + kernel.shape[0]), min(canvas.shape[1], x0 + kernel.shape[1])
    region = canvas[max(0, y0) : y1, max(0, x0) : x1]
    np.maximum(region, kernel[ys : ys + region.shape[0], xs : xs + region.shape[1]], out=region)


def pathology_background(rng: np.random.Generator, n: int = IMAGE_SIZE) -> Background:
    fibres = _smooth_noise(rng, (n, n), (1.5, 9)) if rng.random() < 0.5 else _smooth_noise(rng, (n, n), (9, 1.5))
    tone = _smooth_noise(rng, (n, n), 35)
    stroma = 0.5 + 0.22 * fibres + 0.18 * tone  # 0 pale .. 1 deep pink
    pale = np.array([246, 214, 228], np.float32)
    img = pale + (E_COLOR - pale) * np.clip(stroma, 0, 1.3)[..., None]
    spaces = _smooth_noise(rng, (n, n), (3, 14)) > 2.1  # clear, elongated sinusoid-like spaces
    spaces = ndimage.binary_opening(spaces, iterations=1)
    img[spaces] = [244, 236, 242]
    # nuclei: jittered grid of impulses, convolved with a few elliptical kernels
    nuclei = np.zeros((n, n), np.float32)
    kernels = []
    for _ in range(6):
        ry = rng.uniform(2.3, 3.2)
        kernels.append(_disc_kernel(ry, ry * rng.uniform(1.0, 1.6), rng.uniform(0, np.pi)))
    step = 14
    gy, gx = np.mgrid[step // 2 : n : step, step // 2 : n : step]
    keep = rng.random(gy.shape) < 0.8
    py = np.clip(gy + rng.integers(-6, 7, gy.shape), 0, n - 1)[keep]
    px = np.clip(gx + rng.integers(-6, 7, gx.shape), 0, n - 1)[keep]
    which = rng.integers(0, len(kernels), py.shape)
    density = rng.uniform(0.75, 1.0, py.shape)
    for cy, cx, k, dens in zip(py.tolist(), px.tolist(), which.tolist(), density.tolist()):
        _stamp_max(nuclei, kernels[k] * dens, cy, cx)
    nuclei *= ~spaces
    chroma = 1 + 0.12 * _smooth_noise(rng, (n, n), 1.0)
    img = img * (1 - nuclei[..., None]) + (H_COLOR * chroma[..., None]) * nuclei[..., None]
    img += rng.normal(0, 1.3, (n, n, 1))
    return Background(_finish(img), {"tissue": ~spaces}, {})


BACKGROUNDS = {"chest_xray": chest_background, "bone_xray": bone_background, "pathology": pathology_background}


# ---- lesions -----------------------------------------------------------------------------------------------------
#
# A painter returns the change it makes as a float window (h x w, or h x w x 3) and the window's top-left corner.
# Painters see the finished background so that "replace with tissue X" lesions can be written as alpha * (X - bg).


@dataclass(frozen=True)
class Stroke:
    delta: np.ndarray
    y0: int
    x0: int


def _window(bg: Background, cy: float, cx: float, half: float):
    """A square window around (cy, cx) clipped to the image: (y0, x0, yy, xx, background pixels as float)."""
    n = bg.image.shape[0]
    h = int(np.ceil(half)) + 3
    y0, x0 = max(0, int(cy) - h), max(0, int(cx) - h)
    y1, x1 = min(n, int(cy) + h + 1), min(n, int(cx) + h + 1)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    return y0, x0, yy, xx, bg.image[y0:y1, x0:x1].astype(np.float32)


def _replace(base: np.ndarray, target, alpha: np.ndarray) -> np.ndarray:
    """The change that blends ``target`` over ``base`` with ``alpha`` (broadcast over colour channels)."""
    target = np.asarray(target, np.float32)
    if base.ndim == 3:
        alpha = alpha[..., None]
    return alpha * (target - base)


def paint_nodule(rng, bg, cy, cx, size, **_):
    y0, x0, yy, xx, base = _window(bg, cy, cx, size / 2)
    r = size / 2
    d = _ellipse_distance(yy, xx, cy, cx, r * rng.uniform(0.8, 1.0), r, rng.uniform(0, np.pi))
    dome = np.sqrt(np.clip(1 - (np.hypot(yy - cy, xx - cx) / r) ** 2, 0, 1))
    amp = rng.uniform(30, 44)
    return Stroke(amp * _soft(d, 1.6) * (0.55 + 0.45 * dome), y0, x0)


def paint_calcified_nodule(rng, bg, cy, cx, size, **_):
    y0, x0, yy, xx, base = _window(bg, cy, cx, size / 2)
    r = size / 2
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.08)
    amp = rng.uniform(85, 110)
    texture = 1 + 0.06 * rng.standard_normal(yy.shape)
    return Stroke(amp * _soft(d, 0.7) * texture, y0, x0)


def paint_cyst(rng, bg, cy, cx, size, **_):
    y0, x0, yy, xx, base = _window(bg, cy, cx, size / 2)
    r = size / 2
    d = _ellipse_distance(yy, xx, cy, cx, r * rng.uniform(0.85, 1.0), r, rng.uniform(0, np.pi))
    wall = 1.0 if size < 16 else rng.uniform(1.3, 2.0)
    ring = _soft(np.abs(d + wall / 2) - wall / 2, 0.8)
    inside = _soft(d + wall, 0.8)
    return Stroke(rng.uniform(30, 40) * ring - rng.uniform(16, 22) * inside, y0, x0)


def paint_abscess(rng, bg, cy, cx, size, **_):
    y0, x0, yy, xx, base = _window(bg, cy, cx, size / 2)
    r = size / 2
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.1)
    t = max(3.0, rng.uniform(0.16, 0.24) * r)
    wall = _soft(d, 1.2) - _soft(d + t, 1.0)
    cavity = _soft(d + t, 1.0)
    level = cy + rng.uniform(-0.05, 0.35) * (r - t)
    fluid = cavity * (yy >= level)
    air = cavity * (yy < level)
    return Stroke(rng.uniform(40, 50) * wall + rng.uniform(32, 40) * fluid - rng.uniform(20, 26) * air, y0, x0)


def paint_mass(rng, bg, cy, cx, size, **_):
    y0, x0, yy, xx, base = _window(bg, cy, cx, size / 2)
    r = size / 2 * 0.78  # spicules reach out to the full size
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.25, harmonics=(2, 3, 4, 7))
    amp = rng.uniform(42, 56)
    body = amp * _soft(d, 2.5) * (0.9 + 0.1 * rng.standard_normal(yy.shape))
    spicules = np.zeros_like(yy)
    for angle in rng.uniform(0, 2 * np.pi, rng.integers(6, 11)):
        length = rng.uniform(0.12, 0.28) * size
        sy, sx = cy + 0.8 * r * np.sin(angle), cx + 0.8 * r * np.cos(angle)
        ey, ex = sy + length * np.sin(angle), sx + length * np.cos(angle)
        spicules = np.maximum(spicules, _soft(_segment_distance(yy, xx, sy, sx, ey, ex) - 0.5, 0.8))
    return Stroke(np.maximum(body, 0.55 * amp * spicules), y0, x0)


def _bone_axis(bg: Background, side: int, y: float) -> tuple[float, dict]:
    axis = bg.info["axes"][0 if side < 0 else 1]
    return axis["x0"] + axis["tilt"] * (y - bg.image.shape[0] / 2), axis


def paint_fracture(rng, bg, cy, cx, size, side=-1, **_):
    bx, axis = _bone_axis(bg, side, cy)
    half = axis["half"]
    if size >= 28:  # a complete fracture: a jagged line across the shaft
        slope = np.tan(rng.uniform(0.25, 0.9)) * rng.choice([-1, 1])
        k = 6
        xs = np.linspace(bx - half - 4, bx + half + 4, k)
        ys = cy + slope * (xs - bx) + rng.uniform(-2.5, 2.5, k)
        width = rng.uniform(1.3, 2.0)
    else:  # a short crack from one cortex inwards
        edge = rng.choice([-1, 1])
        angle = rng.uniform(-0.6, 0.6)
        length = size * 0.95
        x_start = bx + edge * (half + 2)
        xs = np.array([x_start, x_start - edge * length * np.cos(angle) * 0.5, x_start - edge * length * np.cos(angle)])
        ys = cy + np.array([0, 0.5, 1.0]) * length * np.sin(angle) + np.array([0, rng.uniform(-1.2, 1.2), 0])
        width = rng.uniform(0.9, 1.3)
    y0, x0, yy, xx, base = _window(bg, cy, bx, max(half + 8, abs(ys - cy).max() + 4))
    d = _polyline_distance(yy, xx, list(zip(ys.tolist(), xs.tolist())))
    line = _soft(d - width / 2, 0.8) * bg.masks["bone"][y0 : y0 + yy.shape[0], x0 : x0 + yy.shape[1]]
    soft_tissue = rng.uniform(92, 104)
    return Stroke(np.minimum(line * (soft_tissue - base), 0), y0, x0)


def paint_bone_cyst(rng, bg, cy, cx, size, side=-1, **_):
    bx, axis = _bone_axis(bg, side, cy)
    inner = axis["half"] - axis["cortex"] - 1.5
    ry = size / 2
    rx = min(ry * rng.uniform(0.6, 0.9), inner)
    cx = bx + rng.uniform(-1, 1) * max(0.0, inner - rx) * 0.6
    y0, x0, yy, xx, base = _window(bg, cy, cx, ry)
    d = _ellipse_distance(yy, xx, cy, cx, ry, rx)
    rim = _soft(np.abs(d + 0.9) - 0.9, 0.7)
    lumen = _soft(d + 1.8, 0.8)
    return Stroke(rng.uniform(22, 30) * rim + _replace(base, rng.uniform(100, 112), lumen * 0.85), y0, x0)


def paint_osteoma(rng, bg, cy, cx, size, side=-1, **_):
    bx, axis = _bone_axis(bg, side, cy)
    edge = rng.choice([-1, 1])
    ry = size / 2
    rx = ry * rng.uniform(0.45, 0.6)
    ex = bx + edge * (axis["half"] + rx * 0.55)
    y0, x0, yy, xx, base = _window(bg, cy, ex, ry)
    d = _ellipse_distance(yy, xx, cy, ex, ry, rx)
    alpha = _soft(d, 1.0)
    target = rng.uniform(212, 222) + 3 * rng.standard_normal(yy.shape)
    return Stroke(_replace(base, target, alpha), y0, x0)


def paint_osteolysis(rng, bg, cy, cx, size, side=-1, **_):
    bx, axis = _bone_axis(bg, side, cy)
    r = size / 2
    cx = bx + rng.uniform(-1, 1) * max(0.0, axis["half"] - r) * 0.8
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    region = _blob(yy, xx, cy, cx, r, rng, lobes=0.2) < 0
    holes = np.zeros_like(yy)
    count = max(3, int(np.pi * r * r / 28))
    for _ in range(count):
        a, rr = rng.uniform(0, 2 * np.pi), r * np.sqrt(rng.uniform(0, 1)) * 0.85
        hy, hx = cy + rr * np.sin(a), cx + rr * np.cos(a)
        hr = rng.uniform(1.4, 3.2) if size >= 28 else rng.uniform(1.2, 2.0)
        holes = np.maximum(holes, _soft(_ellipse_distance(yy, xx, hy, hx, hr, hr * rng.uniform(1, 1.8),
                                                          rng.uniform(0, np.pi)), 0.8))
    bone = bg.masks["bone"][y0 : y0 + yy.shape[0], x0 : x0 + yy.shape[1]]
    return Stroke(np.minimum(_replace(base, rng.uniform(96, 108), holes * region * bone * 0.9), 0), y0, x0)


def _scatter(rng, cy, cx, radius, count, min_gap):
    """Up to ``count`` points in a disc, about ``min_gap`` apart: a randomly offset, jittered grid, subsampled."""
    step = max(min_gap, 1e-3)
    k = int(np.ceil(radius / step)) + 1
    gy, gx = np.mgrid[-k : k + 1, -k : k + 1].astype(np.float32) * step
    gy = gy + rng.uniform(0, step) + rng.uniform(-0.15, 0.15, gy.shape) * step
    gx = gx + rng.uniform(0, step) + rng.uniform(-0.15, 0.15, gx.shape) * step
    inside = np.hypot(gy, gx) <= radius
    points = np.stack([gy[inside] + cy, gx[inside] + cx], axis=1)
    if len(points) > count:
        points = points[np.sort(rng.choice(len(points), count, replace=False))]
    return [(float(py), float(px)) for py, px in points]


def paint_carcinoma(rng, bg, cy, cx, size, **_):
    r = size / 2
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    small = size < 28
    nr_lo, nr_hi = (2.4, 3.2) if small else (3.6, 6.0)
    points = _scatter(rng, cy, cx, max(r - nr_hi, 1.0), 3 if small else int(1.1 * (r / nr_hi) ** 2) + 3,
                      nr_lo * 1.9)
    nuclei = np.zeros_like(yy)
    nucleoli = np.zeros_like(yy)
    for py, px in points:
        nr = rng.uniform(nr_lo, nr_hi)
        nuclei = np.maximum(nuclei, _soft(_blob(yy, xx, py, px, nr, rng, lobes=0.25), 0.8))
        ny, nx = py + rng.uniform(-0.3, 0.3) * nr, px + rng.uniform(-0.3, 0.3) * nr
        nucleoli = np.maximum(nucleoli, _soft(np.hypot(yy - ny, xx - nx) - (0.7 if small else 1.1), 0.6))
    region = _soft(_blob(yy, xx, cy, cx, r - 1, rng, lobes=0.15), 2.0) if not small else np.zeros_like(yy)
    out = base + _replace(base, [205, 150, 200], region * 0.45)
    chromatin = 1 + 0.15 * rng.standard_normal(yy.shape)
    out = out + _replace(out, np.stack([52 * chromatin, 24 * chromatin, 100 * chromatin], -1), nuclei)
    out = out + _replace(out, [140, 40, 95], nucleoli * nuclei)
    return Stroke(out - base, y0, x0)


def paint_necrosis(rng, bg, cy, cx, size, **_):
    r = size / 2
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.3)
    alpha = _soft(d, 1.5)
    tone = 1 + 0.03 * rng.standard_normal(yy.shape)
    out = base + _replace(base, np.stack([242 * tone, 198 * tone, 216 * tone], -1), alpha)
    debris = np.zeros_like(yy)
    for py, px in _scatter(rng, cy, cx, r * 0.85, max(2, int(r * r / 18)), 2.0):
        debris = np.maximum(debris, _soft(np.hypot(yy - py, xx - px) - rng.uniform(0.5, 1.1), 0.6))
    out = out + _replace(out, [95, 55, 135], debris * alpha)
    return Stroke(out - base, y0, x0)


def paint_granuloma(rng, bg, cy, cx, size, **_):
    r = size / 2
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.1)
    core_d = d + r * rng.uniform(0.28, 0.36)
    alpha = _soft(d, 1.5)
    out = base + _replace(base, [226, 192, 210], alpha)
    out = out + _replace(out, [226, 176, 198], _soft(core_d, 2.0))
    epithelioid = np.zeros_like(yy)
    for py, px in _scatter(rng, cy, cx, max(r * 0.6, 2.0), int(r * r / 30) + 2, 5.0):
        epithelioid = np.maximum(epithelioid, _soft(_ellipse_distance(yy, xx, py, px, 1.6, rng.uniform(3.5, 4.8),
                                                                       rng.uniform(0, np.pi)), 0.8))
    out = out + _replace(out, [150, 112, 182], epithelioid * _soft(core_d, 1.0))
    lymphocytes = np.zeros_like(yy)
    for py, px in _scatter(rng, cy, cx, r * 0.97, int(r * r / 6), 3.6):
        lymphocytes = np.maximum(lymphocytes, _soft(np.hypot(yy - py, xx - px) - 1.7, 0.7))
    rim = alpha * (1 - _soft(core_d, 1.0))
    out = out + _replace(out, [58, 30, 112], lymphocytes * rim)
    return Stroke(out - base, y0, x0)


def paint_calcification(rng, bg, cy, cx, size, **_):
    r = size / 2
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    d = _blob(yy, xx, cy, cx, r, rng, lobes=0.18)
    alpha = _soft(d, 0.7)
    rings = 0.85 + 0.15 * np.cos(2 * np.pi * np.hypot(yy - cy, xx - cx) / rng.uniform(2.8, 3.6))
    target = np.stack([82 * rings, 48 * rings, 142 * rings], -1)
    out = base + _replace(base, target, alpha)
    if size >= 28:  # a sectioning crack through the deposit
        a = rng.uniform(0, np.pi)
        crack = _soft(_segment_distance(yy, xx, cy - r * np.sin(a), cx - r * np.cos(a), cy + r * np.sin(a),
                                        cx + r * np.cos(a)) - 0.6, 0.6)
        out = out + _replace(out, [236, 222, 236], crack * alpha)
    return Stroke(out - base, y0, x0)


def paint_steatosis(rng, bg, cy, cx, size, **_):
    r = size / 2
    y0, x0, yy, xx, base = _window(bg, cy, cx, r)
    small = size < 28
    vr_lo, vr_hi = (2.6, 3.6) if small else (3.5, 7.0)
    count = 2 if small else int(1.2 * (r / vr_hi) ** 2) + 4
    out = base.copy()
    for py, px in _scatter(rng, cy, cx, max(r - vr_hi, 1.0), count, vr_hi * 1.6):
        vr = rng.uniform(vr_lo, vr_hi)
        dist = np.hypot(yy - py, xx - px) - vr
        out = out + _replace(out, [214, 150, 190], _soft(np.abs(dist) - 0.6, 0.6))
        out = out + _replace(out, [250, 247, 250], _soft(dist + 0.6, 0.7))
    return Stroke(out - base, y0, x0)


PAINTERS = {
    "nodule": paint_nodule,
    "calcified_nodule": paint_calcified_nodule,
    "cyst": paint_cyst,
    "abscess": paint_abscess,
    "mass": paint_mass,
    "fracture": paint_fracture,
    "bone_cyst": paint_bone_cyst,
    "osteoma": paint_osteoma,
    "osteolysis": paint_osteolysis,
    "carcinoma": paint_carcinoma,
    "necrosis": paint_necrosis,
    "granuloma": paint_granuloma,
    "calcification": paint_calcification,
    "steatosis": paint_steatosis,
}


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


# ---- questions ---------------------------------------------------------------------------------------------------

EXTRA_LESIONS = (0, 1, 2)
EXTRA_WEIGHTS = (0.4, 0.4, 0.2)
QUESTION_TYPES = ("finding_mcq", "finding_open", "condition_mcq")
IMAGE_NOTE = (
    "The image is {n} x {n} pixels; coordinates are pixels of the full-resolution image (x to the right, y down, "
    "origin at the top left). "
)
_ANSWER_KINDS = {"letter": "the option letter", "finding": "the name of the finding"}


def system_message(answer_kind: str, image_size: int = IMAGE_SIZE) -> Message:
    """The HPO world's system prompt (think / query / answer tags) preceded by the image's coordinate convention."""
    from tasks.hpo_tasks import SYSTEM_PROMPT

    text = IMAGE_NOTE.format(n=image_size) + SYSTEM_PROMPT.format(what=_ANSWER_KINDS[answer_kind])
    return Message(role="system", content=text)


@dataclass
class CaseResult:
    """A rendered, saved case: the image path (relative to the world directory) and its lesions, described."""

    spec: CaseSpec
    image: str
    lesions: list[dict]


class ImagingTaskBuilder:
    """Links findings to HPO terms and diseases, splits the diseases, plans cases and renders their questions.

    ``linked[finding]`` lists the diseases (ids) annotated with the finding's term or one of its descendants with a
    non-zero frequency and a name fit for an option (the HPO world's rule); each is assigned to train or test once,
    per finding in catalogue order, so that every finding with >= 2 such diseases has some in both splits.
    """

    def __init__(self, snapshot, seed: int = 0, test_fraction: float = 0.25):
        from tasks.hpo_tasks import _decent_name, _norm

        self.snapshot = snapshot
        self.seed = seed
        by_name: dict[str, list[str]] = {}
        for t in snapshot.terms.values():
            by_name.setdefault(t.name, []).append(t.id)
        self.terms = {}
        for f in FINDINGS:
            ids = by_name.get(f.hpo_name, [])
            if len(ids) != 1:
                raise LookupError(f"HPO term {f.hpo_name!r} (finding {f.key}) found {len(ids)} times in the snapshot")
            self.terms[f.key] = snapshot.terms[ids[0]]
        children: dict[str, list[str]] = {}
        for t in snapshot.terms.values():
            for p in t.parents:
                children.setdefault(p, []).append(t.id)
        seen_names: set[str] = set()
        eligible = []
        for d in snapshot.diseases.values():  # id order; the first disease of a name keeps it
            key = _norm(d.name)
            if _decent_name(d.name) and key not in seen_names:
                seen_names.add(key)
                eligible.append(d)
        self.linked: dict[str, list[str]] = {}
        for f in FINDINGS:
            below = self._descendants(self.terms[f.key].id, children)
            self.linked[f.key] = [d.id for d in eligible if any(h in below and q != 0 for h, q in d.phenotypes.items())]
        rng = random.Random(f"{seed}:imaging:split:diseases")
        assigned: dict[str, str] = {}
        for f in FINDINGS:
            pool = self.linked[f.key]
            n_test = 0 if len(pool) < 2 else max(1, round(len(pool) * test_fraction))
            have_test = sum(assigned.get(d) == "test" for d in pool)
            fresh = [d for d in pool if d not in assigned]
            rng.shuffle(fresh)
            for d in fresh:
                assigned[d] = "test" if have_test < n_test else "train"
                have_test += assigned[d] == "test"
        self.disease_split = {s: sorted(d for d, a in assigned.items() if a == s) for s in ("train", "test")}
        self.split_of = assigned

    @staticmethod
    def _descendants(term_id: str, children: dict[str, list[str]]) -> set[str]:
        found, stack = {term_id}, [term_id]
        while stack:
            for c in children.get(stack.pop(), ()):
                if c not in found:
                    found.add(c)
                    stack.append(c)
        return found

    def hpo_id(self, finding_key: str) -> str:
        return self.terms[finding_key].id

    # ---- planning ----

    def plan(self, split: str, n: int, extras: bool = True) -> list[CaseSpec]:
        """``n`` case specs: (finding, stratum) combinations balanced (each n/len +-1), 0-2 extra lesions each."""
        from tasks.hpo_tasks import _balanced

        rng = random.Random(f"{self.seed}:imaging:plan:{split}")
        combos = [(f.key, s) for f in FINDINGS for s in f.strata]
        targets = _balanced(combos, n, rng)
        specs = []
        for i, (key, stratum) in enumerate(targets):
            finding = FINDINGS_BY_KEY[key]
            n_extra = rng.choices(EXTRA_LESIONS, EXTRA_WEIGHTS)[0] if extras else 0
            others = [f for f in FINDINGS if f.modality == finding.modality and f.key != key]
            lesions = [LesionSpec(key, stratum)]
            for other in rng.sample(others, n_extra):
                lesions.append(LesionSpec(other.key, rng.choice(other.strata)))
            specs.append(CaseSpec(self.seed, split, i, finding.modality, tuple(lesions)))
        return specs

    # ---- tasks ----

    def tasks(self, split: str, cases: list[CaseResult]) -> dict[str, list[Task]]:
        """The three question types for the cases of a split (condition questions only where a disease exists)."""
        from tasks.hpo_tasks import _balanced
        from tasks.knowledge_base import name_variants

        rng = random.Random(f"{self.seed}:imaging:questions:{split}")
        with_condition = [i for i, c in enumerate(cases) if self._split_diseases(c.lesions[0]["finding"], split)]
        letters = {"finding_mcq": _balanced(LETTERS, len(cases), rng)}
        condition_letters = dict(zip(with_condition, _balanced(LETTERS, len(with_condition), rng)))
        answer_pools: dict[str, list[str]] = {}
        out: dict[str, list[Task]] = {q: [] for q in QUESTION_TYPES}
        for i, case in enumerate(cases):
            target = case.lesions[0]
            finding = FINDINGS_BY_KEY[target["finding"]]
            term = self.terms[finding.key]
            modality = MODALITIES[case.spec.modality]
            base_meta = {
                "split": split,
                "case_id": f"{split}-{case.spec.index:05d}",
                "modality": modality.key,
                "finding": finding.key,
                "hpo_id": term.id,
                "hpo_name": term.name,
                "kb_doc_id": f"term:{term.id}",
                "size_stratum": target["stratum"],
                "needs_zoom": target["stratum"] == "small",
                "region": target["region"],
                "image_size": IMAGE_SIZE,
                "input_size": INPUT_SIZE,
                "lesions": case.lesions,
                "case": case.spec.to_json(),
            }
            where = f"the {target['region']} of the image"
            intro = f"This is a {modality.label}."
            common = {"images": [case.image], "gold_boxes": [[float(v) for v in target["box"]]]}

            # finding, multiple choice: the image's other findings are the first distractors
            present = [les["finding"] for les in case.lesions[1:]]
            rest = [f.key for f in FINDINGS
                    if f.modality == modality.key and f.key != finding.key and f.key not in present]
            distractors = (present + rng.sample(rest, len(rest)))[: len(LETTERS) - 1]
            rng.shuffle(distractors)  # which letters the distractors take says nothing about them
            options = self._options(letters["finding_mcq"][i], term.name, [self.terms[k].name for k in distractors])
            out["finding_mcq"].append(
                Task(
                    id=f"imaging-finding-mcq-{split}-{i:06d}",
                    messages=[
                        system_message("letter"),
                        Message(role="user",
                                content=f"{intro} What finding is present in {where}?\n{option_listing(options)}"),
                    ],
                    answer=letters["finding_mcq"][i],
                    options=options,
                    references=[term.name],
                    metadata={"task": "imaging_finding_mcq", **base_meta,
                              "distractor_hpo_ids": [self.terms[k].id for k in distractors]},
                    **common,
                )
            )
            references = [term.name] + [s for s in term.synonyms if s.lower() != term.name.lower()]
            out["finding_open"].append(
                Task(
                    id=f"imaging-finding-open-{split}-{i:06d}",
                    messages=[
                        system_message("finding"),
                        Message(role="user", content=f"{intro} What finding is present in {where}? "
                                                     "Answer with the name of the finding."),
                    ],
                    answer=term.name,
                    options=None,
                    references=references,
                    metadata={"task": "imaging_finding_open", **base_meta},
                    **common,
                )
            )
            disease_id = self._next_answer(finding.key, split, answer_pools, rng)
            if disease_id is None:
                continue
            distractor_ids = self._condition_distractors(finding, split, rng)
            disease = self.snapshot.diseases[disease_id]
            names = [self.snapshot.diseases[d].name for d in distractor_ids]
            options = self._options(condition_letters[i], disease.name, names)
            out["condition_mcq"].append(
                Task(
                    id=f"imaging-condition-mcq-{split}-{i:06d}",
                    messages=[
                        system_message("letter"),
                        Message(role="user", content=f"{intro} The lesion in {where} is a recognised feature of "
                                                     f"which of these conditions?\n{option_listing(options)}"),
                    ],
                    answer=condition_letters[i],
                    options=options,
                    references=name_variants(disease),
                    metadata={"task": "imaging_condition_mcq", **base_meta, "disease_id": disease_id,
                              "kb_doc_ids": [f"term:{term.id}", f"disease:{disease_id}"],
                              "distractor_ids": distractor_ids},
                    **common,
                )
            )
        return out

    @staticmethod
    def _options(letter: str, answer: str, distractors: list[str]) -> dict[str, str]:
        others = iter(distractors)
        return {x: (answer if x == letter else next(others)) for x in LETTERS}

    def _split_diseases(self, finding_key: str, split: str) -> list[str]:
        return [d for d in self.linked[finding_key] if self.split_of.get(d) == split]

    def _next_answer(self, finding_key: str, split: str, pools: dict, rng: random.Random) -> str | None:
        """The finding's ``split`` diseases in a shuffled cycle (each once before any repeats); None if it has none."""
        candidates = self._split_diseases(finding_key, split)
        if not candidates:
            return None
        key = f"{finding_key}:{split}"
        if not pools.get(key):
            pools[key] = rng.sample(candidates, len(candidates))
        return pools[key].pop()

    def _condition_distractors(self, finding: Finding, split: str, rng: random.Random) -> list[str]:
        """3 ``split`` diseases not linked to the finding: preferably linked to another finding of the same image
        family, else to any other finding, else any disease of the split; distinct names."""
        excluded = set(self.linked[finding.key])
        pool = set(self.disease_split[split]) - excluded
        same = sorted({d for f in FINDINGS if f.modality == finding.modality for d in self.linked[f.key]} & pool)
        other = sorted(pool - set(same))
        picked: list[str] = []
        names = set()
        for group in (same, other):
            for d in rng.sample(group, len(group)):
                name = self.snapshot.diseases[d].name
                if len(picked) < len(LETTERS) - 1 and name not in names:
                    picked.append(d)
                    names.add(name)
        if len(picked) < len(LETTERS) - 1:
            raise ValueError(f"too few {split} diseases for distractors of {finding.key}")
        rng.shuffle(picked)
        return picked

    # ---- CDIR corpus ----

    def corpus_rows(self, cases: list[CaseResult]) -> Iterator[dict]:
        """Image-caption pairs of similar cases for test-time image re-retrieval: one caption per image naming every
        finding, its HPO term and its region."""
        for i, case in enumerate(cases):
            yield {
                "id": f"cdir-{i:06d}",
                "image": case.image,
                "caption": case_caption(case.spec.modality, case.lesions),
                "modality": case.spec.modality,
                "findings": case.lesions,
                "kb_doc_ids": [f"term:{les['hpo_id']}" for les in case.lesions],
            }


def case_caption(modality_key: str, lesions: list[dict]) -> str:
    """An image's caption as the CDIR corpus writes it: every lesion (as :meth:`Lesion.describe` gives it, e.g. a
    task's ``metadata["lesions"]``) with its size, HPO term, look and region."""
    label = MODALITIES[modality_key].label
    parts = [f"a {les['stratum']} {les['hpo_name'][0].lower() + les['hpo_name'][1:]} ({les['hpo_id']}), "
             f"{FINDINGS_BY_KEY[les['finding']].looks}, in the {les['region']} of the image" for les in lesions]
    return f"{label[0].upper() + label[1:]} showing " + "; ".join(parts) + "."


def render_and_save(spec: CaseSpec, out_dir: str | Path, relpath: str, hpo_ids: dict[str, str]) -> CaseResult:
    """Render a case, save it as PNG under ``out_dir/relpath`` and describe its lesions (boxes, regions, HPO ids)."""
    rendered = render_case(spec)
    path = Path(out_dir) / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rendered.image).save(path, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    lesions = [les.describe(hpo_ids[les.finding.key]) for les in rendered.lesions]
    return CaseResult(spec, relpath, lesions)


PNG_COMPRESS_LEVEL = 3
