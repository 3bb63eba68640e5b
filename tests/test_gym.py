"""The medical tool Gym on real tool actors over synthetic imaging-world images: every tool in a full episode, crops
equal to the image's pixels, invalid calls that the policy can recover from, the repeated-call and tool-cap rules,
a killed tool actor that Ray restarts mid-episode, one batched call per tool, and (slow) multi-turn episodes on a
real vLLM engine."""
import json
import re

import numpy as np
import pytest
from PIL import Image

from actors.episode import Episode, Observation
from actors.gym import MedicalGym, ToolEnvironment, ToolsConfig, make_tool_environment, parse_tool_call
from actors.tools import ToolArgumentError, ToolCall, ToolContext, box_iou, make_tool

ALL_TOOLS = ["zoom_in", "enhance", "find_regions", "biomedclip_labels", "retrieve_knowledge"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tasks.build_imaging import ensure_imaging_world
    return ensure_imaging_world(tmp_path_factory.mktemp("gym_world"), seed=0, workers=1, progress=False,
                                n_train=6, n_test=2, n_corpus=1)


@pytest.fixture(scope="module")
def tasks(world) -> list[dict]:
    from tasks.schema import read_tasks, resolve_image_paths
    path = world["finding_mcq_train"]
    return [resolve_image_paths(t, path.parent).model_dump(mode="json") for t in read_tasks(path)]


@pytest.fixture(scope="module")
def retriever(ray_session, tasks, tmp_path_factory):
    """A real Retriever actor on a BM25 index of a KB slice: the findings' HPO term documents and some diseases."""
    from indexing.build_index import build_index
    from indexing.retrieval_index import IndexConfig, resolve_corpus
    from actors.retriever import Retriever

    wanted = {t["metadata"]["kb_doc_id"] for t in tasks}
    rows = []
    with open(resolve_corpus("hpo"), encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row["doc_id"] in wanted or len(rows) < 100:
                rows.append(row)
    out = tmp_path_factory.mktemp("kb_slice")
    (out / "chunks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # built in a Ray worker: bm25s imports numba, and vLLM (the slow test, same process) fails to start in a process
    # that has imported llvmlite (vllm/triton_utils/dispatcher.py trips over llvmlite's ffi object)
    ray_session.get(ray_session.remote(build_index).remote(str(out / "chunks.jsonl"), str(out / "index"),
                                                           config=IndexConfig(kind="none"), progress=False))
    actor = Retriever.options(num_cpus=0.25).remote(str(out / "index"), config={"mode": "sparse", "top_k": 3})
    yield actor
    ray_session.kill(actor)  # its CPU share would otherwise stay reserved for later tests' placement groups


@pytest.fixture(scope="module")
def env(ray_session, retriever):
    environment = make_tool_environment({"tools": {name: {} for name in ALL_TOOLS}, "max_tool_calls": 6},
                                        retriever=retriever)
    yield environment
    environment.shutdown()


def tool_call(name: str, **arguments) -> str:
    return f'<think>look</think><tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def pixels(path: str) -> np.ndarray:
    return np.asarray(Image.open(path))


def test_full_episode_with_every_tool(env, tasks):
    task = tasks[0]
    x0, y0, x1, y1 = map(int, task["gold_boxes"][0])
    gym = MedicalGym(env)
    first = gym.reset(task)
    assert "What finding is present" in first.text and first.images[0].size == (448, 448)

    obs, done, info = gym.step(tool_call("zoom_in", box=[x0, y0, x1, y1]))
    assert not done and info["record"]["tool"] == "zoom_in" and info["record"]["box"] == [x0, y0, x1, y1]
    assert np.array_equal(np.asarray(obs.images[0]), pixels(task["images"][0])[y0:y1, x0:x1])
    assert f"({x1 - x0} x {y1 - y0} px)" in obs.text

    region = [max(0, x0 - 40), max(0, y0 - 40), min(448, x1 + 40), min(448, y1 + 40)]
    obs, done, info = gym.step(tool_call("enhance", method="clahe", box=region))
    enhanced = np.asarray(obs.images[0])
    assert enhanced.shape[:2] == (region[3] - region[1], region[2] - region[0])
    assert info["record"]["measurements"]["std_after"] > info["record"]["measurements"]["std_before"]

    obs, done, info = gym.step(tool_call("find_regions", max_regions=3))
    boxes = info["record"]["boxes"]
    assert 1 <= len(boxes) <= 3 and all(0 <= b[0] < b[2] <= 448 and 0 <= b[1] < b[3] <= 448 for b in boxes)
    assert all(box_iou(a, b) < 0.5 for i, a in enumerate(boxes) for b in boxes[i + 1:])  # no region twice

    labels = list(task["options"].values())
    obs, done, info = gym.step(tool_call("biomedclip_labels", labels=labels, box=[x0, y0, x1, y1]))
    probs = info["record"]["measurements"]
    assert set(probs) == set(labels) and abs(sum(probs.values()) - 1) < 1e-4
    assert all(label in obs.text for label in labels)

    name = task["metadata"]["hpo_name"]
    obs, done, info = gym.step(tool_call("retrieve_knowledge", query=name))
    assert not done and name in obs.text and info["record"]["args"] == {"query": name}

    obs, done, info = gym.step(f"<think>seen</think><answer>{task['answer']}</answer>")
    assert done and info["finish"] == "answer" and obs.record["answer"] == task["answer"]
    assert [t["tool"] for t in gym.episode.turns] == ALL_TOOLS
    assert all(t["error"] is None for t in gym.episode.turns)
    with pytest.raises(RuntimeError, match="reset"):
        gym.step(tool_call("zoom_in", box=[0, 0, 8, 8]))


def test_rgb_image_crop_and_enhancement(tmp_path):
    """Tools run in-process too (no actor): a pathology (RGB) image from render_case."""
    from tasks.imaging import CaseSpec, LesionSpec, render_case
    case = render_case(CaseSpec(0, "train", 7, "pathology", (LesionSpec("carcinoma", "large"),)))
    path = tmp_path / "case.png"
    Image.fromarray(case.image).save(path)
    context = ToolContext((str(path),))
    box = case.lesions[0].box
    zoom, enhance = make_tool("zoom_in"), make_tool("enhance")
    crop = zoom.run_batch([ToolCall(zoom.validate({"box": box}, context), context)])[0]
    assert np.array_equal(np.asarray(crop.images[0]), case.image[box[1]:box[3], box[0]:box[2]])
    for method in ("clahe", "denoise", "brighten"):
        out = enhance.run_batch([ToolCall(enhance.validate({"method": method}, context), context)])[0]
        assert out.error is None and np.asarray(out.images[0]).shape == case.image.shape
        if method == "brighten":
            assert out.measurements["mean_after"] > out.measurements["mean_before"]
        if method == "denoise":
            assert out.measurements["std_after"] < out.measurements["std_before"]


def test_find_regions_boxes_a_blob_on_a_flat_background(tmp_path):
    image = np.full((200, 240), 90, np.uint8) + np.random.default_rng(0).integers(0, 3, (200, 240)).astype(np.uint8)
    yy, xx = np.mgrid[0:200, 0:240]
    image[(yy - 120) ** 2 + (xx - 60) ** 2 <= 8 ** 2] = 160  # a disc: bounding box [52, 112, 69, 129]
    path = tmp_path / "blob.png"
    Image.fromarray(image).save(path)
    context = ToolContext((str(path),))
    tool = make_tool("find_regions")
    result = tool.run_batch([ToolCall(tool.validate({}, context), context)])[0]
    best = result.boxes[0]
    assert all(abs(a - b) <= 2 for a, b in zip(best, [52, 112, 69, 129])), result.text
    in_box = tool.run_batch([ToolCall(tool.validate({"box": [40, 100, 120, 160]}, context), context)])[0]
    assert in_box.boxes[0] == best  # a region search inside a box reports full-image coordinates


@pytest.mark.parametrize("finding", ["fracture", "bone_cyst", "osteoma"])
def test_find_regions_finds_a_large_bone_lesion_the_cortex_does_not_hide(finding, tmp_path):
    """A femur's cortex is a bright straight edge everywhere; the lesion is what the anatomy does not explain. (An
    isotropic median background boxed the cortex instead: bone recall@5 was 0.04.)"""
    from tasks.imaging import CaseSpec, LesionSpec, render_case
    case = render_case(CaseSpec(0, "train", 3, "bone_xray", (LesionSpec(finding, "large"),)))
    path = tmp_path / "femur.png"
    Image.fromarray(case.image).save(path)
    context = ToolContext((str(path),))
    tool = make_tool("find_regions")
    boxes = tool.run_batch([ToolCall(tool.validate({"max_regions": 5}, context), context)])[0].boxes
    gold = case.lesions[0].box
    assert max(box_iou(b, gold) for b in boxes) > 0.1, (boxes, gold)  # the recall criterion of bench_tools


@pytest.mark.parametrize("modality, findings", [("bone_xray", ["fracture", "bone_cyst", "osteoma", "osteolysis"]),
                                                 ("chest_xray", ["nodule", "cyst", "calcified_nodule"])])
def test_find_regions_finds_most_small_lesions_in_the_texture(modality, findings, tmp_path):
    """A 6-12 px lesion (a crack, a bone cyst's ring, a small nodule) is fainter than the trabecular or lung texture
    around it at the anatomy's scale; the fine-scale candidates find it. (Anatomy-scale candidates alone found 4 and
    6 of these 12.)"""
    from tasks.imaging import CaseSpec, LesionSpec, render_case
    tool, found = make_tool("find_regions"), 0
    for i in range(12):
        case = render_case(CaseSpec(0, "train", i, modality, (LesionSpec(findings[i % len(findings)], "small"),)))
        path = tmp_path / f"{i}.png"
        Image.fromarray(case.image).save(path)
        context = ToolContext((str(path),))
        boxes = tool.run_batch([ToolCall(tool.validate({"max_regions": 5}, context), context)])[0].boxes
        found += max(box_iou(b, case.lesions[0].box) for b in boxes) > 0.1
    assert found >= 9, found


@pytest.mark.parametrize("action, says", [
    (tool_call("zoom_in", box=[400, 400, 460, 470]), "lies outside image 0 (448 x 448 px)"),
    (tool_call("zoom_in", box=[50, 50, 50, 90]), "is empty"),
    (tool_call("zoom_in", box=[-1, 0, 10, 10]), "lies outside"),
    (tool_call("zoom_in", box=[0.2, 0.1, 0.5, 0.6]), "box.0: Input should be a valid integer"),
    (tool_call("zoom_in", box=[1, 2, 3]), "box: List should have at least 4 items"),
    (tool_call("zoom_in"), "box: Field required"),
    (tool_call("zoom_in", box=[0, 0, 9, 9], image=1), "image 1 does not exist"),
    (tool_call("enhance", method="sharpen"), "method: Input should be 'clahe', 'denoise' or 'brighten'"),
    ('<tool_call>{"name": "zoom_in", "arguments": {"box": [1, 2, 3, 4]</tool_call>', "not valid JSON"),
    ("<tool_call></tool_call>", "empty tool call"),
    ('<tool_call>["zoom_in", [1, 2, 3, 4]]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "zoom_in", "parameters": {}}</tool_call>', "unexpected key(s) ['parameters']"),
    (tool_call("medsam2", box=[0, 0, 9, 9]), "tool 'medsam2' does not exist; available tools: zoom_in"),
    (tool_call("find_regions"), "tool 'find_regions' is not available here"),
])
def test_invalid_call_is_an_error_observation_and_the_episode_goes_on(env, tasks, action, says):
    restricted = ToolEnvironment(env.tool_actors, allowed=["zoom_in", "enhance"], max_tool_calls=6)
    gym = MedicalGym(restricted)
    gym.reset(tasks[1])
    obs, done, info = gym.step(action)
    assert not done and says in obs.text and obs.text.startswith("error: ")
    assert info["record"]["error"] and "tool" not in info["record"]  # a failed call is not tool use (rewards)
    obs, done, info = gym.step(tool_call("zoom_in", box=[10, 10, 30, 30]))
    assert not done and info["record"]["tool"] == "zoom_in" and obs.images[0].size == (20, 20)


def test_repeated_identical_call_ends_the_episode(env, tasks):
    gym = MedicalGym(env)
    gym.reset(tasks[2])
    assert not gym.step(tool_call("zoom_in", box=[10, 20, 60, 80]))[1]
    assert not gym.step(tool_call("zoom_in", box=[10, 20, 60, 81]))[1]  # another box: a new call
    assert not gym.step(tool_call("zoom_in", box=[500, 20, 600, 80]))[1]  # an invalid call was never executed ...
    assert not gym.step(tool_call("zoom_in", box=[500, 20, 600, 80]))[1]  # ... so repeating it is only an error
    obs, done, info = gym.step('<tool_call>{"arguments": {"box": [10.0, 20, 60, 80], "image": 0}, '
                               '"name": "zoom_in"}</tool_call>')  # the first call again, written differently
    assert done and info["finish"] == "repeated_call" and "already called" in obs.text
    assert gym.episode.finish_reason == "repeated_call" and len(gym.episode.turns) == 5


def test_tool_call_cap_ends_the_episode(env, tasks):
    gym = MedicalGym(ToolEnvironment(env.tool_actors, allowed=["zoom_in"], max_tool_calls=2))
    gym.reset(tasks[3])
    for box in ([0, 0, 10, 10], [900, 0, 910, 10], [0, 0, 20, 20]):  # the invalid call does not count
        assert not gym.step(tool_call("zoom_in", box=box))[1]
    obs, done, info = gym.step(tool_call("zoom_in", box=[0, 0, 30, 30]))
    assert done and info["finish"] == "tool_limit" and "limit of 2 tool calls" in obs.text


def test_killed_tool_actor_is_restarted_and_the_episode_completes(env, tasks):
    import ray
    task = tasks[4]
    actor = env.tool_actors["zoom_in"][0]
    before = ray.get(actor.health.remote())
    gym = MedicalGym(env)
    gym.reset(task)
    gym.step(tool_call("zoom_in", box=[0, 0, 100, 100]))
    ray.kill(actor, no_restart=False)
    x0, y0, x1, y1 = map(int, task["gold_boxes"][0])
    obs, done, info = gym.step(tool_call("zoom_in", box=[x0, y0, x1, y1]))  # waits for the restarted actor
    assert not done and info["record"]["error"] is None
    assert np.array_equal(np.asarray(obs.images[0]), pixels(task["images"][0])[y0:y1, x0:x1])
    assert gym.step(f"<answer>{task['answer']}</answer>")[1]
    after = ray.get(actor.health.remote())
    assert after["restarted"] and not before["restarted"] and after["pid"] != before["pid"]


def test_calls_to_one_tool_reach_its_actor_as_one_batch(env, tasks):
    import ray
    zoom, enhance = env.tool_actors["zoom_in"][0], env.tool_actors["enhance"][0]
    calls0 = ray.get(zoom.stats.remote())
    episodes = [Episode(task=tasks[i % len(tasks)], group=i, seed=i, prompt_ids=[]) for i in range(7)]
    actions = [json.dumps({"name": "zoom_in", "arguments": {"box": [i, i, 40 + i, 40 + i]}}) for i in range(5)]
    actions += [json.dumps({"name": "enhance", "arguments": {"method": "brighten"}}), "not json"]
    pending = env.call(episodes, actions)
    refs = {p[0] for p in pending[:6]}
    assert len(refs) == 2 and [p[1] for p in pending[:5]] == [0, 1, 2, 3, 4] and pending[5][1] == 0
    assert isinstance(pending[6], Observation) and "not valid JSON" in pending[6].text
    results = ray.get(pending[0][0])
    for i, (ep, action) in enumerate(zip(episodes[:5], actions[:5])):
        obs = env.observe(ep, action, results[i], None)
        assert obs.record["box"] == [i, i, 40 + i, 40 + i] and obs.images[0].size == (40, 40)
    calls1 = ray.get(zoom.stats.remote())
    assert calls1["batches"] - calls0["batches"] == 1 and calls1["calls"] - calls0["calls"] == 5
    assert calls1["max_batch"] >= 5 and ray.get(enhance.stats.remote())["calls"] >= 1


def test_config_names_registered_tools():
    with pytest.raises(ValueError, match="unknown tool"):
        ToolsConfig(tools={"medsam2": {}})
    with pytest.raises(ValueError, match="'allowed'"):
        ToolsConfig(tools={"zoom_in": {}}, allowed=["enhance"])
    with pytest.raises(ToolArgumentError, match="not valid JSON"):
        parse_tool_call("{name: zoom_in}")


def literal_regex(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


@pytest.mark.slow
def test_tool_episodes_on_a_real_engine(env, tasks, tiny_model_path):
    """A forced policy (structured output: it can only write one exact tool call) zooms into the gold box, then
    repeats the call: the first turn is executed and recorded with its box, the second ends the episode; every
    observation token is masked."""
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import ray
    from vllm import LLM
    from vllm.sampling_params import StructuredOutputsParams

    from actors.environment import EpisodeRunner
    from actors.grammar import Grammar
    llm = LLM(model=str(tiny_model_path), dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
              distributed_executor_backend="uni", enable_chunked_prefill=False, kv_cache_memory_bytes=2**28)
    tok = llm.get_tokenizer()
    task = tasks[0]
    box = [int(v) for v in task["gold_boxes"][0]]
    call = f'<tool_call>{{"name": "zoom_in", "arguments": {{"box": {box}}}}}</tool_call>'
    grammar = Grammar(action_tag="tool_call", observation_tag="tool_response", max_turns=4,
                      max_response_tokens=400, max_observation_tokens=120)
    text_only = ToolEnvironment(env.tool_actors, env.allowed, observe_images=False)  # the tiny Qwen2 has no vision
    runner = EpisodeRunner(llm.llm_engine, tok, grammar, text_only)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Zoom in."}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    episodes = [Episode(task=task, group=0, seed=i, prompt_ids=list(prompt)) for i in range(2)]
    calls0 = ray.get(env.tool_actors["zoom_in"][0].stats.remote())["calls"]
    stats = runner.run(episodes, {"temperature": 1.0, "max_tokens": 160,
                                  "structured_outputs": StructuredOutputsParams(regex=literal_regex(call))})
    # the first call of each episode ran on the actor; the repeated ones were refused before reaching it
    assert ray.get(env.tool_actors["zoom_in"][0].stats.remote())["calls"] - calls0 == 2
    for ep in episodes:
        assert ep.finish_reason == "repeated_call" and len(ep.turns) == 2
        assert ep.turns[0]["tool"] == "zoom_in" and ep.turns[0]["box"] == box
        assert ep.turns[1]["finish"] == "repeated_call" and "tool" not in ep.turns[1]
        policy = tok.decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if m])
        assert policy == call * 2  # the policy's tokens are exactly its two calls
        environment = tok.decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if not m])
        assert environment.count("<tool_response>") == 2 and "zoom_in: image 0 region" in environment
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
    assert stats["env_calls"] == 4
