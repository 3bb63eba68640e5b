"""DAPO's dynamic sampling: groups whose rewards are all equal are dropped and refilled from further rounds."""
from learners.dynamic_sampling import count_informative, fill_batch, informative

# three groups of two: [1, 1] flat, [0, 1] informative, [0, 0] flat
FIRST = (list("abcdef"), [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
# a second round: [0.5, 0.5] flat, [1, 0] and [0.2, 0.3] informative
SECOND = (list("ghijkl"), [0.5, 0.5, 1.0, 0.0, 0.2, 0.3])


def test_only_groups_whose_rewards_differ_are_informative():
    assert informative(FIRST[1], 2) == [1] and informative(SECOND[1], 2) == [1, 2]
    assert count_informative([FIRST, SECOND], 2) == 3


def test_the_batch_fills_with_informative_groups_round_by_round():
    trajs, totals, stats = fill_batch([FIRST, SECOND], 2, 3)
    assert trajs == list("cdijkl") and totals == [0.0, 1.0, 1.0, 0.0, 0.2, 0.3]
    assert stats == {"groups_filtered": 3, "groups_padded": 0}


def test_a_batch_still_short_after_the_last_round_keeps_its_size_with_dropped_groups():
    trajs, totals, stats = fill_batch([FIRST], 2, 3)
    assert trajs == list("cdabef") and len(totals) == 6
    assert stats == {"groups_filtered": 2, "groups_padded": 2}


def scored(totals, accuracy, seconds=1.0):
    """A reward actor's score dict for one share of samples."""
    return {"total": totals, "components": {"accuracy": accuracy}, "errors": {}, "seconds": seconds}


def test_the_logged_reward_is_over_every_group_sampled_and_the_kept_groups_are_logged_apart():
    from learners.metrics import kept_metrics, reward_metrics
    # round 1, two shards: groups [1, 1] flat, [0, 1] informative | [0, 0] flat; round 2: [1, 0] informative, [1, 1]
    first = [scored([1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]), scored([0.0, 0.0], [0.0, 0.0])]
    second = [scored([1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0])]
    sampled = reward_metrics(first + second)  # the default keys: all 10 samples of both rounds
    assert sampled["reward_mean"] == sampled["accuracy"] == 0.6
    kept = kept_metrics([first, second], group_size=2, num_groups=2)  # groups [0, 1] and [1, 0]
    assert kept["reward_mean_kept"] == kept["accuracy_kept"] == kept["reward/accuracy_kept"] == 0.5
    assert kept["reward_std_kept"] == 0.5 and not any(k in kept for k in ("reward_mean", "accuracy"))
    # a batch still short keeps the first round's flat groups: they count as kept
    assert kept_metrics([first], group_size=2, num_groups=3)["reward_mean_kept"] == 0.5


def test_the_trainer_reports_every_round_sampled_and_trains_on_the_kept_groups(monkeypatch):
    """Trainer.training_batch with dynamic sampling, its actors replaced by the rounds above: the score dicts it hands
    the step's metrics are both rounds', the `_kept` columns those of the batch it trains on."""
    from types import SimpleNamespace

    import ray

    from learners.metrics import reward_metrics
    from learners.trainer import StepRollouts, Trainer

    first = [scored([1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]), scored([0.0, 0.0], [0.0, 0.0])]
    second = [scored([1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0])]
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the "refs" below are the shares themselves
    monkeypatch.setattr(ray, "put", lambda value: value)
    trainer = Trainer.__new__(Trainer)
    trainer.stage_cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=2, prompts_per_step=2),
                                        algorithm=SimpleNamespace(dynamic_sampling=True, max_extra_rounds=2))
    trainer.start_rollouts = lambda step, refill_round: StepRollouts(step, 0, [list("ghij")], [], [])
    trainer.collect = lambda rollouts: []
    trainer.score = lambda rollouts: second
    batch = trainer.training_batch(StepRollouts(0, 0, [list("abcd"), list("ef")], [], []), first)
    assert batch.trajectories == [list("cdgh")] and batch.totals == [0.0, 1.0, 1.0, 0.0]
    assert batch.sampled == first + second
    # the batch's own score dicts, in its order
    assert batch.trained[0]["total"] == batch.totals and batch.trained[0]["components"]["accuracy"] == batch.totals
    assert reward_metrics(batch.sampled)["reward_mean"] == 0.6 and batch.sampling["reward_mean_kept"] == 0.5
    assert batch.sampling["extra_generation_rounds"] == 1 and batch.sampling["groups_filtered"] == 3
