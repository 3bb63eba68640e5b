"""Box-prompted segmentation with the Segment Anything model (SAM, Kirillov et al. 2023, ICCV) as MedSAM (Ma et al.
2024, Nat. Commun. 15:654) uses it for medical images: the whole image through SAM's ViT encoder, a box through its
prompt encoder, one mask from its mask decoder (``multimask_output=False``), logits > 0 upsampled to the image.

SAM 2 (Ravi et al. 2024) and MedSAM2 (Zhu et al. 2025, SAM 2.1 Hiera-T fine-tuned on medical images at 512 px) run
the same way on one image: a Hiera encoder's multi-scale features, the box, one mask. A converted MedSAM2 directory
must declare its 512 px (config and processor), not the 1024 of the SAM 2.1 config it is converted with.

* `load_segmenter(path)`: `path` is a local Hugging Face directory (``config.json``, weights, the processor's
  settings) of either architecture, dispatched on its ``model_type``: ``sam`` (e.g. MedSAM as published in
  wanglab/medsam-vit-base, facebook/sam-vit-*), ``sam2`` (e.g. MedSAM2's checkpoint converted with transformers' SAM 2
  conversion script, models/sam2/convert_sam2_to_hf.py) or ``sam2_video`` (facebook/sam2.1-hiera-* as published).
* `load_segmenter(None)`: a tiny SAM (2-layer, 64-wide ViT at 256 px, 64-wide prompt encoder and mask decoder) with
  random weights, built once (actors.pretrained) so the tool runs offline; its masks depend on the image and the box
  but mean nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from actors.pretrained import default_device, ensure_tiny_pretrained, local_model_dir

TINY_IMAGE_SIZE = 256  # SAM's patch 16 -> a 16 x 16 embedding grid, fast on a CPU
TINY_WIDTH = 64
# a directory's model_type -> the classes that load it; sam2_video (SAM 2 as facebook/sam2.1-hiera-* are published,
# memory modules for video included) loads as the image model, whose weights it holds (transformers drops the rest)
ARCHITECTURES = {"sam": ("SamModel", "SamProcessor"), "sam2": ("Sam2Model", "Sam2Processor"),
                 "sam2_video": ("Sam2Model", "Sam2Processor")}


def tiny_sam_config():
    """SAM's architecture at toy size. The vision tower's init scale is raised from SAM's 1e-10 (its published
    weights replace it), else a random encoder outputs the same embedding for every image."""
    from transformers import SamConfig

    grid = dict(image_size=TINY_IMAGE_SIZE, patch_size=16)
    return SamConfig(
        vision_config=dict(hidden_size=TINY_WIDTH, num_hidden_layers=2, num_attention_heads=2, mlp_dim=2 * TINY_WIDTH,
                           output_channels=TINY_WIDTH, num_pos_feats=TINY_WIDTH // 2, window_size=4,
                           global_attn_indexes=[1], initializer_range=0.02, **grid),
        prompt_encoder_config=dict(hidden_size=TINY_WIDTH, **grid),
        mask_decoder_config=dict(hidden_size=TINY_WIDTH, mlp_dim=2 * TINY_WIDTH, num_attention_heads=2,
                                 iou_head_hidden_dim=TINY_WIDTH))


def tiny_sam_processor():
    from transformers import SamImageProcessor, SamProcessor

    side = {"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
    return SamProcessor(SamImageProcessor(size={"longest_edge": TINY_IMAGE_SIZE}, pad_size=side))


def ensure_tiny_sam() -> Path:
    from transformers import SamModel

    return ensure_tiny_pretrained("sam", tiny_sam_config(), SamModel, tiny_sam_processor())


def rgb_image(pixels: np.ndarray) -> Image.Image:
    """uint8 H x W or H x W x 3 -> RGB PIL image (SAM's encoder takes three channels; grey is repeated)."""
    return Image.fromarray(np.asarray(pixels)).convert("RGB")


class BoxSegmenter:
    """A loaded SAM / MedSAM or SAM 2 / MedSAM2 (the directory's ``model_type``): one boolean mask per (image, box),
    batched."""

    def __init__(self, model_dir: str | Path, device: str | None = None):
        import transformers

        self.model_dir = Path(model_dir)
        self.device = default_device(device)
        self.model_type = json.loads((self.model_dir / "config.json").read_text())["model_type"]
        model_class, processor_class = (getattr(transformers, name) for name in ARCHITECTURES[self.model_type])
        self.model = model_class.from_pretrained(self.model_dir, local_files_only=True).eval().to(self.device)
        self.processor = processor_class.from_pretrained(self.model_dir, local_files_only=True)

    def segment(self, images: list[np.ndarray], boxes: list[list[int]], keys: list | None = None) -> list[np.ndarray]:
        """Full-image boolean masks, one per (uint8 image, [x0, y0, x1, y1] box) pair, in one forward. Pairs with
        the same key (an image path) share one pass of the image encoder, the costly part: the episodes of a GRPO
        group all look at the same image."""
        import torch

        keys = list(range(len(images))) if keys is None else keys
        inputs = self.processor(images=[rgb_image(im) for im in images],
                                input_boxes=[[[float(v) for v in box]] for box in boxes], return_tensors="pt")
        first: dict = {}
        rows = [first.setdefault(key, len(first)) for key in keys]  # each pair's row among the distinct images
        distinct = [keys.index(key) for key in first]
        sam2 = self.model_type != "sam"
        with torch.inference_mode():
            embeddings = self.model.get_image_embeddings(inputs["pixel_values"][distinct].to(self.device))
            # SAM 2's embeddings are its encoder's feature levels (the mask decoder upsamples through the finer two)
            per_pair = [level[rows] for level in embeddings] if sam2 else embeddings[rows]
            out = self.model(image_embeddings=per_pair, input_boxes=inputs["input_boxes"].to(self.device),
                             multimask_output=False)
        # SAM pads its resized image to a square, whose padding post-processing crops off; SAM 2 resizes to the
        # square (its third positional parameter is the threshold)
        padded = [] if sam2 else [inputs["reshaped_input_sizes"]]
        masks = self.processor.post_process_masks(out.pred_masks.cpu(), inputs["original_sizes"], *padded)
        return [m[0, 0].numpy().astype(bool) for m in masks]


def load_segmenter(path: str | None = None, device: str | None = None) -> BoxSegmenter:
    """SAM / MedSAM or SAM 2 / MedSAM2 from a local directory, or (path None) the tiny offline SAM, built and cached
    once."""
    return BoxSegmenter(local_model_dir(path, tuple(ARCHITECTURES), ensure_tiny_sam), device=device)
