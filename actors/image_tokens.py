"""Images as tokens for a multimodal policy, by model family: which tokens stand for an image, and how many.

A family is keyed by the Hugging Face config's `model_type`. Each entry of FAMILIES is the layout its processor and
vLLM agree on: an image is `<start><pad>...<pad><end>`, one pad per merged patch of the grid the image processor
makes of it. Qwen2-VL and Qwen2.5-VL share one layout. A family with another layout (InternVL's `<img><IMG_CONTEXT>
...</img>` with a fixed count per tile, its own vLLM processor path and forward arguments) is a new entry here, and
a checkpoint of a family not listed is refused at load with the families that are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tasks.chat_format import expand_image_pads


@dataclass(frozen=True)
class ImageLayout:
    """The tokens of one family's images (as its tokenizer spells them) and the processor output with each image's
    patch grid (t, h, w)."""
    pad: str                  # repeated once per merged patch
    start: str
    end: str
    media_only: tuple[str, ...]  # other tokens only media may bring (a video's pad)
    grid_key: str

    @property
    def placeholder(self) -> str:
        """One image in a prompt's text, as the chat template writes it (one pad: vLLM's form)."""
        return self.start + self.pad + self.end


QWEN2_VL = ImageLayout(pad="<|image_pad|>", start="<|vision_start|>", end="<|vision_end|>",
                       media_only=("<|video_pad|>",), grid_key="image_grid_thw")

#: model_type (config.json) -> the image layout of that family.
FAMILIES: dict[str, ImageLayout] = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": QWEN2_VL}


def image_layout(model_path: str) -> ImageLayout | None:
    """The image layout of the checkpoint at `model_path`; None for a text-only model (no `vision_config`). A
    multimodal model of a family not in FAMILIES: a ValueError naming the checkpoint, its model_type and the
    supported families."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path)
    if not hasattr(config, "vision_config"):
        return None
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"{model_path}: multimodal model_type {model_type!r} has no image-token layout in medray; "
                         f"supported families (model_type): {sorted(FAMILIES)}. A new family is an entry in "
                         "actors/image_tokens.py FAMILIES (its image tokens, and the vLLM and forward paths it needs)")
    return FAMILIES[model_type]


class ImageTokens:
    """Images as tokens for a policy of a registered family, with the model's own processor (`AutoProcessor`).

    An image is `start pad...pad end` with t*h*w / merge^2 pads, (t, h, w) being the patch grid the image processor
    makes of it. vLLM wants prompt ids with ONE pad per image (it expands them; checked: an already expanded prompt is
    expanded again, silently), while the learner's forward needs the full runs, so episodes keep full runs and
    :meth:`collapse` makes vLLM's form.
    """

    def __init__(self, processor, layout: ImageLayout):
        self.layout, self.placeholder = layout, layout.placeholder
        self.image_processor = processor.image_processor
        self.merge = self.image_processor.merge_size
        tok = processor.tokenizer
        self.pad_id, self.start_id, self.end_id = (tok.convert_tokens_to_ids(t)
                                                   for t in (layout.pad, layout.start, layout.end))
        # Tokens only images may bring: a policy that writes one ends its turn there (Episode.generated), since a
        # stray pad in the ids would make the learner's forward look for image features that do not exist.
        self.special_ids = [self.pad_id, self.start_id, self.end_id] + \
            [tok.convert_tokens_to_ids(t) for t in layout.media_only]

    @classmethod
    def for_model(cls, model_path: str) -> ImageTokens | None:
        """The model's image tokens, or None for a text-only model; an unsupported family: `image_layout`'s error."""
        from transformers import AutoProcessor
        layout = image_layout(model_path)
        return None if layout is None else cls(AutoProcessor.from_pretrained(model_path), layout)

    def grid(self, image: np.ndarray) -> tuple[int, int, int]:
        return tuple(self.image_processor(images=[image], return_tensors="pt")[self.layout.grid_key][0].tolist())

    def expand(self, ids: list[int], grids: list[tuple[int, int, int]]) -> list[int]:
        """Each single pad of `ids` (one per image, in order) becomes its image's full run of pads."""
        return expand_image_pads(ids, self.pad_id, [math.prod(g) // self.merge ** 2 for g in grids])

    def collapse(self, ids: list[int]) -> list[int]:
        """Each run of pads becomes one pad (vLLM's prompt form)."""
        return [t for i, t in enumerate(ids) if t != self.pad_id or i == 0 or ids[i - 1] != self.pad_id]

    def cut(self, ids: list[int], limit: int) -> int:
        """The longest prefix length <= limit that does not split an image: a cut inside one drops it whole."""
        cut, inside = min(limit, len(ids)), None
        for i, t in enumerate(ids[:cut]):
            inside = i if t == self.start_id else None if t == self.end_id else inside
        return cut if inside is None else inside
