"""Rollouts with a gradient: the samplers of reward backpropagation (DRaFT-K, ReFL), beside difrl.rollout's.

    x0 = rollout_last_k(policy, prompts, seeds, sigmas, k=1)             # [B, *latent], graph through the last step
    x0_hat, step = refl_predict(policy, prompts, seeds, sigmas, step=7)  # one-step x0 prediction from step 7's x

Both draw the same initial noise (and, with a stochastic kernel, the same step noise) as difrl.rollout.rollout
for the same seeds, so with k = 0 / no grad they reproduce its x_final. The first steps run under torch.no_grad:
only the last `k` sampler steps (DRaFT-K) or the one prediction step (ReFL) are in the autograd graph, which is
what bounds their memory (DRaFT, arXiv 2309.17400, §4: truncating the backward to the last K steps; ReFL,
arXiv 2304.05977, §4.2: the reward of the one-step x0 prediction from a late step).

Flow matching (docs/architecture.md, Conventions): x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0, so the one-step
prediction of the clean sample from x_sigma is x0_hat = x_sigma - sigma v(x_sigma, sigma).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from difrl.models.base import Cond, FlowPolicy, policy_device
from difrl.rollout import initial_latents, sample_noise
from difrl.samplers.kernels import KERNELS


def _start(policy: FlowPolicy, prompts: list[str], seeds, init_seeds, cond: Cond | None, device):
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    init_seeds = seeds if init_seeds is None else torch.as_tensor(init_seeds, dtype=torch.long)
    device = policy_device(policy) if device is None else torch.device(device)
    cond = policy.encode(prompts) if cond is None else cond
    cond = {k: v.to(device) for k, v in cond.items()}
    return seeds, initial_latents(init_seeds, tuple(policy.latent_shape), device), cond, device


def _step(policy, x, i: int, sigmas: list[float], seeds, cond, kernel: str, kernel_kwargs: dict, guidance: float):
    """Sampler step i ([B, *latent] -> [B, *latent]); the noise of a stochastic kernel from (seed, i)."""
    sig = torch.full((x.shape[0],), sigmas[i], device=x.device)
    v = policy.velocity(x, sig, cond, guidance)
    noise = None if kernel == "ode" else sample_noise(seeds, i, tuple(x.shape[1:]), x.device)
    return KERNELS[kernel](x, v, sig, torch.full_like(sig, sigmas[i + 1]), noise, **kernel_kwargs).x_next


def rollout_last_k(policy: FlowPolicy, prompts: list[str], seeds, sigmas: torch.Tensor, k: int, kernel: str = "ode",
                   kernel_kwargs: dict | None = None, init_seeds=None, guidance: float = 1.0, cond: Cond | None = None,
                   device=None) -> torch.Tensor:
    """DRaFT-K's sample: the N = len(sigmas) - 1 steps of `kernel` from the seeds' initial noise, steps 0 .. N - k - 1
    without gradient, the last `k` with it (1 <= k <= N; k = N is full DRaFT). Returns x_final [B, *latent] fp32
    whose graph reaches the policy's parameters through the last k velocity evaluations only."""
    N = len(sigmas) - 1
    if not 1 <= k <= N:
        raise ValueError(f"rollout_last_k: k={k} must be in 1..{N} (the schedule's steps)")
    seeds, x, cond, _ = _start(policy, prompts, seeds, init_seeds, cond, device)
    values = sigmas.detach().cpu().tolist()
    for i in range(N):
        with torch.no_grad() if i < N - k else nullcontext():
            x = _step(policy, x, i, values, seeds, cond, kernel, kernel_kwargs or {}, guidance)
    return x


def refl_predict(policy: FlowPolicy, prompts: list[str], seeds, sigmas: torch.Tensor, step: int, kernel: str = "ode",
                 kernel_kwargs: dict | None = None, init_seeds=None, guidance: float = 1.0, cond: Cond | None = None,
                 device=None) -> torch.Tensor:
    """ReFL's sample: steps 0 .. step - 1 of `kernel` without gradient, then at x_step (sigma_step) one velocity
    evaluation WITH gradient and the one-step prediction x0_hat = x - sigma v. Returns x0_hat [B, *latent] fp32."""
    N = len(sigmas) - 1
    if not 0 <= step < N:
        raise ValueError(f"refl_predict: step={step} must be in 0..{N - 1}")
    seeds, x, cond, _ = _start(policy, prompts, seeds, init_seeds, cond, device)
    values = sigmas.detach().cpu().tolist()
    with torch.no_grad():
        for i in range(step):
            x = _step(policy, x, i, values, seeds, cond, kernel, kernel_kwargs or {}, guidance)
    sig = torch.full((x.shape[0],), values[step], device=x.device)
    v = policy.velocity(x, sig, cond, guidance).float()
    return x - sig.view(-1, *([1] * (x.ndim - 1))) * v
