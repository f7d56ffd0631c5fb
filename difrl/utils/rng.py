"""Counter-based random numbers: noise that is a pure function of (seed, step, element).

    from difrl.utils.rng import mix_seed, counter_normal
    key = mix_seed(cfg.seed, iteration)                       # python int, stable across runs
    eps = counter_normal(torch.tensor([3, 4]), step=0, shape=(16, 64, 64))   # [2, 16, 64, 64] fp32

Every rollout sample must be regenerable from its seed alone (docs/architecture.md seam 3: Sol-RL, resume,
debugging). One ``torch.Generator`` per sample per step gives that, but costs a generator reseed
per row: at the digits world's size that is as expensive as the model. Here each normal is instead
computed from a hash of (key, counter) with integer tensor ops (splitmix64, Steele et al., OOPSLA
2014) and Box-Muller, vectorised over the batch. The integers are exact on every device, so the
same seed gives the same noise on CPU and GPU (up to the last ulp of log/cos), in any batch
position and any batch size.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _finalise(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (splitmix64 finaliser over each part)."""
    h = _GOLDEN
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) & _MASK64
        h = _finalise((h + _GOLDEN) & _MASK64)
    return h & ((1 << 63) - 1)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _finalise_t(z: torch.Tensor) -> torch.Tensor:
    # int64 multiply wraps modulo 2^64: the same bits as the unsigned arithmetic of _finalise
    z = (z ^ _lsr(z, 30)) * _signed(_M1)
    z = (z ^ _lsr(z, 27)) * _signed(_M2)
    return z ^ _lsr(z, 31)


def mix_seed_tensor(seeds: torch.Tensor, *parts: int | torch.Tensor) -> torch.Tensor:
    """mix_seed(seeds[b], *parts) for every b, vectorised and bit-identical to the python one.
    Parts may be tensors that broadcast against `seeds` (e.g. steps [S, 1] with seeds [B] -> [S, B])."""
    h = torch.tensor(_signed(_GOLDEN), dtype=torch.int64, device=seeds.device)
    for p in (seeds.to(torch.int64), *parts):
        p = torch.as_tensor(p, dtype=torch.int64, device=seeds.device)
        h = _finalise_t((h ^ p) + _signed(_GOLDEN))
    return h & ((1 << 63) - 1)


def counter_normal(seeds: torch.Tensor, step: int | list[int], shape: tuple[int, ...], device="cpu") -> torch.Tensor:
    """[B, *shape] fp32 standard normals; row b depends only on (seeds[b], step). With a list of S
    steps, [S, B, *shape] in one vectorised call (a rollout draws all its steps' noise at once).

    Element pair j of row b comes from one 64-bit hash h = splitmix64(key_b + (j + 1) * golden):
    its two 32-bit halves are uniforms u1, u2 in (0, 1) and Box-Muller turns them into
    sqrt(-2 ln u1) (cos 2 pi u2, sin 2 pi u2), computed in fp64 and rounded to fp32."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64).to(device)
    steps = torch.as_tensor(step, dtype=torch.int64, device=device)
    n = math.prod(shape)
    keys = mix_seed_tensor(seeds, steps.reshape(-1, 1)).reshape(-1)  # [S * B]
    ctr = torch.arange(1, (n + 1) // 2 + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN)  # [P]
    h = _finalise_t(keys[:, None] + ctr[None, :])  # [S * B, P]
    u1 = (_lsr(h, 32).double() + 0.5) * 2.0**-32
    u2 = ((h & 0xFFFFFFFF).double() + 0.5) * 2.0**-32
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = (2.0 * math.pi) * u2
    z = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=-1).flatten(1)[:, :n]  # [S * B, n]
    lead = (len(seeds),) if steps.ndim == 0 else (steps.numel(), len(seeds))
    return z.to(torch.float32).view(*lead, *shape)
