"""The chat and image conventions every multimodal policy medray builds shares: ChatML with Qwen's vision tokens, and
Qwen2.5-VL's processor at the imaging world's input size."""
from __future__ import annotations

from pathlib import Path

from tasks.imaging import INPUT_SIZE

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen's ChatML template, kept short: system/user/assistant turns and the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Every image, a whole 448-px scan or a small zoom-in crop, is resized to about INPUT_SIZE^2 pixels (sides multiples
# of patch 14 x merge 2 = 28): 84 x 84 -> 6 x 6 patches -> 9 tokens after the 2 x 2 merge, one per cell of the 3 x 3
# grid questions name. min = max, so a crop is magnified to the model's input size: that is what makes zooming in
# worth a tool call.
IMAGE_PIXELS = INPUT_SIZE * INPUT_SIZE


def image_processor(patch_size: int = 14, merge_size: int = 2):
    """Qwen2.5-VL's image processor for a tower of `patch_size` and `merge_size`, every image at INPUT_SIZE^2 pixels."""
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(size={"shortest_edge": IMAGE_PIXELS, "longest_edge": IMAGE_PIXELS},
                                 patch_size=patch_size, merge_size=merge_size)


def save_processor(tokenizer, out_dir: Path, patch_size: int = 14, merge_size: int = 2) -> None:
    """Qwen2.5-VL's processor (image + video processors, the project tokenizer, its chat template), so vLLM and
    `AutoProcessor` turn images into `<|image_pad|>` runs and pixel patches as the real model's would; `patch_size`
    and `merge_size` are the vision tower's (a merged token covers patch_size x merge_size pixels a side)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor
    size = {"shortest_edge": IMAGE_PIXELS, "longest_edge": IMAGE_PIXELS}
    Qwen2_5_VLProcessor(image_processor=image_processor(patch_size, merge_size), tokenizer=tokenizer,
                        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=patch_size, merge_size=merge_size),
                        chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)


def expand_image_pads(ids: list[int], pad_id: int, runs: list[int]) -> list[int]:
    """Each single image pad of `ids` (vLLM's prompt form, one per image, in order) becomes a run of `runs[i]` pads
    (what the model's forward reads)."""
    if ids.count(pad_id) != len(runs):
        raise ValueError(f"{ids.count(pad_id)} image placeholders for {len(runs)} images")
    left = iter(runs)
    return [x for t in ids for x in ([t] if t != pad_id else [t] * next(left))]
