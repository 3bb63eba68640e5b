"""Images through the rollout workers: the tiny Qwen2.5-VL, prompts with images on a real vLLM engine, image
observations inside an episode, and the learner's forward agreeing with the engine on all of it."""
import hashlib
import os

import numpy as np
import pytest

from actors.environment import Environment, EpisodeRunner
from actors.episode import Episode, Observation, rgb_array
from actors.grammar import Grammar
from actors.image_tokens import ImageTokens
from tasks.tiny_models import TinyModelConfig

VL = TinyModelConfig(arch="qwen2_5_vl")
CROP = (0, 0, 60, 40)  # x0, y0, x1, y1 in the task image's full resolution


@pytest.fixture(scope="module")
def vl_model_path():
    from tasks.tiny_models import ensure_tiny_model
    return ensure_tiny_model(VL)


@pytest.fixture(scope="module")
def vision(vl_model_path):
    return ImageTokens.for_model(str(vl_model_path))


@pytest.fixture(scope="module")
def imaging_tasks():
    from learners.data import load_tasks
    return load_tasks("imaging:finding_mcq_train")[:2]


def test_images_become_pad_runs_that_collapse_for_vllm_and_are_never_cut(vision):
    full = np.zeros((448, 448, 3), np.uint8)
    crop = np.zeros((40, 60), np.uint8)
    # A 448-px scan is shown at the imaging INPUT_SIZE (84 px: 6 x 6 patches -> 9 tokens after the 2 x 2 merge, one
    # per region of the questions' 3 x 3 grid); a small crop is magnified to about the same size, which is what a
    # zoom-in is for.
    assert vision.grid(full) == (1, 6, 6)
    assert vision.grid(rgb_array(crop)) == (1, 6, 8)
    start, pad, end = vision.start_id, vision.pad_id, vision.end_id
    ids = [7, start, pad, end, 8, start, pad, end, 9]
    expanded = vision.expand(ids, [(1, 6, 6), (1, 6, 8)])
    assert expanded.count(pad) == 9 + 12 and vision.collapse(expanded) == ids
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        vision.expand(ids, [(1, 6, 6)])
    assert vision.cut(expanded, 10) == 1  # inside the first image: the whole image goes
    assert vision.cut(expanded, 13) == 13 and vision.cut(expanded, 20) == 13
    assert vision.cut(expanded, 100) == len(expanded)


def test_image_layouts_come_from_a_registry_of_model_families(vision, vl_model_path, tiny_model_path, tmp_path):
    """The family is the checkpoint's model_type: Qwen2.5-VL has its layout, a text-only model none, and a VL family
    without an entry is refused naming itself and the families there are."""
    from transformers import InternVLConfig

    from actors.image_tokens import FAMILIES, QWEN2_VL, image_layout
    assert image_layout(str(vl_model_path)) is QWEN2_VL and vision.layout is QWEN2_VL
    assert vision.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    assert image_layout(str(tiny_model_path)) is None and ImageTokens.for_model(str(tiny_model_path)) is None
    InternVLConfig().save_pretrained(tmp_path / "internvl")
    with pytest.raises(ValueError, match=r"model_type 'internvl' has no image-token layout.*\['qwen2_5_vl', "
                                         r"'qwen2_vl'\]") as refused:
        ImageTokens.for_model(str(tmp_path / "internvl"))
    assert str(tmp_path / "internvl") in str(refused.value) and sorted(FAMILIES) == ["qwen2_5_vl", "qwen2_vl"]


@pytest.mark.slow
def test_tiny_vl_build_is_deterministic(vl_model_path, tmp_path, monkeypatch):
    """A second build from scratch (tokenizer, weights, processor) is byte-identical to the cached one."""
    from tasks import tiny_models
    monkeypatch.setattr(tiny_models, "cache_dir", lambda: tmp_path)
    again = tiny_models.ensure_tiny_model(VL)
    assert again != vl_model_path
    files = sorted(p.name for p in vl_model_path.iterdir())
    assert {"processor_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert hashlib.sha256((vl_model_path / name).read_bytes()).digest() == \
            hashlib.sha256((again / name).read_bytes()).digest(), name


@pytest.mark.slow
def test_image_rollouts_train_and_stay_faithful_to_the_learner(ray_session, vl_model_path, vision, imaging_tasks):
    """A RolloutWorker samples from prompts with images; GRPO trains the VL policy on them; after the sync the
    engine's log-probabilities of the image sequences equal the learner's forward (1e-4), and before it they don't."""
    import ray

    from actors.rollout_worker import RolloutWorker
    from cluster.placement import place
    from learners.config import load_config
    from learners.learner_group import LearnerGroup

    cfg = load_config("configs/tiny.yaml", ["output_dir=unused", "model.tiny.arch=qwen2_5_vl",
                                                   "rollout.prompts_per_step=2", "rollout.group_size=2",
                                                   "learner.micro_batch_size=2", "learner.lr=0.01"])
    placement = place(cfg.cluster)
    worker = RolloutWorker.options(**placement.options("rollout", 0, "RolloutWorker-multimodal")).remote(
        str(vl_model_path), seed=0, threads=1)
    learners = LearnerGroup(cfg, placement, str(vl_model_path))
    try:
        trajs, summary = ray.get(worker.rollout.remote(imaging_tasks, [0, 1], 2, {"max_tokens": 8,
                                                                                  "temperature": 1.0}, 0))
        assert len(trajs) == 4 and summary.policy_tokens > 0
        for t in trajs:
            assert t.image_grids == [(1, 6, 6)] and t.images[0].shape == (448, 448, 3)
            assert t.prompt_ids.count(vision.pad_id) == 9  # the full run the learner's forward needs
            assert len(t.logprobs) == len(t.response_ids) == len(t.loss_mask)
            # a vision token the random policy wrote ended its turn and was dropped: no fake image in the ids
            assert not set(t.response_ids) & set(vision.special_ids)
        learners.train([ray.put(trajs)], [1.0, -1.0, -1.0, 1.0], cfg)
        seqs, images = [t.prompt_ids + t.response_ids for t in trajs], [t.images for t in trajs]

        def max_diff():
            engine = ray.get(worker.prompt_logprobs.remote(seqs, images))
            learner = learners.sequence_logprobs(seqs, images)
            assert all(len(e) == len(s) - 1 for e, s in zip(engine, seqs))  # vLLM expanded to the same ids
            return max(np.max(np.abs(np.array(e) - np.array(l))) for e, l in zip(engine, learner))

        assert max_diff() > 1e-3, "the update should have moved the learner away from the engine"
        learners.connect([worker])
        learners.sync(version=1)
        assert max_diff() <= 1e-4
    finally:
        learners.shutdown()
        ray.kill(worker)
        placement.remove()


class CropEnvironment(Environment):
    """A zoom-in: every call answers with the `box` crop of the task's image (or of `replacement`, to show that the
    policy's next turn depends on the pixels it was given)."""

    def __init__(self, box, replacement=None):
        self.box, self.replacement = box, replacement

    def call(self, episodes, actions):
        from PIL import Image
        out = []
        for ep in episodes:
            with Image.open(ep.task["images"][0]) as image:
                crop = image.crop(self.box) if self.replacement is None else self.replacement
                out.append(Observation(f"zoom {list(self.box)}", {"box": list(self.box)}, images=[crop]))
        return out


@pytest.mark.slow
def test_image_observation_is_masked_and_seen_by_the_next_turn(vl_model_path, vision, imaging_tasks):
    """A tool answers with a crop: its image tokens sit inside the observation tags with mask 0, and the engine's
    log-probabilities of the policy's next turn are the HF forward's with that crop in place (not with another)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from vllm import LLM

    from actors.rollout_worker import task_prompt
    from learners import algorithm as algo
    from learners.batches import image_inputs

    llm = LLM(model=str(vl_model_path), dtype="float32", seed=0, max_model_len=1024, enforce_eager=True,
              distributed_executor_backend="uni", enable_chunked_prefill=False, kv_cache_memory_bytes=2**28,
              limit_mm_per_prompt={"image": 4, "video": 0})
    tok = llm.get_tokenizer()
    close = tok.convert_tokens_to_ids("</tool_call>")
    grammar = Grammar(action_tag="tool_call", observation_tag="tool_response", max_turns=1)
    ids, images, grids = task_prompt(imaging_tasks[0], tok, vision)
    forced = {"temperature": 1.0, "max_tokens": 4, "allowed_token_ids": [close]}  # a scripted policy, real engine

    def episode(env):
        ep = Episode(task=imaging_tasks[0], group=0, seed=0, prompt_ids=ids, images=list(images),
                     image_grids=list(grids))
        EpisodeRunner(llm.llm_engine, tok, grammar, env, vision).run([ep], forced)
        return ep

    ep = episode(CropEnvironment(CROP))
    assert ep.finish_reason == "turn_limit" and ep.image_grids == [(1, 6, 6), (1, 6, 8)]
    assert [t for t, m in zip(ep.response_ids, ep.loss_mask) if m] == [close, close]
    observation = ep.response_ids[1:-1]  # everything between the two policy tokens is the environment's
    assert observation.count(vision.pad_id) == 12 and not any(ep.loss_mask[1:-1])
    assert tok.decode(observation).startswith("\n<tool_response>\n<|vision_start|>")
    with Image.open(imaging_tasks[0]["images"][0]) as image:
        assert np.array_equal(ep.images[1], np.asarray(image.convert("RGB").crop(CROP)))

    model = AutoModelForImageTextToText.from_pretrained(vl_model_path, dtype=torch.float32).eval()

    def hf_policy_logprobs(shown):
        seq = torch.tensor([ep.prompt_ids + ep.response_ids])
        with torch.no_grad():
            logits = model(input_ids=seq, **image_inputs(seq, shown, vision)).logits[:, :-1]
        logp = algo.token_logprobs(logits, seq[:, 1:])[0, len(ep.prompt_ids) - 1:]
        return np.array([lp for lp, m in zip(logp.tolist(), ep.loss_mask) if m])

    engine = np.array([lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m])
    assert np.max(np.abs(engine - hf_policy_logprobs(ep.images))) <= 1e-4
    other = np.ascontiguousarray(ep.images[1][::-1])  # the same crop upside down
    assert abs(engine[1] - hf_policy_logprobs([ep.images[0], other])[1]) > 1e-5
    flipped = episode(CropEnvironment(CROP, replacement=Image.fromarray(other)))
    assert flipped.logprobs[0] == ep.logprobs[0] and flipped.logprobs[-1] != ep.logprobs[-1]
