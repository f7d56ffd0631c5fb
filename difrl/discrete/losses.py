"""Masked-diffusion objectives: the MDLM / LLaDA-SFT loss and its forward (masking) process.

    t = sample_t(batch, generator)                              # antithetic t in [eps, 1], [B]
    noisy, masked = forward_mask(tokens, answer, t, mask_id, generator)   # answer positions masked w.p. t
    loss = mdlm_loss(policy.logits(noisy, cond), tokens, masked, t, answer)

Linear schedule alpha_t = 1 - t (spec section 1): each answer token is replaced by the mask with
probability t, the prompt never. The NELBO is E_t E_z [(1/t) sum_{k masked} -log p(x_k | z)];
``mdlm_loss`` is its per-sample estimate divided by the number of answer positions (LLaDA SFT;
``normalize="tokens"`` divides by all L positions instead, LLaDA pretraining), averaged over the batch.
"""

from __future__ import annotations

import torch

T_EPS = 1e-3  # t = (1 - eps) u + eps: the masking probability never reaches 0


def sample_t(batch: int, generator: torch.Generator | None = None, eps: float = T_EPS,
             antithetic: bool = True) -> torch.Tensor:
    """[B] fp32 noise levels in [eps, 1]. Antithetic (MDLM _sample_t): t_i = (u / n + i / n) mod 1 for
    one u ~ U(0, 1), i.e. one draw per stratum; otherwise i.i.d. uniform. Then (1 - eps) t + eps."""
    if antithetic:
        u = torch.rand((), generator=generator)
        t = (u / batch + torch.arange(batch, dtype=torch.float32) / batch) % 1.0
    else:
        t = torch.rand(batch, generator=generator)
    return (1.0 - eps) * t + eps


def forward_mask(tokens: torch.Tensor, answer: torch.Tensor, t: torch.Tensor, mask_id: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each answer position ([B, L] bool) independently with probability t ([B]); the prompt
    (~answer) is never masked. Returns (noisy tokens [B, L], masked [B, L] bool)."""
    u = torch.rand(tokens.shape, generator=generator)
    masked = answer.bool() & (u < t.float()[:, None])
    return tokens.masked_fill(masked, mask_id), masked


def mdlm_loss(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, t: torch.Tensor,
              answer: torch.Tensor | None = None, normalize: str = "answer") -> torch.Tensor:
    """Masked-token cross-entropy weighted by 1/t: mean_b [ sum_{k masked} CE_bk / t_b ] / n_b with
    n_b = number of answer positions of row b ('answer') or L ('tokens'). logits [B, L, V]; the loss is computed
    on the logits' device (the [B, L] / [B] operands are moved there)."""
    dev = logits.device
    targets, masked, t = targets.to(dev), masked.to(dev), t.to(dev)
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    ce = ce.view(targets.shape) * masked.float()
    per_row = ce.sum(1) / t.float()
    if normalize == "answer":
        if answer is None:
            raise ValueError("normalize='answer' needs the answer mask")
        n = answer.to(dev).float().sum(1).clamp_min(1.0)
    elif normalize == "tokens":
        n = torch.full_like(per_row, float(targets.shape[1]))
    else:
        raise ValueError(f"unknown normalize {normalize!r}; expected 'answer' or 'tokens'")
    return (per_row / n).mean()


# ----------------------------------------------------------------------------- RL re-masking schedules
# Spec section 3. Every mask below is a pure function of (rollout seed, inner iteration n, position)
# through counter_uniform, so the old, reference and current log-probs of iteration n see the same
# mask by construction (spec section 6, item 1). The prompt is never masked, except by d1's optional
# prompt masking.
def mask_uniforms(seeds: torch.Tensor, iteration: int, length: int, stream: int = 11) -> torch.Tensor:
    """[B, L] fp64 uniforms for inner iteration `iteration`'s re-mask (see difrl.discrete.samplers)."""
    from difrl.discrete.samplers import counter_uniform

    return counter_uniform(torch.as_tensor(seeds, dtype=torch.int64), stream, iteration, length)


def maskgrpo_ratios(mu: int, min_mask_rate: float = 0.6) -> torch.Tensor:
    """[mu] fp64 MaskGRPO / MaskGRPO-uni mask ratios r_n = min(c + (1 - c) n / mu, 0.999), n = 1..mu."""
    n = torch.arange(1, mu + 1, dtype=torch.float64)
    return (min_mask_rate + (1.0 - min_mask_rate) * n / mu).clamp_max(0.999)


def unigrpo_ratios(seeds: torch.Tensor, n: int, mu: int, timesteps: int = 1000, stream: int = 12) -> torch.Tensor:
    """[B] fp64 UniGRPO mask ratios of inner update n (1-based) of mu, per sample (MMaDA section 3.2,
    "structured noising"): a random start t_1 = floor(r T), r ~ U(0, 1) from the sample's seed, then
    t_n = floor((n - 1) / (mu - 1) (T - t_1) + t_1), ratio t_n / T, clamped to [1 / T, 1]. Over the mu
    updates each sample sweeps from its own random start up to fully masked: a stratified Monte Carlo
    over noise levels. (The spec's worked example, start 100 and mu = 5 giving 100, 300, ..., 900,
    does not follow from this formula, which gives 100, 325, 550, 775, 1000; we implement the formula.)"""
    from difrl.discrete.samplers import counter_uniform

    if not 1 <= n <= mu:
        raise ValueError(f"inner update n={n} is outside 1..{mu}")
    r = counter_uniform(torch.as_tensor(seeds, dtype=torch.int64), stream, 0, 1)[:, 0]
    t1 = torch.floor(r * timesteps)
    frac = (n - 1) / (mu - 1) if mu > 1 else 0.0
    tn = torch.floor(frac * (timesteps - t1) + t1)
    return (tn / timesteps).clamp(1.0 / timesteps, 1.0)


def trace_inputs(tokens: torch.Tensor, gen: torch.Tensor, step: torch.Tensor, s: int, mask_id: int) -> torch.Tensor:
    """The context in which a rollout committed its step-s tokens: every generated position committed at
    step >= s is masked again, everything committed earlier (and the prompt) is visible. [B, L] long."""
    return tokens.masked_fill(gen.bool() & (step >= s), mask_id)


def answer_index(answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, each answer position's order i = 0..N_b - 1 among the answer positions ([B, L] long, -1
    elsewhere) and N_b ([B] long)."""
    a = answer.bool()
    idx = torch.where(a, a.long().cumsum(1) - 1, torch.full_like(a, -1, dtype=torch.long))
    return idx, a.sum(1)


def ar_fade_keep_prob(answer: torch.Tensor, ratio: float) -> torch.Tensor:
    """MaskGRPO text ('arlike') keep probability of answer position i of N:
    kappa_i = min(1, 2 (1 - r) (1 - i / (N - 1))); 0 outside the answer (never kept = not applicable) and
    0 for a one-token answer (the last position is always masked)."""
    idx, n = answer_index(answer)
    frac = idx.double() / (n[:, None].double() - 1).clamp_min(1.0)
    kappa = (2.0 * (1.0 - ratio) * (1.0 - frac)).clamp(0.0, 1.0)
    kappa = torch.where(n[:, None] > 1, kappa, torch.zeros_like(kappa))
    return torch.where(answer.bool(), kappa, torch.zeros_like(kappa))


def ar_fade_mask(answer: torch.Tensor, ratio: float, u: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: answer position i is masked with probability 1 - kappa_i (u [B, L] uniforms)."""
    return answer.bool() & (u >= ar_fade_keep_prob(answer, ratio))


def uniform_mask(answer: torch.Tensor, ratio: float, u: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: i.i.d. Bernoulli(r) over the answer (MaskGRPO image tokens; UniGRPO / MaskGRPO 'random')."""
    return answer.bool() & (u < ratio)


def d1_mask(answer: torch.Tensor, prompt: torch.Tensor, u: torch.Tensor, p_mask_prompt: float = 0.15) -> torch.Tensor:
    """[B, L] bool, diffu-GRPO: every answer token masked, each prompt token masked with p_mask_prompt."""
    return answer.bool() | (prompt.bool() & (u < p_mask_prompt))


def coupled_masks(answer: torch.Tensor, t: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """coupled-GRPO views (t ~ U(0.2, 0.8) drawn by the caller): (full, A, B, weight), all [B, L]:
    full = every answer token, A = answer with u < t, B = its complement in the answer, and the
    weight of each answer token in the view where it is masked, 1/t in A and 1/(1 - t) in B."""
    a = answer.bool()
    view_a = a & (u < t)
    view_b = a & ~view_a
    weight = torch.where(view_a, 1.0 / t, 0.0) + torch.where(view_b, 1.0 / (1.0 - t), 0.0)
    return a, view_a, view_b, weight.float()


__all__ = ["T_EPS", "trace_inputs", "trace_logp", "unigrpo_ratios", "answer_index", "ar_fade_keep_prob", "ar_fade_mask", "coupled_masks", "d1_mask", "forward_mask",
           "mask_uniforms", "maskgrpo_ratios", "mdlm_loss", "sample_t", "uniform_mask"]


@torch.no_grad()
def trace_logp(policy, tokens: torch.Tensor, gen: torch.Tensor, step: torch.Tensor, cond: dict | None = None) -> torch.Tensor:
    """[B, L] fp32 log-prob of each generated token in the context the rollout committed it in
    (``trace_inputs``; TraceRL's trajectory-consistent likelihood, spec section 3.7), 0 elsewhere:
    one forward per distinct commit step. It is what the behaviour policy's recorded log-prob is
    compared with when a rollout came from another policy (importance correction). The log-softmax runs on the
    policy's device; only each step's [rows, L] log-probs come back to `tokens`' device."""
    from difrl.models.base import cond_select

    gen = gen.bool()
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    for s in torch.unique(step[gen]).tolist():
        here = gen & (step == s)
        rows = here.any(1).nonzero().flatten()
        x = trace_inputs(tokens[rows], gen[rows], step[rows], int(s), policy.mask_id)
        logits = policy.logits(x, None if cond is None else cond_select(cond, rows))  # [rows, L, V] on the device
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[rows, :, None].to(logits.device))[..., 0]
        out[rows] = torch.where(here[rows], lp.to(out.device), out[rows])
    return out
