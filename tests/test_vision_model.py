"""The seeing policy built offline: SmolLM2's language weights in Qwen2.5-VL, a vision tower trained on the imaging
world, a build that is whole or absent."""
import dataclasses
import hashlib
import json
import math

import pytest

from tasks import model_aliases
from tasks.imaging import FINDINGS
from tasks.vision_data import NONE, token_targets, zoom_window
from tasks.vision_model import VisionRecipe

NODULE = [f.key for f in FINDINGS].index("nodule")
#: A build small enough for a test: one tower block, a few images and steps (zoom crops and LoRA alignment as the
#: default recipe has them); the real language model all the same.
TINY = VisionRecipe(depth=1, hidden_size=64, num_heads=1, pretrain_images=8, pretrain_steps=2, pretrain_batch=4,
                    align_steps=1, align_batch=2, align_lora_rank=2, probe_questions=4)


def test_each_token_is_labelled_with_the_lesion_covering_most_of_it():
    # 448 px in 4 x 4 tokens of 112 px; the box covers 40 x 30 px of token 1 and 10 x 30 px (1/6) of token 0
    lesion = {"finding": "nodule", "box": [102, 10, 152, 40]}
    plain = token_targets([lesion], 4, False, False)
    assert plain[1] == NODULE and plain.count(NONE) == 15
    assert token_targets([lesion], 4, True, False)[2] == NODULE    # mirrored left-right: x 296-346, token 2
    assert token_targets([lesion], 4, False, True)[13] == NODULE   # mirrored top-bottom: y 408-438, row 3
    assert token_targets([lesion], 4, True, True)[14] == NODULE
    # two lesions on one token: the one overlapping it more names it
    other = {"finding": "cyst", "box": [0, 0, 60, 60]}
    assert token_targets([lesion, other], 4, False, False)[:2] == [[f.key for f in FINDINGS].index("cyst"), NODULE]


def test_the_tower_benchmark_scores_a_lesion_among_its_modality_s_findings_alone():
    import torch
    from benchmarks.bench_vision_tower import among_modality

    chest = [f.key for f in FINDINGS].index("cyst")
    bone = [f.key for f in FINDINGS].index("fracture")
    logits = torch.zeros(2, NONE + 1)
    logits[:, bone], logits[:, chest], logits[:, NONE] = 3.0, 2.0, 4.0  # a bone finding first, then "none"
    # a chest lesion's token: the chest finding is the best of its modality; a bone lesion's keeps the bone finding
    assert among_modality(logits, torch.tensor([chest, bone])).tolist() == [chest, bone]


@pytest.mark.parametrize("patch,merge", [(14, 2), (7, 4)])
def test_a_cell_cut_out_reaches_the_tower_as_its_patches_in_the_whole_image(patch, merge):
    import numpy as np
    import torch
    from PIL import Image
    from benchmarks.bench_vision_tower import cell_patches
    from tasks.chat_format import image_processor

    processor = image_processor(patch, merge)
    image = np.random.default_rng(0).integers(0, 256, (84, 84, 3), dtype=np.uint8)
    whole = processor(images=[Image.fromarray(image)], return_tensors="pt")["pixel_values"]
    per_cell = merge * merge
    for row, col in [(0, 0), (1, 2), (2, 1)]:
        crop = torch.tensor(image[28 * row:28 * row + 28, 28 * col:28 * col + 28] / 255.0, dtype=torch.float32)
        patches = cell_patches(crop.permute(2, 0, 1)[None], processor, merge)
        k = 3 * row + col  # merged groups come in raster order, each group's patches together
        assert torch.allclose(patches, whole[k * per_cell:(k + 1) * per_cell], atol=1e-5)


def test_a_tower_with_convolutional_patches_takes_cells_as_the_linear_one_and_learns_its_stem():
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessor
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from benchmarks.bench_vision_tower import cell_tower
    from tasks.vision_arch_hf import ConvPatchEmbedding

    config = Qwen2_5_VLConfig(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 out_hidden_size=16, patch_size=14, spatial_merge_size=2)).vision_config
    visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    crops = torch.rand(3, 3, 28, 28) - 0.5
    linear = cell_tower(visual, Qwen2VLImageProcessor())(crops)
    visual.patch_embed = ConvPatchEmbedding(config)
    conv = cell_tower(visual, Qwen2VLImageProcessor())(crops)
    assert linear.shape == conv.shape == (3, len(FINDINGS))
    conv.sum().backward()  # the stem learns with the tower
    assert visual.patch_embed.net[0].weight.grad.abs().sum() > 0


def test_a_recipe_names_a_patch_embedding_medray_builds_and_the_shipped_alias_keeps_its_name():
    with pytest.raises(ValueError, match=r"VisionRecipe.patch_embedding 'cnn' is not a patch embedding medray "
                                         r"builds: one of \['linear', 'conv'\]"):
        VisionRecipe(patch_embedding="cnn")
    assert "patch_embedding" not in VisionRecipe().vision_config(64)  # a linear model's config is transformers'
    assert VisionRecipe(patch_embedding="conv").vision_config(64)["patch_embedding"] == "conv"
    linear, conv = (model_aliases.VisionAlias(base="smollm2-135m-instruct", recipe=VisionRecipe(patch_embedding=p),
                                              licence="test", description="test") for p in ("linear", "conv"))
    assert linear.version != conv.version
    # the default stays out of the digest, which is then the one of the fields before it: old builds keep their names
    fields = dataclasses.asdict(VisionRecipe())
    del fields["patch_embedding"]
    assert linear.version.endswith(hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8])


def test_build_model_takes_recipe_fields_as_a_variant_built_apart_and_refuses_fields_no_recipe_has(capsys):
    shipped = model_aliases.alias_dir("smollm2-135m-vision")
    variant = model_aliases.alias_dir("smollm2-135m-vision",
                                      model_aliases.parse_recipe_fields(["patch_embedding=conv", "pretrain_lr=6e-4"]))
    assert variant != shipped and variant.name.startswith("smollm2-135m-vision-")
    assert model_aliases.alias_spec("smollm2-135m-vision", {"pretrain_steps": 10}).recipe.pretrain_steps == 10
    for argv, message in [(["smollm2-135m-vision", "pretrain_steps=many"], "pretrain_steps: 'many' is not a int"),
                          (["smollm2-135m-vision", "towers=2"], "no recipe field ['towers']"),
                          (["smollm2-135m-vision", "patch_embedding=cnn"], "VisionRecipe.patch_embedding 'cnn'"),
                          (["smollm2-135m-instruct", "depth=2"], "has no recipe to change")]:
        assert model_aliases.main(argv) == 2  # refused before anything is built
        assert message in capsys.readouterr().err


def register_tiny_vision(monkeypatch, tmp_path, base_dir, recipe=TINY):
    """The alias `tiny-vision`: a `recipe` build on top of `base_dir` as the text alias, built under `tmp_path`."""
    monkeypatch.setitem(model_aliases.ALIASES, "tiny-vision",
                        model_aliases.VisionAlias(base="smollm2-135m-instruct", recipe=recipe, licence="test",
                                                  description="test"))
    monkeypatch.setattr(model_aliases, "alias_dir", lambda alias, recipe_fields=None:
                        base_dir if alias == "smollm2-135m-instruct" else tmp_path / "models" / alias)


def test_a_zoom_in_crop_holds_its_lesion_and_its_tokens_follow_it():
    import random
    lesion = {"finding": "nodule", "box": [102, 10, 152, 40]}
    # a 112 px crop at x 96: the box is x 6-56, y 10-40 in it, on tokens of 28 px; a quarter of it is 375 px^2
    labels = token_targets([lesion], 4, False, False, window=(96, 0, 112))
    assert labels[:2] == [NODULE, NODULE] and labels.count(NONE) == 14  # 396 and 504 px^2; the row below 264, 336
    rng = random.Random(0)
    for _ in range(200):
        x, y, size = zoom_window([lesion], rng)
        assert 112 <= size <= 224 and 0 <= x <= 102 and 152 <= x + size <= 448 and 0 <= y and y + size <= 448
        assert y <= 10 and 40 <= y + size


@pytest.mark.slow
def test_the_wrapped_language_model_reads_text_exactly_as_smollm2(real_model_path):
    import torch
    from transformers import AutoModelForCausalLM
    from tasks.chat_format import VISION_TOKENS
    from tasks.vision_model import wrap_language_model

    model, tokenizer = wrap_language_model(real_model_path, TINY)
    text = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32)
    ids = tokenizer("A child with short stature, seizures and a heart murmur", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = text(ids).logits
        got = model.eval()(input_ids=ids).logits[..., :expected.shape[-1]]
    # the same float32 weights through Qwen2.5-VL's multimodal RoPE: rounding differs by ~1e-6 of logits ~30
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert all(len(tokenizer(t, add_special_tokens=False).input_ids) == 1 for t in VISION_TOKENS)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_a_finer_patch_grid_still_gives_one_image_token_per_cell(real_model_path, tmp_path):
    import torch
    from PIL import Image
    from transformers import AutoProcessor
    from tasks.chat_format import save_processor
    from tasks.vision_data import RenderedPool
    from tasks.vision_model import encode, wrap_language_model

    with pytest.raises(ValueError, match="patch_size 7 x merge_size 2 must be 28 px"):
        VisionRecipe(patch_size=7)
    recipe = dataclasses.replace(TINY, patch_size=7, merge_size=4)
    model, tokenizer = wrap_language_model(real_model_path, recipe)
    save_processor(tokenizer, tmp_path, recipe.patch_size, recipe.merge_size)
    processor = AutoProcessor.from_pretrained(tmp_path)
    pool = RenderedPool(images=[Image.new("RGB", (448, 448), "white")])
    rows = [(0, [{"role": "user", "content": "What finding is present in the center of the image?"}], "", "large")]
    inputs = encode(processor, model, rows, pool, with_answer=False)
    assert inputs["image_grid_thw"].tolist() == [[1, 12, 12]]  # 84 px in patches of 7
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 9  # merged 4 x 4: one a cell
    with torch.no_grad():
        tokens = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        assert tokens.shape[0] == 9
        assert model.eval()(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.parametrize("patch_embedding", ["linear", "conv"])
def test_a_built_seeing_policy_takes_an_image_and_records_what_the_build_measured(real_model_path, tmp_path,
                                                                               monkeypatch, patch_embedding):
    import torch
    from PIL import Image
    from transformers import AutoProcessor
    from learners.batches import load_causal_lm
    from tasks.catalog import load_tasks
    from tasks.vision_arch import ARCHITECTURE

    register_tiny_vision(monkeypatch, tmp_path, real_model_path,
                         dataclasses.replace(TINY, patch_embedding=patch_embedding))
    built = model_aliases.ensure_alias_model("tiny-vision")
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["source"]["alias"] == "smollm2-135m-instruct" and manifest["source"]["recipe"]["depth"] == 1
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    if patch_embedding == "conv":  # medray's class, named where vLLM looks (tasks/vision_arch.py)
        assert config["architectures"] == [ARCHITECTURE] and config["vision_config"]["patch_embedding"] == "conv"
    else:  # as transformers writes it
        assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
        assert "patch_embedding" not in config["vision_config"]
    probe = manifest["measured"]["probe"]
    assert probe["data"] == "imaging:finding_mcq_test"
    assert sum(v["n"] for k, v in probe.items() if k != "data") == TINY.probe_questions
    assert manifest["files"]["model.safetensors"] == model_aliases.sha256_file(built / "model.safetensors")
    from safetensors import safe_open
    with safe_open(built / "model.safetensors", "pt") as weights:  # the adapters are merged, not saved beside
        assert not [k for k in weights.keys() if "lora" in k]

    task = load_tasks("imaging:finding_mcq_test")[0]
    processor = AutoProcessor.from_pretrained(built)
    model = load_causal_lm(str(built), torch.float32).eval()
    assert type(model).__name__ == config["architectures"][0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    with Image.open(task["images"][0]) as image:
        inputs = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                           images=[image.convert("RGB")], return_tensors="pt")
    pads = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert pads == math.prod(inputs["image_grid_thw"][0].tolist()) // 4 == 9  # 84 px: 6 x 6 patches, 2 x 2 merged
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_an_interrupted_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    from tasks import vision_model

    base = tmp_path / "base"
    base.mkdir()
    (base / "manifest.json").write_text("{}")  # a finished text alias, as far as the build can tell
    register_tiny_vision(monkeypatch, tmp_path, base)

    def half_then_interrupted(text_dir, out, recipe, show_progress=True):
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(vision_model, "build_vision_model", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        model_aliases.ensure_alias_model("tiny-vision")
    assert not (tmp_path / "models" / "tiny-vision").exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_a_reply_generated_in_a_left_padded_batch_is_the_one_generated_alone(real_model_path):
    import tempfile
    from pathlib import Path
    import torch
    from PIL import Image
    from transformers import AutoProcessor
    from tasks.chat_format import save_processor
    from tasks.vision_data import RenderedPool
    from tasks.vision_model import encode, wrap_language_model

    model, tokenizer = wrap_language_model(real_model_path, TINY)
    with tempfile.TemporaryDirectory() as out:
        save_processor(tokenizer, Path(out))
        processor = AutoProcessor.from_pretrained(out)
    pool = RenderedPool(images=[Image.new("RGB", (448, 448), (40, 40, 40)), Image.new("RGB", (448, 448), "white")])
    rows = [(0, [{"role": "user", "content": "What finding is present in the upper left of the image?"}], "", "large"),
            (1, [{"role": "user", "content": "Which finding? Answer with its name."}], "", "small")]
    model.eval()
    with torch.no_grad():
        together = encode(processor, model, rows, pool, with_answer=False)
        assert together["attention_mask"][1, 0] == 0 and together["attention_mask"][:, -1].all()  # padded on the left
        both = model.generate(**together, max_new_tokens=6, do_sample=False)[:, together["input_ids"].shape[1]:]
        for b, row in enumerate(rows):
            alone = encode(processor, model, [row], pool, with_answer=False)
            assert both[b].tolist() == model.generate(**alone, max_new_tokens=6, do_sample=False)[
                0, alone["input_ids"].shape[1]:].tolist()
