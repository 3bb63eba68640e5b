"""Single-image super-resolution with Swin2SR (Conde et al. 2022, "Swin2SR: SwinV2 Transformer for Compressed Image
Super-Resolution and Restoration", ECCV Workshops): SwinV2 blocks over the low-resolution image, a pixel-shuffle
upsampler to `upscale` times its size.

* `load_super_resolver(path)`: `path` is a local Hugging Face Swin2SR directory (``config.json`` with ``model_type:
  swin2sr``, weights, ``preprocessor_config.json``), e.g. caidas/swin2SR-classical-sr-x2-64.
* `load_super_resolver(None)`: a tiny x2 Swin2SR (one 2-block stage, 16 wide) with random weights, built once
  (actors.pretrained) so the tool runs offline; its output has the right size and depends on the input, but is no
  better than the input.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from actors.pretrained import default_device, ensure_tiny_pretrained, local_model_dir


def tiny_swin2sr_config():
    """caidas/swin2SR-classical-sr-x2-64's architecture (pixel-shuffle upsampler, x2, 8 px windows) at toy size."""
    from transformers import Swin2SRConfig

    return Swin2SRConfig(embed_dim=16, depths=[2], num_heads=[2], window_size=8, upscale=2, image_size=64,
                         upsampler="pixelshuffle")


def ensure_tiny_swin2sr() -> Path:
    from transformers import Swin2SRForImageSuperResolution, Swin2SRImageProcessor

    return ensure_tiny_pretrained("swin2sr", tiny_swin2sr_config(), Swin2SRForImageSuperResolution,
                                  Swin2SRImageProcessor())


def pad_to(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 H x W x 3 mirrored on the right and bottom to height x width (Swin2SR's own processor pads so)."""
    h, w = pixels.shape[:2]
    return np.pad(pixels, ((0, height - h), (0, width - w), (0, 0)), mode="symmetric")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SuperResolver:
    """A loaded Swin2SR: uint8 crops -> uint8 images `scale` times their width and height, batched."""

    def __init__(self, model_dir: str | Path, device: str | None = None):
        from transformers import Swin2SRForImageSuperResolution, Swin2SRImageProcessor

        self.model_dir = Path(model_dir)
        self.device = default_device(device)
        self.model = Swin2SRForImageSuperResolution.from_pretrained(self.model_dir, local_files_only=True)
        self.model.eval().to(self.device)
        self.processor = Swin2SRImageProcessor.from_pretrained(self.model_dir, local_files_only=True)

    @property
    def scale(self) -> int:
        return int(self.model.config.upscale)

    def upscale(self, crops: list[np.ndarray]) -> list[np.ndarray]:
        """Each uint8 crop (H x W grey or H x W x 3) super-resolved to exactly (scale H) x (scale W), grey in, grey
        out. The model needs whole windows, so a crop is mirrored out to the next multiple of the window and its
        output cut back; crops of the same padded size share one forward. Padding crops of other sizes to a common
        one would make a crop's pixels depend on its batch, and cost the largest crop's time for each."""
        window = self.model.config.window_size
        groups: dict[tuple[int, int], list[int]] = {}
        for i, crop in enumerate(crops):
            groups.setdefault((round_up(crop.shape[0], window), round_up(crop.shape[1], window)), []).append(i)
        out: list[np.ndarray | None] = [None] * len(crops)
        for (height, width), rows in groups.items():
            for i, upscaled in zip(rows, self._forward([crops[i] for i in rows], height, width)):
                out[i] = upscaled
        return out

    def _forward(self, crops: list[np.ndarray], height: int, width: int) -> list[np.ndarray]:
        """One forward over crops mirrored out to height x width; each output cut back to scale x its crop."""
        import torch

        padded = [pad_to(np.stack([c] * 3, axis=2) if c.ndim == 2 else c, height, width) for c in crops]
        # channels_last: a 3-pixel-high crop is not 3 channels
        pixel_values = self.processor(images=padded, do_pad=False, input_data_format="channels_last",
                                      return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = self.model(pixel_values=pixel_values.to(self.device)).reconstruction
        out = (out.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        s = self.scale
        return [restore_channels(o[:s * c.shape[0], :s * c.shape[1]], c.ndim) for o, c in zip(out, crops)]


def restore_channels(rgb: np.ndarray, ndim: int) -> np.ndarray:
    """The model's RGB output as the input was: the channel mean for a grey crop."""
    return rgb if ndim == 3 else np.rint(rgb.mean(axis=2)).astype(np.uint8)


def load_super_resolver(path: str | None = None, device: str | None = None) -> SuperResolver:
    """Swin2SR from a local directory, or (path None) the tiny offline x2 one, built and cached once."""
    return SuperResolver(local_model_dir(path, "swin2sr", ensure_tiny_swin2sr), device=device)
