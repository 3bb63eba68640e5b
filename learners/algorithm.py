"""The RL algorithm as short pure functions on tensors.

Shapes: rewards are [B] with B = num_prompts * group_size, rollouts of one prompt contiguous;
per-token tensors are [B, T] and come with a 0/1 `mask` that is 1 exactly on tokens the policy wrote.
"""
from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] rewards as [B / G, G] float32, one row per prompt."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath).

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      if normalize_std
        A_i =  r_i - mean_g(r)                          otherwise (Dr.GRPO, Liu et al. 2025)

    mean/std run over the G rollouts of the same prompt (std is the population std, as Dr.GRPO
    and TRL's unbiased=False). A group whose rewards are all equal gets A = 0 (no NaN).
    """
    grouped = _groups(rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered.view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

        A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_g(r))

    The baseline of each sample is the mean of the OTHER samples of its prompt, so it is independent of the
    sample and the estimate unbiased; no std division. Needs G >= 2.
    """
    if group_size < 2:
        raise ValueError("rloo needs at least 2 rollouts per prompt (group_size >= 2)")
    grouped = _groups(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).view(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization"): the group mean as baseline, then normalisation over the whole batch.

        A'_i = r_i - mean_g(r)
        A_i  = (A'_i - mean_B(A')) / (std_B(A') + eps)       mean_B(A') = 0: every group's A' sums to 0

    mean_B/std_B run over the B rollouts of the training batch, each counted once (population std). The paper's
    KL penalty goes into the loss here (`kl_beta`), not into the reward. Needs G >= 2 (with G = 1, A' = 0).
    """
    if group_size < 2:
        raise ValueError("reinforce_pp needs at least 2 rollouts per prompt (group_size >= 2)")
    grouped = _groups(rewards, group_size)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    return centered / (centered.std(unbiased=False) + eps)


def compute_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                       normalize_std: bool = True) -> torch.Tensor:
    """[B] advantages of a rollout batch by `estimator`: grpo (`normalize_std` false: Dr.GRPO), rloo or
    reinforce_pp (the functions above)."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, normalize_std)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_size)
    raise ValueError(f"unknown advantage estimator {estimator!r}; use grpo, rloo or reinforce_pp")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1) over `dim` (all elements when None)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str,
                   global_denominator: float | None = None, norm_length: int | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token_mean (DAPO, Yu et al. 2025):      sum_{i,t} l_it m_it / N, with N the number of policy tokens.
    seq_mean (GRPO, Shao et al. 2024):      sum_i [ sum_t l_it m_it / sum_t m_it ] / B, with B sequences.
    token_sum_norm (Dr.GRPO, Liu et al. 2025): sum_{i,t} l_it m_it / (B * L), with L = `norm_length` a constant
                                            (the generation budget), so no rollout's length rescales its tokens.

    By default N and B are this tensor's own. When a batch is split into micro-batches or ranks, pass the
    whole batch's N (token_mean), B (seq_mean) or B * L (token_sum_norm) as `global_denominator`: the parts then
    sum to the loss of the whole batch, and every token (or sequence) weighs the same wherever it landed.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        numerator, default = (per_token * mask).sum(), mask.sum()
    elif mode == "seq_mean":
        numerator, default = masked_mean(per_token, mask, dim=1).sum(), float(per_token.shape[0])
    elif mode == "token_sum_norm":
        if not norm_length:
            raise ValueError("token_sum_norm needs norm_length, the constant L of sum(l) / (B * L)")
        numerator, default = (per_token * mask).sum(), float(per_token.shape[0] * norm_length)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean or token_sum_norm")
    denominator = default if global_denominator is None else global_denominator
    return numerator / max(float(denominator), 1.0)


def loss_denominator(mode: str, policy_tokens: list[int], norm_length: int | None = None) -> float:
    """The whole batch's denominator for `aggregate_loss(..., global_denominator=...)`, from each sequence's number
    of policy tokens: N = sum of them (token_mean), B (seq_mean) or B * L (token_sum_norm)."""
    if mode == "token_mean":
        return float(sum(policy_tokens))
    if mode == "seq_mean":
        return float(len(policy_tokens))
    if mode == "token_sum_norm":
        return float(len(policy_tokens) * norm_length)
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean or token_sum_norm")


def mini_batches(batch_size: int, mini_batch_size: int | None) -> list[slice]:
    """Split a rollout batch into the contiguous mini-batches of PPO-style updates (Schulman et al. 2017): one
    optimizer step each, every ratio still taken against the behaviour policy's log-probs. None: one mini-batch."""
    size = mini_batch_size or batch_size
    if batch_size % size:
        raise ValueError(f"mini-batch size {size} does not divide the rollout batch of {batch_size}")
    return [slice(lo, lo + size) for lo in range(0, batch_size, size)]


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None = None,
              level: str = "token") -> torch.Tensor:
    """The log importance ratio per token, [B, T].

        token    (PPO, GRPO):                  log rho_it = logp_it - old_logp_it
        sequence (GSPO, Zheng et al. 2025):    log s_i    = 1/|y_i| sum_t m_it (logp_it - old_logp_it), on every token
                                               of rollout i: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)

    |y_i| = sum_t m_it counts the policy's tokens only (`mask`; None: every token).
    """
    delta = logp - old_logp
    if level == "token":
        return delta
    if level == "sequence":
        mask = torch.ones_like(delta) if mask is None else mask
        return masked_mean(delta, mask, dim=1).unsqueeze(1).expand_as(delta)
    raise ValueError(f"unknown ratio level {level!r}; use token or sequence")


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float, mask: torch.Tensor | None = None,
                      level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, with DAPO's clip-higher (eps_high may exceed eps_low).

        rho = exp(log_ratio(logp, old_logp, mask, level))
        l   = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)

    level token: PPO/GRPO's per-token ratio. level sequence: GSPO's s_i, so a rollout is clipped (or not) as a whole
    and its gradient is s_i A_i times the mean of its tokens' grad log p. With one advantage per rollout this is
    also GSPO-token's gradient (s_it = sg[s_i] * p_it / sg[p_it], Zheng et al. 2025).
    `advantages` is [B] (broadcast to every token of a rollout) or [B, T].
    Returns (per-token loss, per-token 0/1 indicator that the clipped branch was taken).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(log_ratio(logp, old_logp, mask, level))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).to(logp.dtype)


def rollout_correction(learner_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, kind: str,
                       cap: float, level: str = "token") -> tuple[torch.Tensor | None, dict]:
    """Importance weights for the gap between the engine that sampled the tokens and the learner's policy with the
    same weights (different kernels, dtypes), and that gap's statistics.

        rho = exp(learner_logp - engine_logp)                  per token, both under the behaviour weights
        tis: w = min(rho, C)     truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
                                 off-policy RL training"; Espeholt et al. 2018's truncation)
        mis: w = rho if rho <= C else 0                        masked IS: tokens the engine sampled far too
                                                               rarely are left out (TRL's token mask, ICEPOP)
        none: no weights (the PPO ratio is then taken against the engine's log-probabilities)

    level sequence (beside GSPO's ratio): rho is the sequence's geometric mean exp(mean_t log rho_t)
    (:func:`log_ratio`), so a rollout is weighted, truncated or masked as a whole, and w * s_i is, below the cap,
    GSPO's ratio taken against the engine. The statistics stay per token, but for `mismatch_corrected_sum`, which
    counts the tokens of the rollouts whose weight was corrected.

    The weights multiply the surrogate's per-token loss, with the PPO ratio taken against `learner_logp`. Returns
    (weights [B, T] or None, sums over the mask: `mismatch_k3_sum` (k3 of KL(engine || learner), samples from the
    engine), `mismatch_tokens`, `mismatch_max_ratio` (largest rho) and `mismatch_corrected_sum` (tokens capped or
    masked)).
    """
    if kind not in ("none", "tis", "mis"):
        raise ValueError(f"unknown rollout correction {kind!r}; use none, tis or mis")
    with torch.no_grad():
        log_rho = learner_logp - engine_logp
        rho = torch.exp(log_rho)
        rho_at_level = torch.exp(log_ratio(learner_logp, engine_logp, mask, level))  # rho itself at level token
        counted = mask.bool()
        stats = {"mismatch_k3_sum": ((rho - 1 - log_rho) * mask).sum().item(), "mismatch_tokens": mask.sum().item(),
                 "mismatch_max_ratio": rho[counted].max().item() if counted.any() else 1.0,
                 "mismatch_corrected_sum": ((rho_at_level > cap) & counted).sum().item() if kind != "none" else 0.0}
        if kind == "none":
            return None, stats
        weights = rho_at_level.clamp(max=cap) if kind == "tis" \
            else torch.where(rho_at_level <= cap, rho_at_level, torch.zeros_like(rho_at_level))
    return weights, stats


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) (Schulman 2020, used by GRPO).

        k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1   (>= 0, unbiased, low variance)
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32 (no extra copy at temperature 1)."""
    return logits.float() / temperature if temperature != 1.0 else logits.float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position: [B, T, V], [B, T] -> [B, T].

    Dividing by the sampling temperature makes these the log-probabilities of the distribution
    the rollout engine sampled from, so rho = 1 on the first update when weights are in sync.
    """
    return torch.gather(tempered(logits, temperature).log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [B, T, V] -> [B, T]."""
    logp = tempered(logits, temperature).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *, eps_low: float, eps_high: float, loss_agg: str, ref_logp: torch.Tensor | None = None,
              kl_beta: float = 0.0, global_denominator: float | None = None,
              norm_length: int | None = None, is_weights: torch.Tensor | None = None,
              ratio_level: str = "token") -> tuple[torch.Tensor, dict]:
    """The policy objective for one micro-batch: clipped surrogate + beta * k3 KL, masked and aggregated.

        L = agg( w * l_clip + beta * k3 )   with agg = token_mean (DAPO), seq_mean (GRPO) or token_sum_norm (Dr.GRPO)

    `ratio_level` token is GRPO's per-token ratio; sequence is GSPO's (:func:`clipped_surrogate`): the rollout's one
    surrogate sits on each of its tokens, so seq_mean counts it once (GSPO's 1/G sum_i), token_mean weighs it by
    its length |y_i| / N and token_sum_norm by |y_i| / (B * L); the k3 KL stays per token.
    `is_weights` w: the rollout correction's weights (:func:`rollout_correction`, at the same level), 1 when None.
    Returns the scalar loss and detached per-micro-batch statistics (sums, so callers can combine
    micro-batches exactly: divide by `mask_sum`).
    """
    per_token, clipped = clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high, mask, ratio_level)
    if is_weights is not None:
        per_token = per_token * is_weights
    stats = {"mask_sum": mask.sum().item(), "clip_sum": (clipped * mask).sum().item(), "kl_sum": 0.0}
    if ref_logp is not None and kl_beta > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_beta * kl
        stats["kl_sum"] = (kl.detach() * mask).sum().item()
    return aggregate_loss(per_token, mask, loss_agg, global_denominator, norm_length), stats


def sft_loss(logp: torch.Tensor, mask: torch.Tensor,
             global_denominator: float | None = None) -> tuple[torch.Tensor, dict]:
    """Supervised fine-tuning on demonstrations: the negative log-likelihood of the policy's tokens, token-mean.

        L = - sum_{i,t} m_it log p(x_it | x_i,<t) / N,   N = sum m (the whole batch's, via `global_denominator`)

    The mask is the one RL uses, so the prompt and every token the environment inserted (retrieved text, tool
    observations) are context, never targets (as in the cold starts of MedVistaGym and ARMed's SFT stage).
    """
    return aggregate_loss(-logp, mask, "token_mean", global_denominator), \
        {"mask_sum": mask.sum().item(), "clip_sum": 0.0, "kl_sum": 0.0}
