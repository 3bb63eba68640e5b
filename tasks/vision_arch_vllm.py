"""The seeing policy as vLLM serves it (tasks/vision_arch.py): vLLM's Qwen2.5-VL with the patch embedding its config
names. The module is transformers' (tasks/vision_arch_hf.py) under the same name, `visual.patch_embed`, so vLLM's own
`load_weights` loads it from a checkpoint and from a weight sync by the transformers parameter names. vLLM imports
this module by the name `tasks.vision_arch.register_vllm` registers."""
from __future__ import annotations

from vllm.model_executor.models.qwen2_5_vl import (Qwen2_5_VLDummyInputsBuilder, Qwen2_5_VLForConditionalGeneration,
                                                   Qwen2_5_VLMultiModalProcessor, Qwen2_5_VLProcessingInfo)
from vllm.model_executor.models.utils import StageMissingLayer
from vllm.multimodal import MULTIMODAL_REGISTRY

from tasks.vision_arch import patch_embedding
from tasks.vision_arch_hf import ConvPatchEmbedding


# vLLM looks a model's multimodal processor up on the model's class (in 0.32 an attribute, which a subclass would
# inherit from Qwen's); registered on this class itself, so it holds Qwen2.5-VL's whatever the lookup
@MULTIMODAL_REGISTRY.register_processor(Qwen2_5_VLMultiModalProcessor, info=Qwen2_5_VLProcessingInfo,
                                        dummy_inputs=Qwen2_5_VLDummyInputsBuilder)
class MedrayQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with the patch embedding its vision_config names; an unknown one is a ValueError naming the
    field and the model directory."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        kind = patch_embedding(self.config, vllm_config.model_config.model)
        # an engine allowed no images holds a placeholder for the tower that it never loads or runs
        if kind == "conv" and not isinstance(self.visual, StageMissingLayer):
            self.visual.patch_embed = ConvPatchEmbedding(self.config.vision_config)
