"""The model-backed image tools (segment: SAM / MedSAM or SAM 2 / MedSAM2; super_resolve: Swin2SR) on an
imaging-world image, as a policy and a user see them: a full-image boolean mask whose reported area and box are the
mask's, a box outside the image that the policy reads as an error, super-resolved crops of exactly twice the crop's
size, the same answers from the same weights loaded through `path=` (the real-weights route, SAM 2 directories
included), and both tools served by tool actors."""
import json

import numpy as np
import pytest
from PIL import Image

from actors.episode import Observation
from actors.gym import MedicalGym, ToolEnvironment, ToolsConfig, make_tool_environment
from actors.tools import ToolCall, ToolContext, make_tool
from tasks.imaging import CaseSpec, LesionSpec, render_case


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A chest X-ray with a large nodule, saved as the task's image, and the nodule's gold box."""
    rendered = render_case(CaseSpec(0, "train", 0, "chest_xray", (LesionSpec("nodule", "large"),)))
    path = tmp_path_factory.mktemp("model_tools") / "case.png"
    Image.fromarray(rendered.image).save(path)
    return {"path": str(path), "pixels": rendered.image, "box": rendered.lesions[0].box,
            "task": {"id": "case-0", "images": [str(path)],
                     "messages": [{"role": "user", "content": "What finding is present?"}]}}


@pytest.fixture(scope="module")
def segment():
    return make_tool("segment", device="cpu")


@pytest.fixture(scope="module")
def super_resolve():
    return make_tool("super_resolve", device="cpu")


def run(tool, case, *arguments: dict):
    context = ToolContext((case["path"],))
    return tool.run_batch([ToolCall(tool.validate(args, context), context) for args in arguments])


def resaved(model_class, processor_class, source, target):
    """The model and processor of `source`, loaded and saved again as a user's local weights directory would be."""
    model_class.from_pretrained(source).save_pretrained(target)
    processor_class.from_pretrained(source).save_pretrained(target)
    return str(target)


def bounding_box(mask: np.ndarray) -> list[int]:
    ys, xs = np.nonzero(mask)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


def test_segment_mask_is_the_image_shape_and_its_measurements_are_the_mask(segment, case):
    x0, y0, x1, y1 = case["box"]
    boxes = [case["box"], [0, 0, 224, 224], [x0 - 20, y0 - 20, x1 + 20, y1 + 20]]
    results = run(segment, case, *({"box": b} for b in boxes))
    masks = [r.masks[0] for r in results]
    for r, mask, box in zip(results, masks, boxes):
        assert r.error is None and mask.shape == case["pixels"].shape and mask.dtype == bool
        assert r.measurements["area_px"] == mask.sum()
        assert r.boxes == [bounding_box(mask) if mask.any() else box]
        assert f"{int(mask.sum())} px" in r.text or "nothing segmented" in r.text
    assert not np.array_equal(masks[0], masks[1]), "the box prompt must change the mask"
    # one forward for the batch gives each call what it gets alone
    alone = run(segment, case, {"box": boxes[1]})[0].masks[0]
    assert (alone == masks[1]).mean() > 0.999


def test_segment_box_outside_the_image_is_an_observation_the_policy_reads(case):
    env = ToolEnvironment({"segment": [None]}, ["segment"])  # planning checks the call before any actor sees it
    action = json.dumps({"name": "segment", "arguments": {"box": [400, 400, 460, 460]}})
    observation = env.plan(case["task"], [], action)
    assert isinstance(observation, Observation) and not observation.done
    assert "lies outside image 0 (448 x 448 px)" in observation.text
    missing = env.plan(case["task"], [], json.dumps({"name": "segment", "arguments": {}}))
    assert isinstance(missing, Observation) and "box: Field required" in missing.text


def published_layout(path) -> None:
    """As transformers 4 saved the Hub's SAM directories (wanglab/medsam-vit-base, facebook/sam2.1-hiera-*): the image
    processor's settings in preprocessor_config.json (a video processor's in video_preprocessor_config.json), the
    processor's own, if any (SAM 2's), in a short processor_config.json, not the one file that transformers 5 writes."""
    settings = json.loads((path / "processor_config.json").read_text())
    (path / "processor_config.json").unlink()
    processor_class = settings.pop("processor_class")
    (path / "preprocessor_config.json").write_text(json.dumps({**settings.pop("image_processor"),
                                                               "processor_class": processor_class}))
    if "video_processor" in settings:
        (path / "video_preprocessor_config.json").write_text(json.dumps(settings.pop("video_processor")))
    if settings:
        (path / "processor_config.json").write_text(json.dumps({**settings, "processor_class": processor_class}))


def test_segment_loads_the_same_weights_from_a_local_directory(segment, case, tmp_path):
    from transformers import SamModel, SamProcessor

    path = resaved(SamModel, SamProcessor, segment.model.model_dir, tmp_path / "medsam")
    published_layout(tmp_path / "medsam")
    loaded = make_tool("segment", path=path, device="cpu")
    a, b = (run(tool, case, {"box": case["box"]})[0] for tool in (segment, loaded))
    assert np.array_equal(a.masks[0], b.masks[0]) and a.measurements == b.measurements


def tiny_sam2_parts(side: int = 128, width: int = 32) -> dict:
    """SAM 2's architecture at toy size: a 4-stage Hiera of 5 blocks, 16..128 wide, at `side` px; `width`-wide FPN,
    prompt encoder and mask decoder."""
    return dict(
        vision_config=dict(
            backbone_config=dict(image_size=[side, side], hidden_size=16, blocks_per_stage=[1, 1, 2, 1],
                                 embed_dim_per_stage=[16, 32, 64, 128], num_attention_heads_per_stage=[1, 1, 2, 2],
                                 window_size_per_stage=[8, 4, 4, 4], global_attention_blocks=[3]),
            backbone_channel_list=[128, 64, 32, 16], fpn_hidden_size=width,
            backbone_feature_sizes=[[side // 4] * 2, [side // 8] * 2, [side // 16] * 2]),
        prompt_encoder_config=dict(hidden_size=width, image_size=side, patch_size=16),
        mask_decoder_config=dict(hidden_size=width, mlp_dim=2 * width, num_attention_heads=2,
                                 iou_head_hidden_dim=width))


@pytest.fixture(scope="module")
def sam2(tmp_path_factory):
    """The segment tool on a tiny random SAM 2 saved as MedSAM2 converted by transformers would be (model_type
    sam2, Sam2Processor)."""
    import torch
    from transformers import Sam2Config, Sam2ImageProcessor, Sam2Model, Sam2Processor

    path = tmp_path_factory.mktemp("sam2")
    parts = tiny_sam2_parts()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Sam2Model(Sam2Config(**parts)).save_pretrained(path)
    side = parts["prompt_encoder_config"]["image_size"]
    Sam2Processor(Sam2ImageProcessor(size={"height": side, "width": side})).save_pretrained(path)
    return make_tool("segment", path=str(path), device="cpu")


def test_segment_loads_a_sam2_directory(sam2, case):
    """MedSAM2's route: a SAM 2 directory through the same tool, the same kind of answer."""
    assert sam2.model.model_type == "sam2"
    x0, y0, x1, y1 = case["box"]
    boxes = [case["box"], [x0 - 20, y0 - 20, x1 + 20, y1 + 20]]
    encoded = []  # the batch sizes the image encoder sees
    hook = sam2.model.model.vision_encoder.register_forward_hook(lambda _, args, out: encoded.append(len(args[0])))
    try:
        results = run(sam2, case, *({"box": b} for b in boxes))
    finally:
        hook.remove()
    assert encoded == [1], "one image, one encoder pass for both calls"
    alone = [run(sam2, case, {"box": b})[0].masks[0] for b in boxes]
    for r, box, mask_alone in zip(results, boxes, alone):
        mask = r.masks[0]
        assert r.error is None and mask.shape == case["pixels"].shape and mask.dtype == bool
        assert r.measurements["area_px"] == mask.sum()
        assert r.boxes == [bounding_box(mask) if mask.any() else box]
        assert np.array_equal(mask_alone, mask), "batch mates changed the mask"
    assert np.array_equal(run(sam2, case, {"box": boxes[0]})[0].masks[0], alone[0]), "the same call, another mask"
    assert not np.array_equal(alone[0], alone[1]), "the box prompt must change the mask"


def test_segment_loads_sam2_as_facebook_publishes_it(sam2, case, tmp_path):
    """facebook/sam2.1-hiera-* are SAM 2's video model (model_type sam2_video: the image model and memory modules)
    with a Sam2VideoProcessor: the same image weights in that layout give the same masks."""
    from transformers import (Sam2VideoConfig, Sam2VideoMaskDecoderConfig, Sam2VideoModel, Sam2VideoProcessor,
                              Sam2VideoVideoProcessor)

    image = sam2.model.model
    parts = tiny_sam2_parts()
    # given as a dict, the mask decoder's config would become a prompt encoder's (Sam2VideoConfig, transformers 5.19)
    parts["mask_decoder_config"] = Sam2VideoMaskDecoderConfig(**parts["mask_decoder_config"])
    side = parts["prompt_encoder_config"]["image_size"]
    video = Sam2VideoModel(Sam2VideoConfig(**parts, image_size=side, memory_attention_num_layers=1,
                                           memory_attention_feed_forward_hidden_size=64, memory_fuser_num_layers=1))
    assert not video.load_state_dict(image.state_dict(), strict=False).unexpected_keys
    video.save_pretrained(tmp_path)
    Sam2VideoProcessor(sam2.model.processor.image_processor,
                       Sam2VideoVideoProcessor(size={"height": side, "width": side})).save_pretrained(tmp_path)
    published_layout(tmp_path)
    loaded = make_tool("segment", path=str(tmp_path), device="cpu")
    assert loaded.model.model_type == "sam2_video"
    a, b = (run(tool, case, {"box": case["box"]})[0] for tool in (sam2, loaded))
    assert np.array_equal(a.masks[0], b.masks[0]) and a.measurements == b.measurements


def test_model_paths_are_checked_and_named(segment, super_resolve, tmp_path):
    with pytest.raises(FileNotFoundError, match="option 'path'"):
        make_tool("segment", path=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="model_type 'swin2sr'; this tool loads 'sam', 'sam2' or 'sam2_video'"):
        make_tool("segment", path=str(super_resolve.model.model_dir))
    config = ToolsConfig(tools={"segment": {"options": {"path": str(segment.model.model_dir)}},
                                "super_resolve": {"num_cpus": 0.5}}, allowed=["segment", "super_resolve"])
    assert config.allowed_tools == ["segment", "super_resolve"]


def test_super_resolve_doubles_the_crop_and_depends_on_it(super_resolve, case):
    boxes = [case["box"], [10, 20, 41, 37], [0, 0, 3, 5], [2, 0, 9, 6]]  # the last two pad alike
    results = run(super_resolve, case, *({"box": b} for b in boxes))
    for r, (x0, y0, x1, y1) in zip(results, boxes):
        assert r.error is None and r.images[0].size == (2 * (x1 - x0), 2 * (y1 - y0))
        assert r.images[0].mode == "L" and r.measurements["width"] == 2 * (x1 - x0)
    for i in (1, 3):  # alone, and alone in its forward
        alone = run(super_resolve, case, {"box": boxes[i]})[0]
        assert np.array_equal(np.asarray(alone.images[0]), np.asarray(results[i].images[0])), "batch mates changed it"
    out = np.asarray(results[0].images[0], np.float32)
    small = out.reshape(out.shape[0] // 2, 2, out.shape[1] // 2, 2).mean(axis=(1, 3))
    assert small.std() > 0, "a constant image carries nothing of the crop"
    x0, y0, x1, y1 = case["box"]
    shifted = run(super_resolve, case, {"box": [x0 + 30, y0, x1 + 30, y1]})[0]
    assert not np.array_equal(out, np.asarray(shifted.images[0], np.float32)), "the output must depend on the crop"


def test_super_resolve_loads_the_same_weights_from_a_local_directory(super_resolve, case, tmp_path):
    from transformers import Swin2SRForImageSuperResolution, Swin2SRImageProcessor

    path = resaved(Swin2SRForImageSuperResolution, Swin2SRImageProcessor, super_resolve.model.model_dir,
                   tmp_path / "swin2sr")
    loaded = make_tool("super_resolve", path=path, device="cpu")
    a, b = (run(tool, case, {"box": case["box"]})[0] for tool in (super_resolve, loaded))
    assert np.array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))


def test_tool_actors_serve_segment_and_super_resolve_in_a_gym_episode(ray_session, segment, case):
    env = make_tool_environment({"tools": {"segment": {"options": {"path": str(segment.model.model_dir)}},
                                           "super_resolve": {}}})
    try:
        gym = MedicalGym(env)
        gym.reset(case["task"])
        call = {"name": "segment", "arguments": {"box": case["box"]}}
        observation, done, info = gym.step(f"<tool_call>{json.dumps(call)}</tool_call>")
        expected = run(segment, case, {"box": case["box"]})[0]
        assert not done and info["record"]["tool"] == "segment" and observation.text == expected.text
        assert info["record"]["measurements"] == expected.measurements
        assert np.array_equal(info["result"].masks[0], expected.masks[0])  # the Gym caller gets the mask itself
        call = {"name": "super_resolve", "arguments": {"box": [100, 100, 150, 140]}}
        observation, done, info = gym.step(f"<tool_call>{json.dumps(call)}</tool_call>")
        assert not done and info["record"]["error"] is None and observation.images[0].size == (100, 80)
    finally:
        env.shutdown()
