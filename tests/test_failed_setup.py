"""A run whose set-up fails part-way releases everything it had started: no rollout worker, service actor, learner
rank or placement group outlives the error, so the next run in the same Ray finds the cluster free."""
import time

import pytest

from learners.config import load_config


def leftovers(ray) -> tuple[set, set]:
    """Named actors alive, and medray placement groups not removed."""
    actors = set(ray.util.list_named_actors())
    groups = {g["name"] for g in ray.util.placement_group_table().values()
              if g["name"].startswith("medray-") and g["state"] != "REMOVED"}
    return actors, groups


def test_a_learner_group_that_cannot_start_leaves_no_actor_or_placement_group_behind(ray_session, tmp_path,
                                                                                      monkeypatch):
    from learners import run_setup, trainer
    from learners.learner_group import LearnerGroup, LearnerRankFailed

    before = leftovers(ray_session)
    # the learner ranks alone get a model directory that is not there: they start, then fail to load it, after the
    # placement groups, the retriever and the rollout worker have started
    missing = str(tmp_path / "no-model")
    monkeypatch.setattr(run_setup, "LearnerGroup", lambda cfg, placement, model_path, *rest:
                        LearnerGroup(cfg, placement, missing, *rest))
    run = trainer.Trainer(load_config("configs/tiny.yaml", [f"output_dir={tmp_path / 'run'}"]))
    with pytest.raises(LearnerRankFailed):
        run.fit()
    assert run.workers and run.environment is not None  # it got as far as the rollout worker and the retriever
    deadline = time.monotonic() + 60  # Ray ends actors asynchronously
    while leftovers(ray_session) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    actors, groups = leftovers(ray_session)
    assert actors - before[0] == set() and groups - before[1] == set()


def test_a_fleet_that_started_nothing_closes_without_touching_ray():
    from learners.fleet import Fleet

    fleet = Fleet(load_config("configs/tiny.yaml"), ("rollout",))
    fleet.close()  # no placement, no actors: nothing to end
    assert fleet.placement is None and fleet.workers == [] and not fleet.joined
