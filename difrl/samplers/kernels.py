"""Step kernels: one denoising transition of a flow-matching sampler as a Gaussian policy.

    from difrl.samplers import flow_sde_step
    out = flow_sde_step(x, v, sigma, sigma_next, noise, noise_level=0.7)
    out.x_next, out.log_prob, out.mean, out.std        # [B, ...], [B], [B, ...], [B]

Each kernel is a pure function of tensors, computed in fp32 whatever the model's dtype (bf16
overflows in the mean, docs/reference/specs/flow-grpo-family.md §2.2). Convention (docs/architecture.md):
``x_sigma = (1 - sigma) x0 + sigma eps``, velocity ``v = eps - x0``, ``sigma`` runs 1 -> 0,
``delta = sigma_next - sigma < 0``.

Every kernel takes either ``noise`` (sampling: ``x_next = mean + std * noise``) or ``action``
(recomputation at train time: the log-prob of a stored ``x_next``). ``sigma`` / ``sigma_next``
are scalars or ``[B]`` tensors, so one call can evaluate transitions of different steps.

``log_prob`` is the Gaussian log-density reduced over every non-batch element: the per-element
*mean* by default (what makes the published clip ranges 1e-4 ... 2e-6 meaningful, §1), or the
true ``"sum"``. Where ``std == 0`` (an ODE step, noise level 0, CPS's last step) the transition
is deterministic, ``x_next = mean`` and ``log_prob`` is 0.

``split_step(kind, ...)`` is any kernel with its std scaled by a factor kappa, sampled or scored
(BranchGRPO's split steps; the rescoring of stored tree edges in ``difrl.rollout.recompute``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

Reduce = Literal["mean", "sum"]
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class StepOutput(NamedTuple):
    x_next: torch.Tensor  # [B, ...] fp32
    log_prob: torch.Tensor  # [B] fp32, log pi(x_next | x), reduced per `reduce`
    mean: torch.Tensor  # [B, ...] fp32, mean of the Gaussian transition
    std: torch.Tensor  # [B] fp32, its (isotropic) standard deviation


def _per_sample(t: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """Scalar or [B] -> [B] fp32 on x's device."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    return t.expand(x.shape[0]) if t.ndim == 0 else t.to(torch.float32)


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] so it broadcasts against x."""
    return t.view(-1, *([1] * (x.ndim - 1)))


def reduce_elements(t: torch.Tensor, reduce: Reduce = "mean") -> torch.Tensor:
    """[B, ...] -> [B] by mean or sum over every non-batch dim (works for [B,C,H,W] and packed [B,L,C])."""
    dims = tuple(range(1, t.ndim))
    if not dims:
        return t
    return t.mean(dim=dims) if reduce == "mean" else t.sum(dim=dims)


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduce: Reduce = "mean") -> torch.Tensor:
    """log N(x_next; mean, std^2 I) reduced to [B]; 0 where std == 0 (deterministic step)."""
    std_b = _bcast(std, mean)
    safe = torch.where(std_b > 0, std_b, torch.ones_like(std_b))
    elem = -((x_next - mean) ** 2) / (2.0 * safe**2) - torch.log(safe) - _HALF_LOG_2PI
    elem = torch.where(std_b > 0, elem, torch.zeros_like(elem))
    return reduce_elements(elem, reduce)


def _finish(mean, std, noise, action, reduce, log_prob_fn=gaussian_log_prob) -> StepOutput:
    if (noise is None) == (action is None):
        raise ValueError("pass exactly one of `noise` (to sample) or `action` (to score a stored x_next)")
    if action is not None:
        x_next = action.to(torch.float32)
    else:
        x_next = mean + _bcast(std, mean) * noise.to(torch.float32)
    return StepOutput(x_next, log_prob_fn(x_next, mean, std, reduce), mean, std)


def _sde_mean(x, v, sigma, delta, g):
    """Euler-Maruyama mean of the marginal-preserving reverse SDE with diffusion g
    (docs/reference/specs/flow-grpo-family.md §1):
    mu = x + delta * [v + g^2 / (2 sigma) * (x + (1 - sigma) v)]."""
    s_b, d_b, g_b = _bcast(sigma, x), _bcast(delta, x), _bcast(g, x)
    return x + d_b * (v + g_b**2 / (2.0 * s_b) * (x + (1.0 - s_b) * v))


def ode_step(x, v, sigma, sigma_next, noise=None, *, action=None, reduce: Reduce = "mean") -> StepOutput:
    """Deterministic Euler step x_next = x + (sigma_next - sigma) v; std 0, log_prob 0.

    `noise` is accepted and ignored so every kernel has the same call shape."""
    x, v = x.to(torch.float32), v.to(torch.float32)
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    mean = x + _bcast(sigma_next - sigma, x) * v
    std = torch.zeros_like(sigma)
    x_next = mean if action is None else action.to(torch.float32)
    return StepOutput(x_next, torch.zeros_like(sigma), mean, std)  # deterministic: log_prob 0 by convention


def flow_sde_step(x, v, sigma, sigma_next, noise=None, *, noise_level: float = 0.7, action=None,
                  reduce: Reduce = "mean") -> StepOutput:
    """Flow-GRPO SDE step (arXiv 2505.05470; docs/reference/specs/flow-grpo-family.md §2.2):
    g = a * sqrt(sigma / (1 - sigma~)), sigma~ = sigma_next where sigma == 1 (the schedule's second entry: avoids 1/0
    at the first step), std = g * sqrt(sigma - sigma_next)."""
    x, v = x.to(torch.float32), v.to(torch.float32)
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    sigma_guard = torch.where(sigma >= 1.0, sigma_next, sigma)
    g = noise_level * torch.sqrt(sigma / (1.0 - sigma_guard))
    delta = sigma_next - sigma
    mean = _sde_mean(x, v, sigma, delta, g)
    std = g * torch.sqrt(-delta)
    return _finish(mean, std, noise, action, reduce)


def dance_sde_step(x, v, sigma, sigma_next, noise=None, *, noise_level: float = 0.3, action=None,
                   reduce: Reduce = "mean") -> StepOutput:
    """DanceGRPO SDE step (arXiv 2505.07818; docs/reference/specs/flow-grpo-family.md §3.2): the same SDE family with a
    constant diffusion g = eta, so std = eta * sqrt(sigma - sigma_next)."""
    x, v = x.to(torch.float32), v.to(torch.float32)
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    g = torch.full_like(sigma, float(noise_level))
    delta = sigma_next - sigma
    mean = _sde_mean(x, v, sigma, delta, g)
    std = g * torch.sqrt(-delta)
    return _finish(mean, std, noise, action, reduce)


def cps_unnormalized_log_prob(x_next, mean, std, reduce: Reduce = "mean"):
    """Flow-GRPO's CPS "log-prob" -(x_next - mean)^2 with the 1/(2 std^2) and constants dropped
    (docs/reference/specs/branch-cps-guard.md §2.4); clip ranges tuned for it (1e-5) do not transfer to the
    Gaussian form."""
    return reduce_elements(-((x_next - mean) ** 2), reduce)


def cps_step(x, v, sigma, sigma_next, noise=None, *, noise_level: float = 0.8, action=None,
             reduce: Reduce = "mean", log_prob_form: Literal["gaussian", "flow_grpo"] = "gaussian") -> StepOutput:
    """Coefficients-Preserving Sampling (arXiv 2509.05952; docs/reference/specs/branch-cps-guard.md §2.2):
    std = sigma_next * sin(a pi / 2), x0^ = x - sigma v, eps^ = x + (1 - sigma) v,
    mean = (1 - sigma_next) x0^ + sqrt(sigma_next^2 - std^2) eps^, so the total noise variance of
    x_next is exactly sigma_next^2. `log_prob_form="flow_grpo"` reproduces the reference's
    unnormalised log-prob; the default is the true Gaussian log-density."""
    x, v = x.to(torch.float32), v.to(torch.float32)
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = sigma_next * math.sin(noise_level * math.pi / 2.0)
    x0_hat = x - _bcast(sigma, x) * v
    eps_hat = x + _bcast(1.0 - sigma, x) * v
    eps_coef = torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0))
    mean = _bcast(1.0 - sigma_next, x) * x0_hat + _bcast(eps_coef, x) * eps_hat
    log_prob_fn = gaussian_log_prob if log_prob_form == "gaussian" else cps_unnormalized_log_prob
    return _finish(mean, std, noise, action, reduce, log_prob_fn)


KERNELS = {"ode": ode_step, "flow_sde": flow_sde_step, "dance_sde": dance_sde_step, "cps": cps_step}


def split_step(kind: str, x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise: torch.Tensor | None = None, *,
               action: torch.Tensor | None = None, noise_scale: torch.Tensor | float = 1.0,
               logprob_scale: torch.Tensor | float | None = None, **kernel_kwargs) -> StepOutput:
    """A kernel step with its std scaled (BranchGRPO's split steps, docs/reference/specs/branch-cps-guard.md §1.2):
    x_next = mu + noise_scale * s * noise (sampling) or the given `action`, and
    log_prob = log N(x_next; mu, (logprob_scale * s)^2), where (mu, s) are `kind`'s mean and std.
    ``logprob_scale`` defaults to ``noise_scale`` (the sampled distribution); 1 gives BranchGRPO's
    reference log-prob. Scales are floats or [B]. Returns StepOutput with ``std = logprob_scale * s``
    (the std of the log-prob). With both scales 1 this is exactly ``KERNELS[kind]`` (same ops, same
    bits); for scale-1 rows of a mixed batch too."""
    step_fn = KERNELS[kind]
    if logprob_scale is None:
        logprob_scale = noise_scale
    plain = lambda s: isinstance(s, (int, float)) and float(s) == 1.0  # noqa: E731
    if plain(noise_scale) and plain(logprob_scale):
        return step_fn(x, v, sigma, sigma_next, noise, action=action, **kernel_kwargs)
    if kind == "ode":
        return ode_step(x, v, sigma, sigma_next, action=action)
    if (noise is None) == (action is None):
        raise ValueError("pass exactly one of `noise` (to sample) or `action` (to score a stored x_next)")
    reduce = kernel_kwargs.get("reduce", "mean")
    base = step_fn(x, v, sigma, sigma_next, action=x if action is None else action, **kernel_kwargs)  # mu, s
    mean = base.mean
    per_row = lambda s: _per_sample(s, mean).reshape(-1)  # noqa: E731  a float or [B] scale -> [B] fp32
    if action is None:
        x_next = mean + _bcast(base.std, mean) * _bcast(per_row(noise_scale), mean) * noise.to(torch.float32)
    else:
        x_next = action.to(torch.float32)
    std = base.std * per_row(logprob_scale)
    flow_grpo_cps = kind == "cps" and kernel_kwargs.get("log_prob_form", "gaussian") == "flow_grpo"
    log_prob_fn = cps_unnormalized_log_prob if flow_grpo_cps else gaussian_log_prob  # the kernel's density form
    return StepOutput(x_next, log_prob_fn(x_next, mean, std, reduce), mean, std)
