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
CONV = TinyModelConfig(arch="qwen2_5_vl", patch_embedding="conv")  # medray's architecture (tasks/vision_arch.py)
CROP = (0, 0, 60, 40)  # x0, y0, x1, y1 in the task image's full resolution


@pytest.fixture(scope="module")
def vl_model_path():
    from tasks.tiny_models import ensure_tiny_model
    return ensure_tiny_model(VL)


@pytest.fixture(scope="module")
def conv_model_path():
    from tasks.tiny_models import ensure_tiny_model
    return ensure_tiny_model(CONV)


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
@pytest.mark.parametrize("patch_embedding", ["linear", "conv"])
def test_image_rollouts_train_and_stay_faithful_to_the_learner(ray_session, vision, imaging_tasks, patch_embedding):
    """A RolloutWorker samples from prompts with images; GRPO trains the VL policy on them; after the sync the
    engine's log-probabilities of the image sequences equal the learner's forward (1e-4), and before it they don't.
    With either patch embedding: a convolutional one (medray's architecture) is trained and synced as the rest."""
    import ray

    from actors.rollout_worker import RolloutWorker
    from cluster.placement import place
    from learners.config import load_config
    from learners.learner_group import LearnerGroup
    from tasks.tiny_models import ensure_tiny_model

    cfg = load_config("configs/tiny.yaml", ["output_dir=unused", "model.tiny.arch=qwen2_5_vl",
                                                   f"model.tiny.patch_embedding={patch_embedding}",
                                                   "rollout.prompts_per_step=2", "rollout.group_size=2",
                                                   "learner.micro_batch_size=2", "learner.lr=0.01"])
    model_path = str(ensure_tiny_model(cfg.model.tiny))
    placement = place(cfg.cluster)
    worker = RolloutWorker.options(**placement.options("rollout", 0, "RolloutWorker-multimodal")).remote(
        model_path, seed=0, threads=1)
    learners = LearnerGroup(cfg, placement, model_path)
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


def in_process_llm(model_path, images: int = 4):
    """A float32 vLLM engine on `model_path` in this process (no engine-core process), up to `images` a prompt."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    return LLM(model=str(model_path), dtype="float32", seed=0, max_model_len=1024, enforce_eager=True,
               distributed_executor_backend="uni", enable_chunked_prefill=False, kv_cache_memory_bytes=2**28,
               limit_mm_per_prompt={"image": images, "video": 0})


def learner_logprobs(model, ids: list[int], images: list, vision) -> np.ndarray:
    """log p(token_t | tokens_<t), t >= 1, of `ids` (full pad runs) with `images` under the HF `model`."""
    import torch
    from learners import algorithm as algo
    from learners.batches import image_inputs

    seq = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=seq, **image_inputs(seq, images, vision)).logits[:, :-1]
    return algo.token_logprobs(logits, seq[:, 1:])[0].numpy()


def engine_logprobs(output, ids: list[int]) -> np.ndarray:
    """The same from a vLLM RequestOutput of `ids`' prompt asked with prompt_logprobs=0."""
    return np.array([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], ids[1:])])


def test_a_convolutional_patch_embedding_loads_into_medray_s_class_with_its_saved_weights(conv_model_path, tmp_path):
    """config.json names medray's architecture (model_type still Qwen2.5-VL's); the learner's loader builds that class
    and every saved tensor arrives as saved: nothing newly initialised, nothing left over. A vision_config naming an
    unknown patch embedding is refused, naming the field and the directory."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file

    from learners.batches import load_causal_lm
    from tasks.vision_arch import ARCHITECTURE
    from tasks.vision_arch_hf import ConvPatchEmbedding, MedrayQwen2_5_VLForConditionalGeneration

    config = json.loads((conv_model_path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "qwen2_5_vl"
    assert config["vision_config"]["patch_embedding"] == "conv"
    model = load_causal_lm(str(conv_model_path), torch.float32)
    assert isinstance(model, MedrayQwen2_5_VLForConditionalGeneration)
    assert isinstance(model.model.visual.patch_embed, ConvPatchEmbedding)
    saved, loaded = load_file(conv_model_path / "model.safetensors"), model.state_dict()
    assert set(saved) == set(loaded) and "model.visual.patch_embed.net.0.weight" in saved
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())

    bad = tmp_path / "bad"
    shutil.copytree(conv_model_path, bad)
    config["vision_config"]["patch_embedding"] = "cnn"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vision_config.patch_embedding 'cnn' is not a patch embedding") as refused:
        load_causal_lm(str(bad), torch.float32)
    assert str(bad) in str(refused.value)


@pytest.mark.slow
def test_the_engine_runs_the_convolutional_patch_embedding_the_learner_trains(conv_model_path, imaging_tasks):
    """vLLM builds medray's class (the plugin registers it) with the checkpoint's conv weights: its log-probabilities
    of an image prompt are the HF learner's (1e-4, float32). Moving the learner's conv weights alone breaks that, so
    they matter, and reloading just those weights, named as the learner names them, restores it."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from actors.engine_weights import begin_reload, finish_reload, load_weights
    from actors.episode import engine_prompt
    from actors.rollout_worker import task_prompt
    from learners.batches import load_causal_lm

    vision = ImageTokens.for_model(str(conv_model_path))
    llm = in_process_llm(conv_model_path, images=1)
    assert type(llm.llm_engine.model_config.hf_config).__name__ == "Qwen2_5_VLConfig"
    ids, images, _ = task_prompt(imaging_tasks[0], llm.get_tokenizer(), vision)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    model = load_causal_lm(str(conv_model_path), torch.float32).eval()

    def max_diff():
        out = llm.generate([TokensPrompt(**engine_prompt(ids, images, vision))], params, use_tqdm=False)[0]
        return np.max(np.abs(engine_logprobs(out, ids) - learner_logprobs(model, ids, images, vision)))

    assert max_diff() <= 1e-4
    conv = [(name, p) for name, p in model.named_parameters() if ".patch_embed." in name]
    assert conv and all(".patch_embed.net." in name or ".patch_embed.proj." in name for name, _ in conv)
    with torch.no_grad():
        for _, p in conv:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * p.std())
    assert max_diff() > 1e-3
    llm.collective_rpc(begin_reload, args=(False,))  # only these weights arrive
    assert llm.collective_rpc(load_weights, args=([(name, p.detach()) for name, p in conv],)) == [len(conv)]
    llm.collective_rpc(finish_reload)
    llm.reset_prefix_cache()  # what a rollout worker drops after a reload (RolloutWorker._after_reload)
    llm.llm_engine.reset_encoder_cache()
    assert max_diff() <= 1e-4


@pytest.mark.slow
def test_async_llm_s_engine_core_process_serves_the_convolutional_policy(conv_model_path, imaging_tasks):
    """Serving's AsyncLLM builds its engine in an engine-core process of its own, which finds medray's architecture
    through the vLLM plugin (pyproject.toml) as the process that asked did, and loads the conv weights: its
    log-probabilities of an image prompt are the HF learner's."""
    import asyncio

    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from actors.episode import engine_prompt
    from actors.rollout_worker import task_prompt
    from learners.batches import load_causal_lm
    from serve.config import ServeEngineSettings
    from serve.engine import start_engine

    vision = ImageTokens.for_model(str(conv_model_path))
    settings = ServeEngineSettings(backend="async_llm", max_model_len=1024, kv_cache_gb=0.25, threads=1)
    model = load_causal_lm(str(conv_model_path), torch.float32).eval()
    ids, images, _ = task_prompt(imaging_tasks[0], AutoTokenizer.from_pretrained(conv_model_path), vision)

    async def served():
        engine = start_engine(str(conv_model_path), settings, device="cpu", num_cpus=1, max_images=1)
        try:
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
            async for out in engine.generate(engine_prompt(ids, images, vision), params, "conv-0"):
                pass
            return engine_logprobs(out, ids)
        finally:
            engine.engine.shutdown()

    assert np.max(np.abs(asyncio.run(served()) - learner_logprobs(model, ids, images, vision))) <= 1e-4


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
    import torch
    from PIL import Image

    from actors.rollout_worker import task_prompt
    from learners.batches import load_causal_lm

    llm = in_process_llm(vl_model_path)
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

    model = load_causal_lm(str(vl_model_path), torch.float32).eval()

    def hf_policy_logprobs(shown):
        logp = learner_logprobs(model, ep.prompt_ids + ep.response_ids, shown, vision)[len(ep.prompt_ids) - 1:]
        return np.array([lp for lp, m in zip(logp.tolist(), ep.loss_mask) if m])

    engine = np.array([lp for lp, m in zip(ep.logprobs, ep.loss_mask) if m])
    assert np.max(np.abs(engine - hf_policy_logprobs(ep.images))) <= 1e-4
    other = np.ascontiguousarray(ep.images[1][::-1])  # the same crop upside down
    assert abs(engine[1] - hf_policy_logprobs([ep.images[0], other])[1]) > 1e-5
    flipped = episode(CropEnvironment(CROP, replacement=Image.fromarray(other)))
    assert flipped.logprobs[0] == ep.logprobs[0] and flipped.logprobs[-1] != ep.logprobs[-1]
