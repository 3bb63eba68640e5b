"""The RL objectives' pieces against numbers worked out by hand."""
import math

import pytest
import torch

from learners import algorithm as algo


def test_group_advantages_normalised_per_group():
    # group [3, 1, 2, 2]: mean 2, population std sqrt(2/4) = 0.70711
    adv = algo.group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0)
    s = 1 / math.sqrt(0.5)
    # group [1, 0, 0, 1]: mean 0.5, std 0.5
    assert adv.tolist() == pytest.approx([s, -s, 0.0, 0.0, 1.0, -1.0, -1.0, 1.0], abs=1e-6)


def test_dr_grpo_keeps_scale():
    adv = algo.group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=4, normalize_std=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_all_equal_rewards_give_zero_advantage_not_nan():
    adv = algo.group_advantages(torch.tensor([0.7] * 4 + [0.0] * 4), group_size=4)
    assert torch.all(adv == 0)


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="groups of 3"):
        algo.group_advantages(torch.zeros(4), group_size=3)


def test_rloo_baseline_is_the_mean_of_the_other_rollouts():
    adv = algo.rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 1.0]), group_size=4)
    # group [3, 1, 2, 2]: 3 - (1+2+2)/3 = 4/3, 1 - (3+2+2)/3 = -4/3, 2 - (3+1+2)/3 = 0 (twice)
    # group [1, 0, 0, 1]: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3; i.e. G/(G-1) = 4/3 times Dr.GRPO's r - mean
    assert adv.tolist() == pytest.approx([4 / 3, -4 / 3, 0.0, 0.0, 2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)
    with pytest.raises(ValueError, match="group_size >= 2"):
        algo.rloo_advantages(torch.zeros(4), group_size=1)


def test_reinforce_pp_divides_by_the_batch_std_not_the_group_s():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0, 1.0, 0.0, 0.0, 1.0])
    adv = algo.reinforce_pp_advantages(rewards, group_size=4, eps=0.0)
    # minus the group means (2, 0.5): [1, -1, 0, 0, .5, -.5, -.5, .5], batch mean 0,
    # population variance (1 + 1 + 4 * .25) / 8 = 3/8: every value divided by sqrt(3/8) = 0.612372
    s = 1 / math.sqrt(3 / 8)
    assert adv.tolist() == pytest.approx([s, -s, 0.0, 0.0, s / 2, -s / 2, -s / 2, s / 2], abs=1e-6)
    # GRPO's per-group std makes both groups +-1-ish; the batch std keeps the first group's spread twice the second's
    assert torch.all(algo.reinforce_pp_advantages(torch.tensor([0.7] * 4 + [0.0] * 4), group_size=4) == 0)


def test_one_dispatch_point_for_the_advantage_estimators():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert algo.compute_advantages(rewards, 4, "grpo", normalize_std=False).tolist() == [1.0, -1.0, 0.0, 0.0]
    assert algo.compute_advantages(rewards, 4, "rloo").tolist() == pytest.approx([4 / 3, -4 / 3, 0.0, 0.0])
    # the lone group: centred [1, -1, 0, 0], population std sqrt(1/2)
    assert algo.compute_advantages(rewards, 4, "reinforce_pp").tolist() == \
        pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match="grpo, rloo or reinforce_pp"):
        algo.compute_advantages(rewards, 4, "ppo")


def test_clipped_surrogate_clip_higher():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, clipped = algo.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28)
    # A>0, rho 1.5 -> clipped at 1+0.28; A<0, rho 1.5 -> unclipped -1.5 is the min; A<0, rho 0.5 -> clipped at 0.8
    assert loss.tolist()[0] == pytest.approx([-1.28, 1.5, 0.8], abs=1e-6)
    assert clipped.tolist()[0] == [1.0, 0.0, 1.0]


def test_gspo_clips_a_rollout_as_a_whole_on_the_mean_log_ratio():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, 0.4, 5.0], [-0.1, 0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, clipped = algo.clipped_surrogate(logp, old, torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.28,
                                           mask=mask, level="sequence")
    # rollout 1: s = exp((0.2 + 0.4) / 2) = exp(0.3) = 1.34986 (the masked 5.0 left out), A = 1 -> clipped at 1.28
    # on every token, though token 1 alone (rho = exp(0.2) = 1.2214) is inside the range;
    # rollout 2: s = exp(0) = 1, A = -1 -> loss 1, unclipped
    assert loss.flatten().tolist() == pytest.approx([-1.28] * 3 + [1.0] * 3, abs=1e-6)
    assert clipped.tolist() == [[1.0] * 3, [0.0] * 3]
    assert algo.log_ratio(logp, old, mask, "sequence")[0].tolist() == pytest.approx([0.3] * 3)
    with pytest.raises(ValueError, match="token or sequence"):
        algo.log_ratio(logp, old, mask, "step")


def test_gspo_gives_every_token_of_a_rollout_the_same_gradient():
    logp = torch.tensor([[0.1, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = algo.grpo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2,
                             loss_agg="seq_mean", ratio_level="sequence")
    loss.backward()
    # L = -s A with s = exp((0.1 - 0.1) / 2) = 1: dL/dlogp_t = -s A / |y| = -1/2 on both policy tokens, 0 on the other
    # (the token ratio would give -exp(0.1)/2 = -0.5526 and -exp(-0.1)/2 = -0.4524)
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -0.5, 0.0])


def test_gspo_with_each_loss_aggregation():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])

    def loss(agg):
        return algo.grpo_loss(torch.zeros(2, 2), torch.zeros(2, 2), adv, mask, eps_low=0.2, eps_high=0.2,
                              loss_agg=agg, ratio_level="sequence", norm_length=4)[0].item()
    # s = 1 for both: rollout losses -1 (2 tokens) and 2 (1 token)
    assert loss("seq_mean") == pytest.approx((-1 + 2) / 2)         # each rollout once: GSPO's 1/G sum_i
    assert loss("token_mean") == pytest.approx((-1 * 2 + 2) / 3)   # each weighed by its length
    assert loss("token_sum_norm") == pytest.approx((-1 * 2 + 2) / (2 * 4))


def test_sequence_level_rollout_correction_weighs_a_rollout_as_a_whole():
    learner = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.9)], [math.log(0.3), math.log(0.3), 0.0]])
    engine = torch.tensor([[math.log(0.5), math.log(0.1), math.log(0.6)], [math.log(0.1), math.log(0.1), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # token rho: [1, 3, 1.5] and [3, 3]; geometric means (1 * 3 * 1.5)^(1/3) = 4.5^(1/3) = 1.65096 and 3
    tis, stats = algo.rollout_correction(learner, engine, mask, "tis", cap=2.0, level="sequence")
    g = 4.5 ** (1 / 3)
    assert tis.flatten().tolist() == pytest.approx([g] * 3 + [2.0] * 3, abs=1e-5)
    mis, _ = algo.rollout_correction(learner, engine, mask, "mis", cap=2.0, level="sequence")
    assert mis.flatten().tolist() == pytest.approx([g] * 3 + [0.0] * 3, abs=1e-5)
    # the gap is measured per token; the corrected count is the 2 policy tokens of the capped rollout
    assert stats["mismatch_max_ratio"] == pytest.approx(3.0) and stats["mismatch_corrected_sum"] == 2


def test_gspo_ratio_times_the_sequence_correction_is_gspo_s_ratio_against_the_engine():
    engine = torch.tensor([[math.log(0.5), math.log(0.1)]])
    behaviour = torch.tensor([[math.log(0.5), math.log(0.3)]])
    logp = behaviour + torch.tensor([[0.02, 0.0]])
    mask = torch.ones(1, 2)
    w, _ = algo.rollout_correction(behaviour, engine, mask, "tis", cap=2.0, level="sequence")
    loss, _ = algo.grpo_loss(logp, behaviour, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2,
                             loss_agg="seq_mean", is_weights=w, ratio_level="sequence")
    # w = sqrt(1 * 3) = 1.73205 (< cap), s = exp(0.02 / 2) = 1.01005 (inside the clip range): L = -w s A = -1.74946,
    # and w s = exp(mean(logp - engine)) = exp((0.02 + ln 3) / 2)
    assert loss.item() == pytest.approx(-math.exp((0.02 + math.log(3)) / 2), abs=1e-5)
    assert loss.item() == pytest.approx(-1.74946, abs=1e-5)


def test_k3_kl():
    kl = algo.k3_kl(torch.tensor([0.0, -1.0]), torch.tensor([math.log(0.5), -1.0]))
    # exp(d) - d - 1 with d = ln 0.5: 0.5 + 0.693147 - 1
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)


def test_token_mean_and_seq_mean():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert algo.aggregate_loss(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert algo.aggregate_loss(per_token, mask, "seq_mean").item() == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("mode,denominator", [("token_mean", 4), ("seq_mean", 2)])
def test_micro_batches_sum_to_batch_loss(mode, denominator):
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = algo.aggregate_loss(per_token, mask, mode)
    parts = sum(algo.aggregate_loss(per_token[i:i + 1], mask[i:i + 1], mode, denominator) for i in range(2))
    assert parts.item() == pytest.approx(whole.item())


def test_masked_tokens_get_no_gradient():
    """Environment tokens (mask 0) change neither the loss nor receive gradient."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = algo.grpo_loss(logp, old, torch.tensor([0.5]), mask, eps_low=0.2, eps_high=0.2,
                                 loss_agg="token_mean")
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0
    assert stats["mask_sum"] == 2.0
    # rho = exp(0.1) = 1.105 (inside the clip range) and 1.0: loss = -(0.5 * 1.10517 + 0.5 * 1) / 2
    assert loss.item() == pytest.approx(-(0.5 * math.exp(0.1) + 0.5) / 2, abs=1e-6)


def test_kl_term_added_with_beta():
    logp = torch.zeros(1, 2)
    ref = torch.full((1, 2), math.log(0.5))
    loss, stats = algo.grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), eps_low=0.2, eps_high=0.2,
                                 loss_agg="token_mean", ref_logp=ref, kl_beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)
    assert stats["kl_sum"] == pytest.approx(2 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = algo.token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    # softmax([1, 0])[0] = e / (e + 1)
    assert lp.item() == pytest.approx(math.log(math.e / (math.e + 1)), abs=1e-6)
    ent = algo.token_entropy(torch.zeros(1, 1, 4))
    assert ent.item() == pytest.approx(math.log(4), abs=1e-6)


def test_auto_compute_dtype_is_bfloat16_only_where_the_device_multiplies_it_natively():
    """learner.compute_dtype=auto (the quickstart's): bfloat16 on a CPU with AVX512-BF16/AMX or a bf16 GPU, float32 on
    an AVX2-only CPU, where emulated bfloat16 would be tens of times slower."""
    from cluster.devices import fast_bfloat16, resolve_compute_dtype
    native = fast_bfloat16("cpu")
    assert resolve_compute_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_compute_dtype("float32", "cpu") == "float32"
    assert resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_dr_grpo_constant_normaliser():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # (1 + 2 + 3 + 4) / (B * L) with B = 2 sequences and the constant L = 5, whatever the rollouts' lengths
    assert algo.aggregate_loss(per_token, mask, "token_sum_norm", norm_length=5).item() == pytest.approx(10 / 10)
    parts = sum(algo.aggregate_loss(per_token[i:i + 1], mask[i:i + 1], "token_sum_norm",
                                    algo.loss_denominator("token_sum_norm", [3, 1], norm_length=5), norm_length=5)
                for i in range(2))
    assert parts.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="norm_length"):
        algo.aggregate_loss(per_token, mask, "token_sum_norm")


def test_loss_denominators_of_a_batch():
    assert algo.loss_denominator("token_mean", [3, 1]) == 4
    assert algo.loss_denominator("seq_mean", [3, 1]) == 2
    assert algo.loss_denominator("token_sum_norm", [3, 1], norm_length=64) == 128


def test_mini_batches_split_a_rollout_batch_contiguously():
    assert algo.mini_batches(8, 4) == [slice(0, 4), slice(4, 8)]
    assert algo.mini_batches(8, None) == [slice(0, 8)]
    with pytest.raises(ValueError, match="does not divide"):
        algo.mini_batches(8, 3)
