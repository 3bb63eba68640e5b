"""The torch side of the seeing policy's architecture (tasks/vision_arch.py): the convolutional patch embedding, the
transformers class that uses it (which the learner trains and the build writes), and the class that builds or loads
a multimodal config."""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

from tasks.vision_arch import patch_embedding


class ConvPatchEmbedding(nn.Module):
    """A drop-in for Qwen2.5-VL's patch embedding: takes what it takes (the processor's flattened patches [N, channels
    x temporal_patch_size x patch_size^2]) and returns [N, hidden_size]. It convolves inside each patch and max-pools
    over it, so a lesion's edge is read alike wherever it lies in the patch, where Qwen's one linear map weighs every
    pixel position apart. The processor repeats an image over its time steps; the first is the image."""

    def __init__(self, vision_config):
        super().__init__()
        self.in_channels = vision_config.in_channels
        self.patch_size, self.temporal_patch_size = vision_config.patch_size, vision_config.temporal_patch_size
        self.net = nn.Sequential(nn.Conv2d(self.in_channels, 64, 3, padding=1), nn.GELU(),
                                 nn.Conv2d(64, 128, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
                                 nn.Conv2d(128, 256, 3, padding=1), nn.GELU(), nn.AdaptiveMaxPool2d(1), nn.Flatten())
        # `proj`, as Qwen's patch embedding names its map: vLLM's tower reads its dtype and device off proj.weight
        self.proj = nn.Linear(256, vision_config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        frames = patches.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(self.net(frames[:, :, 0].to(self.proj.weight.dtype)))


class MedrayQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """transformers' Qwen2.5-VL with the patch embedding its vision_config names; an unknown one is a ValueError
    naming the field and the model directory."""

    def __init__(self, config):
        super().__init__(config)
        if patch_embedding(config) == "conv":
            self.model.visual.patch_embed = ConvPatchEmbedding(config.vision_config)

    @classmethod
    def from_config(cls, config, **kwargs):
        """A model of `config` (random weights), as transformers' auto classes build one."""
        return cls._from_config(config, **kwargs)


def image_text_class(config):
    """The transformers class that loads (`from_pretrained`) a multimodal `config`, or builds it (`from_config`):
    medray's Qwen2.5-VL where its vision_config names a patch embedding other than Qwen's, else
    `AutoModelForImageTextToText`."""
    if config.model_type == "qwen2_5_vl" and patch_embedding(config) != "linear":
        return MedrayQwen2_5_VLForConditionalGeneration
    return AutoModelForImageTextToText


def new_qwen2_5_vl(config):
    """A random-initialised Qwen2.5-VL of `config`: medray's class where its vision_config names a patch embedding
    other than Qwen's, else transformers' own. Built by the constructor: `from_config` would rewrite the config
    saved with it, and a linear build would no longer write the files it wrote before."""
    linear = patch_embedding(config) == "linear"
    return (Qwen2_5_VLForConditionalGeneration if linear else MedrayQwen2_5_VLForConditionalGeneration)(config)
