"""medray (sync and async=one_step_off) vs TRL's GRPOTrainer: samples/s and the reward curve on the same workload.

    python benchmarks/bench_trl.py --size tiny --steps 20
    python benchmarks/bench_trl.py --size 50m --steps 4
    python benchmarks/bench_trl.py --size smollm2 --steps 10
    python benchmarks/bench_trl.py --size smollm2 --steps 20 --model-path CHECKPOINT --accuracy-weight 2

Both systems train the same model (tiny/50m: random-initialised, tasks/tiny_models.py; smollm2: the pretrained
SmolLM2-135M-Instruct of `model.path: smollm2-135m-instruct`) on the same HPO multiple-choice prompts, in the same
order (shuffling off; prompt i of step s is task s * prompts + i of a fixed seeded subset), with the same reward
(rewards.builtin tag_format on <answer> + 0.5 x valid_option, + W x accuracy with --accuracy-weight W: the very
Python functions), group size, batch, completion length, temperature, lr, AdamW, grad clip 1.0, constant schedule
and no KL (beta 0). Loss: DAPO
token-mean aggregation (medray `loss_agg: token_mean`, TRL `loss_type: "dapo"`), clip eps 0.2 / 0.28 on both, group
advantages normalised by the group std (TRL `scale_rewards: "group"`). At smollm2 size both train under bfloat16
autocast (TRL `bf16=True`, medray `learner.compute_dtype: bfloat16`) where the CPU multiplies it natively. A TRL
completion ends at EOS or the length limit; a medray one also at `</answer>` (its grammar's stop, which TRL's
`generate` cannot take: the tag is several tokens), so a policy that writes on after its answer costs TRL more tokens
(response_tokens, the mean completion length). TRL runs in this process on CPU with
`generate` (no vLLM); medray runs its Ray actors (one vLLM rollout worker with 2 threads, 2 DeepSpeed learner ranks,
one reward actor) on the same 2 cores. --model-path starts both from other weights of the size's architecture (e.g.
a cold-started checkpoint of the real model, which writes the answer format, so that the reward has room to move).

s/step is the mean over steps 2..N (step 1 warms up engines and caches), without medray's checkpoint write;
samples/s = batch / (s/step). wall_s includes start-up. Targets: never slower than TRL at tiny size,
>= 2x samples/s at ~50M, reward curves at least as good. Writes benchmarks/results/trl_<size>.json and
benchmarks/results/trl_reward_<size>.png (<size>_from_checkpoint with --model-path).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
# Workload per size. tiny: ~0.35M-parameter Qwen2 (hidden 96, 2 layers); 50m: benchmarks.common.MODEL_50M;
# smollm2: the real model alias.
SIZES = {
    "tiny": {"model": {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3,
                       "num_key_value_heads": 1},
             "prompts": 16, "group": 4, "new_tokens": 32, "lr": 5e-3, "micro_batch": 32},
    "50m": {"model": "MODEL_50M", "prompts": 8, "group": 4, "new_tokens": 256, "lr": 1e-4, "micro_batch": 8},
    "smollm2": {"alias": "smollm2-135m-instruct", "prompts": 8, "group": 4, "new_tokens": 128, "lr": 1e-6,
                "micro_batch": 4},
}
REWARD_WEIGHTS = {"tag_format": 1.0, "valid_option": 0.5}
MAX_PROMPT_TOKENS = 384


def model_dir(size: str) -> str:
    """The size's model directory: the real model's alias resolved (built once), or the random model built once."""
    from benchmarks import common
    from tasks.model_aliases import resolve_model
    from tasks.tiny_models import TinyModelConfig, ensure_tiny_model
    if "alias" in SIZES[size]:
        return resolve_model(SIZES[size]["alias"])
    spec = SIZES[size]["model"]
    return str(ensure_tiny_model(getattr(common, spec) if isinstance(spec, str) else TinyModelConfig(**spec)))


def bfloat16(size: str) -> bool:
    """Whether both systems train the size under bfloat16 autocast: the real model, on hardware made for it."""
    from cluster.devices import accelerator, fast_bfloat16
    return "alias" in SIZES[size] and fast_bfloat16(accelerator())


def workload_tasks(model_path: str, n: int, seed: int = 0) -> list[dict]:
    """`n` HPO MCQ tasks whose chat prompt fits MAX_PROMPT_TOKENS, a seeded random subset in a fixed order."""
    import numpy as np
    from transformers import AutoTokenizer

    from learners.data import load_tasks
    tok = AutoTokenizer.from_pretrained(model_path)
    tasks = load_tasks("hpo:mcq_train")
    order = np.random.default_rng(seed).permutation(len(tasks))
    fits = (tasks[i] for i in order if len(tok.apply_chat_template(
        tasks[i]["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)) <= MAX_PROMPT_TOKENS)
    return [t for t, _ in zip(fits, range(n))]


def reward_weights(accuracy_weight: float) -> dict[str, float]:
    return {**REWARD_WEIGHTS, **({"accuracy": accuracy_weight} if accuracy_weight else {})}


def shared_reward(texts: list[str], tasks: list[dict], weights: dict[str, float]) -> list[float]:
    """The reward both systems optimise, computed by medray's own reward functions at `weights`."""
    from actors.trajectory import Trajectory
    from rewards.builtin import accuracy, tag_format, valid_option
    trajs = [Trajectory(task=t, group=0, prompt_ids=[], response_ids=[], logprobs=[], loss_mask=[], text=x,
                        finish_reason="", weight_version=0) for x, t in zip(texts, tasks)]
    scores = {"tag_format": tag_format(trajs, tags=("answer",))["format"], **valid_option(trajs), **accuracy(trajs)}
    return [sum(w * scores[name][i] for name, w in weights.items()) for i in range(len(trajs))]


def run_trl(model_path: str, tasks: list[dict], size: str, steps: int, threads: int, out: str,
            weights: dict[str, float]) -> dict:
    """TRL GRPOTrainer in this process on CPU; per-step reward and wall time from its logs and a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = SIZES[size]
    torch.set_num_threads(threads)
    dataset = Dataset.from_list([{"prompt": t["messages"], "task_index": i} for i, t in enumerate(tasks)])

    def reward(completions, task_index, **_):
        return shared_reward([c[0]["content"] for c in completions], [tasks[i] for i in task_index], weights)

    class StepTimer(TrainerCallback):
        """Seconds of each optimizer step; TRL generates inside the step (in `_prepare_inputs`)."""
        def __init__(self):
            self.seconds, self.begin = [], 0.0

        def on_step_begin(self, *_, **__):
            self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.begin)

    batch = spec["prompts"] * spec["group"]
    args = GRPOConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=spec["group"], max_completion_length=spec["new_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", num_iterations=1,
        shuffle_dataset=False, use_cpu=True, bf16=bfloat16(size), gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0)
    timer = StepTimer()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, use_safetensors=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[timer])
    trainer.train()
    wall = time.perf_counter() - start
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {"rewards": [h["reward"] for h in logged], "step_s": timer.seconds[1:], "wall_s": wall,
            "response_tokens": statistics.mean(h["completions/mean_length"] for h in logged)}


def run_medray(model_path: str, size: str, steps: int, mode: str, threads: int, tasks_file: Path,
               out: str, weights: dict[str, float]) -> dict:
    """medray's Trainer on a config built here (quickstart's layout), reading metrics.jsonl afterwards."""
    from learners.config import RunConfig
    from learners.trainer import Trainer

    spec = SIZES[size]
    cfg = RunConfig.model_validate({
        "output_dir": out, "seed": 0, "total_steps": steps, "async": mode,
        "cluster": {"rollout": {"num": 1, "num_cpus": 1, "threads": threads},
                    "learner": {"num": 2, "num_cpus": 0.25, "threads": 1},
                    "reward": {"num": 1, "num_cpus": 0.25, "threads": 1}},
        "model": {"path": model_path},
        "data": {"train": str(tasks_file), "shuffle": False, "max_prompt_tokens": MAX_PROMPT_TOKENS},
        "rollout": {"prompts_per_step": spec["prompts"], "group_size": spec["group"], "temperature": 1.0,
                    "max_new_tokens": spec["new_tokens"], "max_model_len": MAX_PROMPT_TOKENS + spec["new_tokens"] + 64},
        "algorithm": {"eps_low": 0.2, "eps_high": 0.28, "loss_agg": "token_mean", "normalize_std": True,
                      "kl_beta": 0.0},
        "learner": {"zero_stage": 2, "lr": spec["lr"], "micro_batch_size": spec["micro_batch"], "max_grad_norm": 1.0,
                    "lr_schedule": "constant", "compute_dtype": "bfloat16" if bfloat16(size) else "float32"},
        "rewards": {"components": [{"name": name, "weight": w, **({"args": {"tags": ["answer"]}}
                                                                   if name == "tag_format" else {})}
                                   for name, w in weights.items()]},
        "checkpoint": {"every": steps}, "logging": {"tensorboard": False, "progress_bar": False}})
    start = time.perf_counter()
    history = Trainer(cfg).fit()
    wall = time.perf_counter() - start
    return {"rewards": [r["reward_mean"] for r in history],
            "step_s": [r["step_s"] - r.get("checkpoint_s", 0.0) for r in history[1:]], "wall_s": wall,
            "response_tokens": statistics.mean(r["response_length"] for r in history),
            "generate_s": statistics.mean(r["generate_s"] for r in history[1:]),
            "train_s": statistics.mean(r["train_s"] for r in history[1:])}


def summarise(system: str, result: dict, batch: int) -> dict:
    """One table row. load_1min is the machine's 1-minute load average as the run ended (2 cores: above ~2 the
    timings include waiting for other people's work)."""
    s_step = statistics.mean(result["step_s"]) if result["step_s"] else float("nan")
    return {"system": system, "steps": len(result["rewards"]), "samples_per_s": batch / s_step, "s_per_step": s_step,
            **{k: result[k] for k in ("generate_s", "train_s", "response_tokens") if k in result},
            "reward_first": result["rewards"][0], "reward_final": result["rewards"][-1],
            "reward_mean": statistics.mean(result["rewards"]), "wall_s": result["wall_s"],
            "load_1min": round(os.getloadavg()[0], 1)}


def plot(curves: dict[str, list[float]], title: str, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no reward plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, marker=".", label=name)
    ax.set(xlabel="step", ylabel="mean reward")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for TRL and the vLLM worker")
    parser.add_argument("--systems", default="trl,medray_sync,medray_one_step_off")
    parser.add_argument("--model-path", help="weights to start both from (default: the size's model)")
    parser.add_argument("--accuracy-weight", type=float, default=0.0,
                        help="add medray's accuracy reward at this weight")
    args = parser.parse_args()

    import ray

    from benchmarks.common import report

    spec, systems = SIZES[args.size], args.systems.split(",")
    batch = spec["prompts"] * spec["group"]
    model_path, weights = args.model_path or model_dir(args.size), reward_weights(args.accuracy_weight)
    reward_label = " + ".join(f"{w:g} {name}" for name, w in weights.items())
    name = args.size + ("_from_checkpoint" if args.model_path else "")
    tasks = workload_tasks(model_path, spec["prompts"] * args.steps)
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks_file = Path(tmp) / "tasks.jsonl"
        tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        for system in systems:
            out = str(Path(tmp) / system)
            if system == "trl":
                # in a process of its own, so its model and optimizer are freed before medray's actors start
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    result = pool.submit(run_trl, model_path, tasks, args.size, args.steps, args.threads, out,
                                         weights).result()
            else:
                result = run_medray(model_path, args.size, args.steps, system.removeprefix("medray_"), args.threads,
                                    tasks_file, out, weights)
            curves[system] = result["rewards"]
            rows.append(summarise(system, result, batch))
            print(rows[-1], flush=True)
    ray.shutdown()
    params = _params(model_path)
    for row in rows:
        row.update(size=args.size, params_M=round(params / 1e6, 3), batch=f"{spec['prompts']}x{spec['group']}",
                   new_tokens=spec["new_tokens"], bfloat16=bfloat16(args.size), model_path=model_path,
                   reward=reward_label)
    if "trl" in curves:
        trl = next(r for r in rows if r["system"] == "trl")
        for row in rows:
            row["speedup_vs_trl"] = row["samples_per_s"] / trl["samples_per_s"]
    path = report(f"trl_{name}", rows, str(RESULTS))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "reward_curves": curves}, indent=1))
    plot(curves, f"GRPO, {name} ({params / 1e6:.1f}M params, {batch} samples/step)\nreward: {reward_label}",
         RESULTS / f"trl_reward_{name}.png")


def _params(path: str) -> int:
    import math
    from safetensors import safe_open
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
