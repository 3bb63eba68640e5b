"""One painter per finding: a lesion drawn into a background with a soft mask and its exact footprint."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.imaging.drawing import Background, _blob, _ellipse_distance, _polyline_distance, _segment_distance, _soft


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
