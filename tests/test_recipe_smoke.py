"""A short real run of every tiny recipe config: each stage for one step, every actor the recipe names (retrievers,
judge, tool actors, the multimodal policy), on the local Ray; Med-R3's also evaluates its open answers with the run's
judge at its end."""
import json

import pytest

from learners.config import load_config
from learners.trainer import Trainer

pytestmark = pytest.mark.slow

SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "learner.micro_batch_size=4",
         "rollout.fidelity_check_every=1", "checkpoint.every=100", "logging.progress_bar=false"]


#: What each recipe's plugin (recipes/) adds to the metrics of a GRPO step, in at least one step of the run.
PLUGIN_METRIC = {"med_rwr": "med_rwr/probed", "med_r3": "judge/calls", "medvr": "evr/branch_budget"}
#: Med-R3's run also evaluates its open answers at its end with the run's JudgeActor (its tiny vLLM judge).
JUDGED_EVAL = ["eval.data=[hpo:open_test]", "eval.limit=3", "eval.at_start=false", "eval.judge=true"]


def stage_overrides(cfg) -> list[str]:
    stages = cfg.stage_plan()
    if not cfg.stages:
        return ["total_steps=2"]
    sft = [f"stages.{i}.sft.batch_size=2" for i, s in enumerate(stages) if s.kind == "sft"]
    return [f"total_steps={len(stages)}", *[f"stages.{i}.steps=1" for i in range(len(stages))], *sft]


@pytest.mark.parametrize("recipe", ["med_rwr", "med_r3", "armed", "medvr", "medvistagym"])
def test_recipe_runs_every_stage(ray_session, tmp_path, recipe):
    path = f"configs/{recipe}.yaml"
    overrides = [f"output_dir={tmp_path / 'run'}", *SMALL, *stage_overrides(load_config(path)),
                 *(JUDGED_EVAL if recipe == "med_r3" else [])]
    if recipe == "medvistagym":  # its cold start reads scripted tool demonstrations
        from learners.expert import write_demonstrations
        demos = tmp_path / "demos.jsonl"
        write_demonstrations(load_config(path), "imaging:finding_mcq_train", demos, limit=4, progress=False)
        overrides.append(f"stages.0.sft.data={demos}")
    cfg = load_config(path, overrides)
    history = Trainer(cfg).fit()
    assert [h["step"] for h in history] == list(range(1, cfg.total_steps + 1))
    names = [h["stage_name"] for h in history]
    assert [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n] == [s.name for s in cfg.stage_plan()]
    grpo = [h for h in history if "reward_mean" in h]
    assert all(h["fidelity_max_abs_diff"] <= 1e-4 for h in grpo)
    assert all(any(k.startswith("reward/") for k in h) for h in grpo)  # every RL step scored its components
    if cfg.recipe and cfg.recipe.name in PLUGIN_METRIC:
        assert any(PLUGIN_METRIC[cfg.recipe.name] in h for h in grpo)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [h["step"] for h in history]
    if recipe == "med_r3":  # the judge's verdicts are arbitrary on tiny weights: every open answer counted once
        last = json.loads(lines[-1])
        assert 0 <= last["eval/hpo:open_test/judge_accuracy_low"] <= last["eval/hpo:open_test/judge_accuracy"] <= 1
        assert last["eval/hpo:open_test/judge_parse_failures"] >= 0
        report = json.loads((tmp_path / "run" / "eval" / f"step_{cfg.total_steps}" / "hpo_open_test" / "eval.json")
                            .read_text())
        judged = report["judge_accuracy"]
        assert judged["n"] == 3 == judged["correct"] + judged["incorrect"] + judged["parse_failures"] + \
            judged["unanswered"]
