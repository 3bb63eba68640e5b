"""The learner's micro-batches: packed sequences, log-probabilities a chunk of positions at a time, ranks' shares,
and the rollout correction, checked against the plain computation and hand-computed numbers."""
import math

import pytest
import torch

from actors.trajectory import Trajectory
from learners import algorithm as algo
from learners import batches
from learners.batches import deal_micro_batches, forward_logp, load_causal_lm, micro_batch

SHAPES = [(7, [1, 1, 0, 1]), (4, [1, 1]), (9, [1, 0, 0, 1, 1, 1])]  # (prompt length, response loss mask)


def trajectories(shapes=SHAPES) -> list[Trajectory]:
    return [Trajectory(task={}, group=0, prompt_ids=list(range(10 + i, 10 + i + p)),
                       response_ids=list(range(50 + i, 50 + i + len(m))),
                       logprobs=[-0.1 * (k + 1) for k in range(len(m))], loss_mask=m, text="", finish_reason="stop",
                       weight_version=0) for i, (p, m) in enumerate(shapes)]


def padded_logits(model, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain computation: right-padded rows with an attention mask, the logits of every position over the whole
    vocabulary; returns (logits predicting tokens 1.., those tokens)."""
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], attention[i, :len(s)] = torch.tensor(s), 1
    return model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(str(tiny_model_path), torch.float32)


def test_a_text_micro_batch_is_one_packed_row_with_no_padding():
    trajs = trajectories()
    batch = micro_batch(trajs, pad_id=0)
    lengths = [p + len(m) for p, m in SHAPES]
    assert batch["input_ids"].shape == (1, sum(lengths))  # no padding token anywhere
    assert batch["cu_seq_lens_q"].tolist() == [0, 11, 17, 32]
    assert batch["position_ids"][0, 11:17].tolist() == list(range(6))  # each sequence's positions start at 0
    assert batch["mask"].shape == (3, 6) and batch["mask"][1].tolist() == [1, 1, 0, 0, 0, 0]
    # sequence 1's first response token (at flat position 11 + 4) is predicted by the position before it
    assert batch["at"][1, :2].tolist() == [14, 15]
    assert batch["targets"][1, :2].tolist() == trajs[1].response_ids
    assert batch["old_logp"][2].tolist() == pytest.approx(trajs[2].logprobs)


def test_packed_chunked_logprobs_and_gradients_equal_the_padded_whole_logits_ones(model, monkeypatch):
    """The learner's forward (packed sequences, varlen attention, the LM head on the loss's positions only, 2
    positions of logits at a time, recomputed in backward) gives the plain computation's values and gradients."""
    monkeypatch.setattr(batches, "LOGIT_CHUNK", 2)
    trajs = trajectories()
    batch = micro_batch(trajs, pad_id=0)
    coef = torch.randn(batch["mask"].shape, generator=torch.Generator().manual_seed(0))

    model.zero_grad()
    logp, entropy = forward_logp(model, batch, with_entropy=True, temperature=0.7)
    (logp * coef * batch["mask"]).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    logits, targets = padded_logits(model, trajs)  # the plain computation, at the same temperature
    full = algo.token_logprobs(logits, targets, temperature=0.7)
    full_entropy = algo.token_entropy(logits.detach(), temperature=0.7)
    loss = 0
    for i, t in enumerate(trajs):
        n, first = len(t.response_ids), len(t.prompt_ids) - 1
        m = batch["mask"][i, :n]
        assert torch.allclose(logp[i, :n] * m, full[i, first:first + n] * m, atol=1e-5)
        assert torch.allclose(entropy[i, :n] * m, full_entropy[i, first:first + n] * m, atol=1e-5)
        loss = loss + (full[i, first:first + n] * coef[i, :n] * m).sum()
    loss.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(ours[name], param.grad, atol=1e-5), name
    counted = batch["mask"] != 0  # entropy is a statistic of the loss's tokens only
    assert (entropy[counted] > 0).all() and (entropy[~counted] == 0).all()


def test_varlen_attention_keeps_each_packed_sequence_to_itself(model):
    """A sequence's log-probabilities are the same alone and packed behind another one."""
    from learners.attention import VARLEN
    assert model.config._attn_implementation == VARLEN
    a, b = trajectories()[:2]
    with torch.no_grad():
        alone = forward_logp(model, micro_batch([b], pad_id=0), False, 1.0)[0]
        packed = forward_logp(model, micro_batch([a, b], pad_id=0), False, 1.0)[0]
        logits, targets = padded_logits(model, [b])
        plain = algo.token_logprobs(logits, targets)[0, len(b.prompt_ids) - 1:]
    assert torch.allclose(packed[1, :2], alone[0, :2], atol=1e-5)
    assert torch.allclose(alone[0, :2], plain, atol=1e-5)


def test_learner_forward_in_bfloat16_autocast_keeps_float32_weights_and_logprobs(model):
    """learner.compute_dtype=bfloat16: the matmuls run in bfloat16, the logprobs come back in float32 within bfloat16
    rounding of the float32 forward, and the gradients land on the float32 weights."""
    traj = Trajectory(task={}, group=0, prompt_ids=list(range(10, 30)), response_ids=list(range(50, 58)),
                      logprobs=[0.0] * 8, loss_mask=[1] * 8, text="", finish_reason="stop", weight_version=0)
    batch = micro_batch([traj], pad_id=0)
    model.zero_grad()
    exact, _ = forward_logp(model, batch, with_entropy=False, temperature=1.0)
    mixed, _ = forward_logp(model, batch, with_entropy=False, temperature=1.0, compute_dtype=torch.bfloat16)
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, exact)  # bfloat16 rounding did happen
    assert torch.allclose(mixed, exact, atol=0.1)
    mixed.sum().backward()
    weight = model.get_input_embeddings().weight
    assert weight.dtype == torch.float32 and weight.grad is not None and weight.grad.dtype == torch.float32


def test_ranks_get_equal_shares_balanced_by_tokens_and_the_same_number_of_micro_batches():
    lengths = [100, 90, 80, 70, 10, 10, 10, 10]
    plans = deal_micro_batches(lengths, world_size=2, micro_batch_size=2)
    assert sorted(i for plan in plans for mb in plan for i in mb) == list(range(8))
    assert [sum(len(mb) for mb in plan) for plan in plans] == [4, 4]
    # longest first to the emptier rank: 100+70+10+10 and 90+80+10+10
    assert [sum(lengths[i] for mb in plan for i in mb) for plan in plans] == [190, 190]
    assert [len(plan) for plan in plans] == [2, 2]


def test_a_token_budget_cuts_micro_batches_and_ranks_still_match():
    lengths = [100, 100, 100, 100, 30, 20]
    plans = deal_micro_batches(lengths, world_size=2, micro_batch_size=8, max_tokens=150)
    for plan in plans:
        assert all(sum(lengths[i] for i in mb) <= 150 for mb in plan)
    assert len(plans[0]) == len(plans[1])  # every backward is a collective under ZeRO-2
    one = deal_micro_batches([10, 10, 10, 500], world_size=1, micro_batch_size=8, max_tokens=500)
    assert one == [[[3], [0, 1, 2]]]


def test_rollout_correction_weights_by_hand():
    learner = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.9)]])
    engine = torch.tensor([[math.log(0.5), math.log(0.1), math.log(0.6)]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    # rho = 1, 3, 1.5
    tis, stats = algo.rollout_correction(learner, engine, mask, "tis", cap=2.0)
    assert tis.tolist()[0] == pytest.approx([1.0, 2.0, 1.5])
    mis, _ = algo.rollout_correction(learner, engine, mask, "mis", cap=2.0)
    assert mis.tolist()[0] == pytest.approx([1.0, 0.0, 1.5])
    assert stats["mismatch_max_ratio"] == pytest.approx(3.0)
    assert stats["mismatch_corrected_sum"] == 1
    # k3 = rho - 1 - log rho summed: 0 + (2 - log 3) + (0.5 - log 1.5)
    assert stats["mismatch_k3_sum"] == pytest.approx(2 - math.log(3) + 0.5 - math.log(1.5), abs=1e-6)
    none, stats = algo.rollout_correction(learner, engine, mask, "none", cap=2.0)
    assert none is None and stats["mismatch_corrected_sum"] == 0
    with pytest.raises(ValueError, match="tis or mis"):
        algo.rollout_correction(learner, engine, mask, "clip", cap=2.0)


def test_grpo_loss_weights_each_token_by_the_correction():
    logp = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[2.0, 0.0]])
    loss, _ = algo.grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), eps_low=0.2,
                             eps_high=0.2, loss_agg="token_mean", is_weights=weights)
    loss.backward()
    # l = -(w * rho * A) per token, token mean over 2: d/dlogp = -w * A / 2
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 0.0])
