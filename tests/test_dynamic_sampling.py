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
