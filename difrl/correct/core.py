"""Importance-sampling correctors for rollout/train policy mismatch (docs/reference/specs/lowprec-and-correctors.md §5).

    from difrl.correct import token_tis, seq_mis, ais
    c = token_tis(log_prob, log_prob_rollout, mask, cap=2.0)     # [B, T] each
    loss = -(c.weights * advantages[:, None] * log_prob_new).sum() / c.keep.sum()
    c.diagnostics                                                 # ess_frac, max_weight, masked_frac, ...

Pure torch; nothing from diffusers or the rest of difrl, so an LLM trainer uses it as is. A
"token" is an LLM token, a denoising step or an unmasking step; a "sequence" is the whole
response or trajectory. Inputs are ``[B, T]`` fp32 log-probs of the policy being corrected
towards (``log_prob``: the trainer's proximal policy, or the current one in bypass mode) and of
the policy that produced the rollout (``log_prob_rollout``), and a validity ``mask`` ``[B, T]``
(padding is False). For diffusion pass per-element-*mean* log-probs (spec §5.4): with sums over a
latent, log-ratios are in the hundreds and every threshold below masks or clips everything.

Every weight-producing method returns a :class:`Correction`: detached ``weights`` [B, T] (0 at
invalid or rejected positions), a ``keep`` mask [B, T] (valid and not rejected) and 0-dim
diagnostics. Weights are always detached: the IS weight is a constant of the estimator, its
gradient would be a different (wrong) objective (verl's derivation, spec §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAFETY_BOUND = 20.0  # |log ratio| bound before exp (verl), so exp never overflows in fp32


@dataclass
class Correction:
    weights: torch.Tensor  # [B, T] detached, 0 where not kept
    keep: torch.Tensor  # [B, T] bool
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)


def _check(log_prob: torch.Tensor, log_prob_rollout: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if log_prob.shape != log_prob_rollout.shape or log_prob.ndim != 2:
        raise ValueError(f"log_prob and log_prob_rollout must both be [B, T]; got {tuple(log_prob.shape)} and "
                         f"{tuple(log_prob_rollout.shape)}")
    if mask is None:
        return torch.ones_like(log_prob, dtype=torch.bool)
    if mask.shape != log_prob.shape:
        raise ValueError(f"mask must be [B, T] = {tuple(log_prob.shape)}, got {tuple(mask.shape)}")
    return mask.bool()


def log_ratio(log_prob: torch.Tensor, log_prob_rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] detached fp32 log rho = log pi - log mu, 0 at invalid positions (so padding never counts)."""
    lr = (log_prob.detach().float() - log_prob_rollout.detach().float())
    return torch.where(mask, lr, torch.zeros_like(lr))


def seq_log_ratio(lr: torch.Tensor, mask: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """[B]: sum (the true trajectory ratio) or mean (geometric mean, length-invariant) of log rho over valid steps."""
    s = lr.sum(1)
    if reduce == "sum":
        return s
    if reduce == "mean":
        return s / mask.sum(1).clamp_min(1)
    raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")


def _exp(lr: torch.Tensor) -> torch.Tensor:
    return torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def k3_per_token(lr: torch.Tensor) -> torch.Tensor:
    """K3_t = rho_t - log rho_t - 1 >= 0 from log rho [B, T], as expm1(lr) - lr in fp64: in fp32, exp(lr) - lr - 1
    cancels to exactly 0 for |lr| below about 3e-4 (K3 ~ lr^2 / 2 < 1e-7), i.e. for the small mismatches of a bf16
    or fp8 copy with per-element-mean log-probs. Returned in lr's dtype."""
    d = lr.double().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return (torch.expm1(d) - d).to(lr.dtype)


def _masked_mean(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(t.dtype)
    return (t * m).sum() / m.sum().clamp_min(1.0)


def ess_fraction(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ESS / n = (sum w)^2 / (n sum w^2) over the n valid positions; 1 when all weights are equal."""
    w = weights * mask.to(weights.dtype)
    n = mask.sum().clamp_min(1).to(weights.dtype)
    return (w.sum() ** 2 / (n * (w**2).sum()).clamp_min(1e-30)).clamp(max=1.0)


def diagnostics(lr: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The common diagnostics (spec §5.1), over valid positions.

    ess_frac (of the weights used), max_weight, masked_frac (valid positions rejected), mean_log_ratio,
    kl_k1 = E[log mu - log pi] (an estimate of KL(mu || pi) under mu's samples), kl_k3 = E[rho - log rho - 1] >= 0,
    chi2 = E[rho^2] - 1."""
    rho = _exp(lr)
    n_valid = mask.sum().clamp_min(1)
    return {
        "ess_frac": ess_fraction(weights, keep),
        "max_weight": (weights * keep).max() if keep.any() else torch.zeros(()),
        "masked_frac": (mask & ~keep).sum() / n_valid,
        "mean_log_ratio": _masked_mean(lr, mask),
        "kl_k1": _masked_mean(-lr, mask),
        "kl_k3": _masked_mean(k3_per_token(lr), mask),
        "chi2": _masked_mean(rho**2, mask) - 1.0,
    }


def _result(lr, weights, keep, mask) -> Correction:
    keep = keep & mask
    weights = torch.where(keep, weights, torch.zeros_like(weights)).detach()
    return Correction(weights, keep, diagnostics(lr, weights, keep, mask))


# ---- token level -----------------------------------------------------------------------------------

def no_correction(log_prob, log_prob_rollout, mask=None) -> Correction:
    """Weights 1 on every valid token: the uncorrected estimator, with the mismatch diagnostics still measured."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    return _result(lr, torch.ones_like(lr), mask, mask)


def token_tis(log_prob, log_prob_rollout, mask=None, cap: float = 2.0) -> Correction:
    """Truncated IS per token (Yao et al. / verl token-TIS): w_t = min(rho_t, C)."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    return _result(lr, _exp(lr).clamp(max=cap), mask, mask)


def token_mis(log_prob, log_prob_rollout, mask=None, low: float = 0.5, high: float = 2.0) -> Correction:
    """Masked IS per token (verl token RS, k1): keep only tokens with low <= rho_t <= high, weight rho_t."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    rho = _exp(lr)
    return _result(lr, rho, (rho >= low) & (rho <= high), mask)


# ---- sequence level --------------------------------------------------------------------------------

def seq_tis(log_prob, log_prob_rollout, mask=None, cap: float = 5.0) -> Correction:
    """w = min(prod_t rho_t, C), broadcast to every valid token (unbiased uncapped, higher variance)."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    w = _exp(seq_log_ratio(lr, mask)).clamp(max=cap)[:, None].expand_as(lr)
    return _result(lr, w, mask, mask)


def seq_mis(log_prob, log_prob_rollout, mask=None, low: float = 0.5, high: float = 2.0) -> Correction:
    """Reject whole sequences whose prod_t rho_t is outside [low, high]; the rest keep weight prod_t rho_t."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    w = _exp(seq_log_ratio(lr, mask))
    ok = ((w >= low) & (w <= high))[:, None].expand_as(lr)
    return _result(lr, w[:, None].expand_as(lr), ok, mask)


def geo_rs(log_prob, log_prob_rollout, mask=None, low: float = 0.999, high: float = 1.001) -> Correction:
    """Geometric-mean rejection: reject sequences with exp(mean_t log rho_t) outside [low, high]
    (length-invariant); kept tokens have weight 1."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    geo = _exp(seq_log_ratio(lr, mask, "mean"))
    ok = ((geo >= low) & (geo <= high))[:, None].expand_as(lr)
    return _result(lr, torch.ones_like(lr), ok, mask)


def k2_rs(log_prob, log_prob_rollout, mask=None, threshold: float = 2.0, aggregate: str = "token") -> Correction:
    """K2 = 1/2 (log rho_t)^2 rejection: per token, or per sequence by its sum / mean / max; weight 1."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    k2 = 0.5 * lr**2
    if aggregate == "token":
        ok = k2 <= threshold
    else:
        if aggregate == "sum":
            s = k2.sum(1)
        elif aggregate == "mean":
            s = k2.sum(1) / mask.sum(1).clamp_min(1)
        elif aggregate == "max":
            s = k2.max(1).values  # invalid positions hold 0 <= every K2
        else:
            raise ValueError(f"aggregate must be token, sum, mean or max, got {aggregate!r}")
        ok = (s <= threshold)[:, None].expand_as(lr)
    return _result(lr, torch.ones_like(lr), ok, mask)


def k3_rs(log_prob, log_prob_rollout, mask=None, threshold: float = 1e-2, aggregate: str = "mean") -> Correction:
    """K3_t = rho_t - log rho_t - 1 (>= 0; E = KL(mu || pi)) rejection: per token (reject tokens with K3_t >
    threshold), or per sequence by the mean (verl's seq_mean_k3, the default), sum or max of K3_t; weight 1."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    k3 = torch.where(mask, k3_per_token(lr), torch.zeros_like(lr))  # invalid positions hold 0 <= every K3
    if aggregate == "token":
        ok = k3 <= threshold
    else:
        if aggregate == "mean":
            s = k3.sum(1) / mask.sum(1).clamp_min(1)
        elif aggregate == "sum":
            s = k3.sum(1)
        elif aggregate == "max":
            s = k3.max(1).values
        else:
            raise ValueError(f"aggregate must be token, sum, mean or max, got {aggregate!r}")
        ok = (s <= threshold)[:, None].expand_as(lr)
    return _result(lr, torch.ones_like(lr), ok, mask)


# ---- batch-normalised weights (verl rollout_is_batch_normalize) -------------------------------------

def _batch_normalize(c: Correction, lr: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> Correction:
    """w~ = w / mean(w) after truncation (spec §5.1): the mean over kept tokens (token level) or over the kept
    sequences' weights (sequence level, one weight per sequence), so the weights average to 1 over the batch."""
    if per_sequence:
        rows = c.keep.any(1)
        seq_w = c.weights.max(1).values  # the broadcast sequence weight (0 where a row kept nothing)
        mean = seq_w[rows].mean() if rows.any() else torch.ones(())
    else:
        mean = _masked_mean(c.weights, c.keep)
    out = _result(lr, c.weights / mean.clamp_min(1e-30), c.keep, mask)
    out.diagnostics["batch_mean_weight"] = mean
    return out


def token_tis_bn(log_prob, log_prob_rollout, mask=None, cap: float = 2.0) -> Correction:
    """Token TIS with verl's batch normalisation: w_t = min(rho_t, C) / mean over the batch's valid tokens of
    min(rho, C). Diagnostics add `batch_mean_weight` (the divisor)."""
    mask = _check(log_prob, log_prob_rollout, mask)
    return _batch_normalize(token_tis(log_prob, log_prob_rollout, mask, cap), log_ratio(log_prob, log_prob_rollout, mask),
                            mask, per_sequence=False)


def seq_tis_bn(log_prob, log_prob_rollout, mask=None, cap: float = 5.0) -> Correction:
    """Sequence TIS with verl's batch normalisation: w = min(prod_t rho_t, C) / mean over the batch's sequences
    of that weight, broadcast to every valid token."""
    mask = _check(log_prob, log_prob_rollout, mask)
    return _batch_normalize(seq_tis(log_prob, log_prob_rollout, mask, cap), log_ratio(log_prob, log_prob_rollout, mask),
                            mask, per_sequence=True)


# ---- prefix and reshaping weights -----------------------------------------------------------------

def minpro(log_prob, log_prob_rollout, mask=None, cap: float = 2.0) -> Correction:
    """MinPRO working form (spec §5.2, exact clipped form unpublished): w_t = min_{i<t} rho_i * min(rho_t, C),
    the first token w_1 = min(rho_1, C). An earlier low ratio down-weights everything after it."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    rho = _exp(lr)  # invalid positions hold rho = 1, so padding never lowers the running minimum
    prefix_min = torch.cummin(rho, dim=1).values
    before = torch.cat([torch.ones_like(rho[:, :1]), prefix_min[:, :-1]], dim=1).clamp(max=1.0)
    return _result(lr, before * rho.clamp(max=cap), mask, mask)


def vespo(log_prob, log_prob_old, advantages, mask=None, k_pos: float = 2.0, lam_pos: float = 3.0,
          k_neg: float = 3.0, lam_neg: float = 2.0, log_prob_rollout=None) -> Correction:
    """VESPO reshaping kernel (Shen et al., arXiv 2602.10693; spec §5.2) on the true sequence ratio
    W = exp(sum_t log(pi / pi_old) [+ sum_t log(pi_old / mu)]): phi(W) = exp(lam) W^k exp(-lam W),
    phi(1) = 1, peak at W = k / lam; (k, lam) = (2, 3) for A >= 0 and (3, 2) for A < 0 (the code's
    defaults). Use as L = -sg(phi) A log pi."""
    mask = _check(log_prob, log_prob_old, mask)
    lr = log_ratio(log_prob, log_prob_old, mask)
    total = seq_log_ratio(lr, mask)
    if log_prob_rollout is not None:
        total = total + seq_log_ratio(log_ratio(log_prob_old, log_prob_rollout, mask), mask)
    total = total.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    adv = advantages if advantages.ndim == 1 else advantages[:, 0]
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(total, k_pos), torch.full_like(total, k_neg))
    lam = torch.where(pos, torch.full_like(total, lam_pos), torch.full_like(total, lam_neg))
    log_phi = lam + k * total - lam * torch.exp(total)
    return _result(lr, torch.exp(log_phi)[:, None].expand_as(lr), mask, mask)


# ---- ratios with gradient (policy-loss building blocks) ---------------------------------------------

def gspo_log_ratio(log_prob, log_prob_old, mask=None) -> torch.Tensor:
    """GSPO-token (Zheng et al., arXiv 2507.18071): log s_{i,t} = log pi_t - sg(log pi_t) + sg(mean_t log r_t).
    Its value is the sequence ratio s_i = exp(mean log r) at every valid token; its gradient is per token.
    Returns [B, T] (0 at invalid positions)."""
    mask = _check(log_prob, log_prob_old, mask)
    lr = log_ratio(log_prob, log_prob_old, mask)
    mean = seq_log_ratio(lr, mask, "mean")[:, None]
    out = log_prob - log_prob.detach() + mean
    return torch.where(mask, out, torch.zeros_like(out))


def ctpo_log_ratio(log_prob, log_prob_old, mask=None, c_low: float = 0.025, c_high: float = 0.05, power: float = 0.5,
                   cap: float = 10.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CTPO cumulative ratio (Zhang et al., arXiv 2605.07331): log R_t = sg(sum_{j<=t} log r_j) + log pi_t - sg(log pi_t),
    capped at `cap`; value = prefix product, gradient through token t only. Returns (log R [B, T], the
    position-scaled log-space bounds lo = -c_low t^p and hi = c_high t^p, each [1, T]); the caller clips
    log R to [lo, hi] in a PPO max/min (t counts valid positions from 1)."""
    mask = _check(log_prob, log_prob_old, mask)
    lr = log_ratio(log_prob, log_prob_old, mask)
    cum = torch.cumsum(lr, dim=1).clamp(max=cap)
    out = cum + log_prob - log_prob.detach()
    t = torch.arange(1, lr.shape[1] + 1, dtype=lr.dtype, device=lr.device)[None]
    return torch.where(mask, out, torch.zeros_like(out)), -c_low * t**power, c_high * t**power


def aspo_loss(log_prob, log_prob_old, advantages, mask=None, eps_low: float = 0.2, eps_high: float = 0.2,
              dual_clip: float = 3.0) -> torch.Tensor:
    """ASPO (Wang et al., arXiv 2510.06062) per-token loss [B, T] (0 at invalid positions). A > 0: the IS weight is
    flipped, loss = -A (rb / sg rb) / sg rb with rb = min(r, 1 + eps_high), so the gradient is A grad log pi / rb
    (low-probability positive tokens weigh more); if 1 / rb > c the soft dual-clip -A c log pi keeps a gradient.
    A < 0: rb = max(r, 1 - eps_low), loss = -A rb; if rb > c, -A c log pi. A token weighting, not a corrector."""
    mask = _check(log_prob, log_prob_old, mask)
    adv = advantages if advantages.ndim == 2 else advantages[:, None].expand_as(log_prob)
    r = torch.exp((log_prob - log_prob_old.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    rb_pos = torch.clamp(r, max=1.0 + eps_high)
    pos = -adv * (rb_pos / rb_pos.detach()) / rb_pos.detach()
    pos = torch.where(1.0 / rb_pos.detach() > dual_clip, -adv * dual_clip * log_prob, pos)
    rb_neg = torch.clamp(r, min=1.0 - eps_low)
    neg = torch.where(rb_neg.detach() > dual_clip, -adv * dual_clip * log_prob, -adv * rb_neg)
    loss = torch.where(adv > 0, pos, neg)
    return torch.where(mask, loss, torch.zeros_like(loss))


def gspo_loss(log_prob, log_prob_old, advantages, mask=None, eps_low: float = 3e-4, eps_high: float = 4e-4) -> torch.Tensor:
    """GSPO's clipped objective (spec §5.2) per token [B, T] (0 at invalid positions): with the GSPO-token ratio
    s (value exp(mean_t log r_t), gradient per token), loss = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high));
    (3e-4, 4e-4) are verl's Qwen3-30B example's ranges."""
    mask = _check(log_prob, log_prob_old, mask)
    adv = advantages if advantages.ndim == 2 else advantages[:, None].expand_as(log_prob)
    s = torch.exp(gspo_log_ratio(log_prob, log_prob_old, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    loss = torch.maximum(-adv * s, -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high))
    return torch.where(mask, loss, torch.zeros_like(loss))


def ctpo_loss(log_prob, log_prob_old, advantages, mask=None, c_low: float = 0.025, c_high: float = 0.05,
              c_dual: float = 0.05, power: float = 0.5, cap: float = 10.0) -> torch.Tensor:
    """CTPO's PPO max/min on the cumulative ratio R_t (ctpo_log_ratio) per token [B, T] (0 at invalid positions):
    loss = max(-A R_t, -A exp(clip(log R_t, -c_low t^p, c_high t^p))), and for A < 0 the dual clip
    min(that, -A exp(c_dual t^p)) (the defaults are CTPO's code's)."""
    mask = _check(log_prob, log_prob_old, mask)
    adv = advantages if advantages.ndim == 2 else advantages[:, None].expand_as(log_prob)
    log_r, lo, hi = ctpo_log_ratio(log_prob, log_prob_old, mask, c_low, c_high, power, cap)
    r = torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    loss = torch.maximum(-adv * r, -adv * torch.exp(torch.maximum(torch.minimum(log_r, hi), lo)))
    t = torch.arange(1, log_prob.shape[1] + 1, dtype=r.dtype, device=r.device)[None]
    loss = torch.where(adv < 0, torch.minimum(loss, -adv * torch.exp(c_dual * t**power)), loss)
    return torch.where(mask, loss, torch.zeros_like(loss))


def vespo_loss(log_prob, log_prob_old, advantages, mask=None, k_pos: float = 2.0, lam_pos: float = 3.0,
               k_neg: float = 3.0, lam_neg: float = 2.0, log_prob_rollout=None) -> torch.Tensor:
    """VESPO's REINFORCE form per token [B, T]: loss = -sg(phi(W)) A log pi (`vespo` gives phi; W includes
    pi_old / mu when `log_prob_rollout` is given). 0 at invalid positions."""
    mask = _check(log_prob, log_prob_old, mask)
    adv = advantages if advantages.ndim == 1 else advantages[:, 0]
    phi = vespo(log_prob, log_prob_old, adv, mask, k_pos, lam_pos, k_neg, lam_neg, log_prob_rollout).weights
    loss = -phi * adv[:, None] * log_prob
    return torch.where(mask, loss, torch.zeros_like(loss))


# ---- step size and adaptive mixing ------------------------------------------------------------------

def vcpo_lr_scale(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VCPO (Huang et al., arXiv 2602.17616): scale the learning rate by sqrt(ESS / n) (the square root for AdamW)."""
    return ess_fraction(weights, mask).sqrt()


def ais(log_prob, log_prob_rollout, mask=None, cap: float = 2.0, kl_scale: float = 1e-3, min_ess: float = 0.5
        ) -> Correction:
    """Adaptive IS mixing for quantized rollouts (after Zhou et al., arXiv 2605.13907; their coefficient is not
    public, this one is ours). Gradients are linear in the weights, so mixing the uncorrected and the IS
    gradient, g = (1 - lam) g_plain + lam g_IS, is one weight per token: w = (1 - lam) + lam w_IS.

    - divergence severity: K3 = E[rho - log rho - 1] (>= 0, E = KL(mu || pi)), mapped to
      lam = 1 - exp(-K3 / kl_scale) in [0, 1): no mismatch -> lam = 0 (uncorrected; IS would only add
      variance); mismatch large against kl_scale -> lam -> 1 (fully weighted).
    - variance amplification / weight reliability: the raw weights' ESS/n = E[rho]^2 / E[rho^2]
      (= 1 / (1 + chi2) when E[rho] = 1) says how many samples the IS estimate really rests on.
      w_IS = min(rho, C) bounds the second moment; when ESS/n of the raw weights falls below
      `min_ess` the tails are not just clipped but masked, rho outside [1/C, C] (what MIS would drop),
      so that the weighted gradient is not carried by a few tokens.

    kl_scale is the K3 at which lam = 1 - 1/e; 1e-3 suits per-element-mean diffusion log-probs and
    per-token LLM log-probs alike (verl's K3 thresholds are 1e-3 ... 1e-2). Diagnostics add `ais_lambda`."""
    mask = _check(log_prob, log_prob_rollout, mask)
    lr = log_ratio(log_prob, log_prob_rollout, mask)
    rho = _exp(lr)
    k3 = _masked_mean(k3_per_token(lr), mask)
    lam = -torch.expm1(-k3 / kl_scale)  # 1 - exp(-K3 / kl_scale), exact for small K3
    w_is = rho.clamp(max=cap)
    keep = mask
    if ess_fraction(rho, mask) < min_ess:
        keep = mask & (rho >= 1.0 / cap) & (rho <= cap)
    out = _result(lr, (1.0 - lam) + lam * w_is, keep, mask)
    out.diagnostics["ais_lambda"] = lam
    return out


OPTION_CHOICES = {"aggregate": ("token", "sum", "mean", "max")}
_NONNEG_OPTIONS, _SIGNED_OPTIONS = ("eps_low", "eps_high"), ("power",)


def option_problems(name: str, fn, options: dict, fixed: tuple[str, ...]) -> list[tuple[str, str]]:
    """(option, what is wrong) for each bad keyword option of corrector / loss `fn` (called `name`): unknown
    names, a non-finite or non-positive number (eps_* may be 0, CTPO's power any sign), a choice outside
    OPTION_CHOICES, low > high. `fixed` are the positional inputs, never options. Empty when all is well."""
    import inspect
    import math

    allowed = [k for k in inspect.signature(fn).parameters if k not in fixed]
    out = []
    for k, v in options.items():
        if k not in allowed:
            out.append((k, f"{name} takes {allowed}"))
        elif k in OPTION_CHOICES:
            if v not in OPTION_CHOICES[k]:
                out.append((k, f"= {v!r}; expected one of {', '.join(OPTION_CHOICES[k])}"))
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            out.append((k, f"= {v!r}; expected a finite number"))
        elif (v < 0 if k in _NONNEG_OPTIONS else v <= 0) and k not in _SIGNED_OPTIONS:
            out.append((k, f"= {v!r} is out of range; expected {'>= 0' if k in _NONNEG_OPTIONS else '> 0'}"))
    if not out and options.get("low", 0.0) > options.get("high", math.inf):
        out.append(("low", f"= {options['low']} is above high = {options['high']}"))
    return out


METHODS = {"none": no_correction, "token_tis": token_tis, "token_tis_bn": token_tis_bn, "token_mis": token_mis,
           "seq_tis": seq_tis, "seq_tis_bn": seq_tis_bn, "seq_mis": seq_mis, "geo_rs": geo_rs, "k2_rs": k2_rs,
           "k3_rs": k3_rs, "minpro": minpro, "ais": ais}
"""Correctors that need only (log_prob, log_prob_rollout, mask) and their options; `vespo` also takes advantages."""

POLICY_LOSSES = {"gspo": gspo_loss, "ctpo": ctpo_loss, "aspo": aspo_loss, "vespo": vespo_loss}
"""Per-token policy losses [B, T] from (log_prob, log_prob_old, advantages, mask, **options): alternatives to
PPO-clip (which lives with the algorithms, difrl.algos.ppo_clip_loss)."""

