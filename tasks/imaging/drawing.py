"""Drawing primitives (smooth noise, soft masks, distances) and the three modalities' backgrounds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy import ndimage

from tasks.imaging.world import BACKGROUND_RANGE, IMAGE_SIZE


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
