"""Recipe plugins (recipes/): a config names its plugin, the plugin validates its own settings, and its hooks act in
a real run. The plugin here is a sixth recipe that lives only in tests/fixtures/recipes/ (its YAML and its module)."""
import json

import pytest

from learners.config import ConfigError, load_config
from recipes import Recipe, load_recipe

PROBE = "tests/fixtures/recipes/probe.yaml"


def test_a_config_names_its_plugin_and_the_plugin_checks_its_args():
    cfg = load_config(PROBE)
    recipe = load_recipe(cfg.recipe)
    assert type(recipe).__module__ == "tests.fixtures.recipes.probe" and recipe.args.tag == "answer"
    with pytest.raises(ConfigError, match=r"recipe.args.tagg: Extra inputs are not permitted"):
        load_config(PROBE, ["recipe.args.tagg=x"])
    with pytest.raises(ConfigError, match=r"recipe 'nosuch': no module recipes.nosuch"):
        load_config(PROBE, ["recipe=nosuch"])
    assert type(load_recipe(load_config("configs/tiny.yaml").recipe)) is Recipe  # no recipe: every hook a no-op


@pytest.mark.slow
def test_a_sixth_recipe_runs_through_the_trainer_and_its_hooks_act(ray_session, tmp_path):
    from learners.trainer import Trainer

    cfg = load_config(PROBE, [f"output_dir={tmp_path / 'run'}"])
    history = Trainer(cfg).fit()
    assert [h["probe/steps"] for h in history] == [1, 2]                     # the trainer's per-step hook
    assert all(h["probe/retrievers"] == 1 for h in history)                 # it saw the run's service actors
    assert all(h["probe/episodes"] == 4 for h in history)                   # the rollout hook, in the worker
    assert all(0 <= h["probe/tagged"] <= 4 for h in history)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["probe/episodes"] for line in logged] == [4, 4]
