"""The GRPO pieces against numbers worked out by hand."""
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


def test_clipped_surrogate_clip_higher():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, clipped = algo.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28)
    # A>0, rho 1.5 -> clipped at 1+0.28; A<0, rho 1.5 -> unclipped -1.5 is the min; A<0, rho 0.5 -> clipped at 0.8
    assert loss.tolist()[0] == pytest.approx([-1.28, 1.5, 0.8], abs=1e-6)
    assert clipped.tolist()[0] == [1.0, 0.0, 1.0]


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
