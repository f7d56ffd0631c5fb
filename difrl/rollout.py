"""Rollout engine: seeds in, trajectories out (docs/architecture.md seam 3).

    sigmas = sigma_schedule(10)
    batch = rollout(policy, prompts, seeds=torch.arange(8), sigmas=sigmas,
                    kernel="flow_sde", kernel_kwargs={"noise_level": 0.7},
                    sde_mask=all_but_last(10), train_mask=all_but_last(10))
    again = regenerate(policy, batch, sigmas, ...)   # bit-identical x_final

Every sample carries an integer ``seed``, a ``prompt_id`` and a ``group_id``. Its initial noise is
a counter-based function of ``(init_seed, -1)`` and step i's noise of ``(seed, i)``, so a
sample is a pure function of its seeds, prompt and the policy: any sample can be regenerated
exactly (Sol-RL, resume, debugging). ``init_seed`` equals ``seed`` unless a group shares one
initial noise (then it is the group's seed, derived from the group id, never from prompt text).

Only the trained transitions are stored: ``x, x_next, sigma, sigma_next, log_prob_old, mean_old``
as ``[B, T, ...]`` with ``step`` ``[B, T]`` saying which step each one is. ``recompute(policy, batch,
kernel)`` scores them under the current policy (the trainer's log-prob), for flat samples and tree
edges (``difrl.tree_rollout``, rows with ``T = 1``) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from difrl.models.base import Cond, FlowPolicy, cond_repeat, cond_select, policy_device
from difrl.samplers.kernels import KERNELS, StepOutput, split_step
from difrl.utils.rng import counter_normal, mix_seed  # noqa: F401  (mix_seed re-exported)


def sample_noise(seeds: torch.Tensor, step: int | list[int], shape: tuple[int, ...], device="cpu") -> torch.Tensor:
    """[B, *shape] standard normal noise; row b is a pure function of (seeds[b], step) (difrl.utils.rng).
    A list of S steps gives [S, B, *shape], each [B] slice equal to the single-step draw."""
    return counter_normal(seeds, step, shape, device)


INIT_STEP = -1  # the "step" whose noise is the initial latent


def initial_latents(seeds: torch.Tensor, latent_shape, device="cpu") -> torch.Tensor:
    """[B, *latent_shape] fp32: the initial noise x_1 of difrl's samples with initial-noise seeds `seeds`
    (Rollout.init_seeds; an evaluation's seeds are mix_seed(eval.seed, i) for its i-th sample). It is in the
    pipeline's own latent layout (policy.latent_shape: FLUX packed [tokens, 4C], SD3 [C, h, w], Wan
    [C, f, h, w]), so plain diffusers reproduces a difrl ODE sample with
    `pipe(prompt, latents=initial_latents(seeds, policy.latent_shape), num_inference_steps=N, ...)`."""
    return sample_noise(torch.as_tensor(seeds, dtype=torch.long), INIT_STEP, tuple(latent_shape), device)
_ONE_DRAW_MAX_ELEMENTS = 1 << 22  # draw all steps' noise at once up to 4M elements (about 100 MB of fp64 temporaries)


@dataclass
class Rollout:
    """A batch of B sampled trajectories with their T trained transitions."""

    prompts: list[str]
    prompt_ids: torch.Tensor  # [B] long
    group_ids: torch.Tensor  # [B] long
    seeds: torch.Tensor  # [B] long: per-step noise seeds
    init_seeds: torch.Tensor  # [B] long: initial-noise seeds
    cond: Cond  # [B, ...] tensors from policy.encode
    x_final: torch.Tensor  # [B, *latent] fp32
    step: torch.Tensor  # [B, T] long: step index of each trained transition
    x: torch.Tensor  # [B, T, *latent]
    x_next: torch.Tensor  # [B, T, *latent]
    sigma: torch.Tensor  # [B, T]
    sigma_next: torch.Tensor  # [B, T]
    log_prob_old: torch.Tensor  # [B, T]
    mean_old: torch.Tensor  # [B, T, *latent]
    extras: dict = field(default_factory=dict)
    # [B] long or None: row b's conditioning is cond's row cond_rows[b] (per_transition: a sample's T transitions share
    # its conditioning, which is held once, not T times); select() materialises the selected rows' own
    cond_rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: torch.Tensor) -> "Rollout":
        """Rows `index` of every per-sample field; an ``extras`` tensor with one row per sample is indexed
        too (tree edges' ``logprob_scale``), any other extra is kept whole."""
        # `index` goes to each device once (ids and seeds stay on the host; the trajectory lives on the policy's
        # device, where indexing with a host index would copy it, a sync on a GPU, once per field)
        host = index.cpu()
        on: dict[torch.device, torch.Tensor] = {host.device: host, index.device: index}

        def pick(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on:
                on[t.device] = index.to(t.device, non_blocking=True)
            return t[on[t.device]]

        B = len(self)
        extras = {k: pick(v) if torch.is_tensor(v) and v.ndim >= 1 and v.shape[0] == B else v
                  for k, v in self.extras.items()}
        return replace(
            self, prompts=[self.prompts[i] for i in host.tolist()], prompt_ids=pick(self.prompt_ids),
            group_ids=pick(self.group_ids), seeds=pick(self.seeds), init_seeds=pick(self.init_seeds),
            cond=(cond_select(self.cond, pick(self.cond_rows)) if self.cond_rows is not None
                  else {k: pick(v) for k, v in self.cond.items()}), cond_rows=None,
            x_final=pick(self.x_final), step=pick(self.step),
            x=pick(self.x), x_next=pick(self.x_next), sigma=pick(self.sigma), sigma_next=pick(self.sigma_next),
            log_prob_old=pick(self.log_prob_old), mean_old=pick(self.mean_old), extras=extras,
        )


def per_transition(batch: Rollout) -> Rollout:
    """Each of the B*T stored transitions of `batch` as a record of its own: a Rollout of B*T rows with T = 1,
    sample-major (row b*T + t is sample b's t-th transition). Per-sample fields are repeated, per-transition
    ``extras`` ([B, T, ...]) reshaped; the conditioning is held once per sample (``cond_rows`` maps each row to its
    sample's: a video model's text embeddings, T times over, were tens of GiB for Wan 14B on one GPU, difrl plan), and
    a selection of rows (a micro-batch) gets its own. The trainer uses it when train.micro_batch (transitions per forward /
    backward) is not a multiple of a sample's T, so a micro-batch may hold part of a sample (Flow-GRPO's own
    loop trains one timestep of several samples per backward)."""
    B, T = batch.step.shape
    rep = lambda t: t.repeat_interleave(T, dim=0)  # noqa: E731  [B, ...] -> [B*T, ...]
    one = lambda t: t.reshape(B * T, 1, *t.shape[2:])  # noqa: E731  [B, T, ...] -> [B*T, 1, ...]
    extras = {k: one(v) if torch.is_tensor(v) and v.ndim >= 2 and tuple(v.shape[:2]) == (B, T)
              else rep(v) if torch.is_tensor(v) and v.ndim >= 1 and v.shape[0] == B else v
              for k, v in batch.extras.items()}
    return Rollout(
        prompts=[p for p in batch.prompts for _ in range(T)], prompt_ids=rep(batch.prompt_ids),
        group_ids=rep(batch.group_ids), seeds=rep(batch.seeds), init_seeds=rep(batch.init_seeds),
        cond=batch.cond, cond_rows=torch.arange(B, device=_cond_device(batch.cond)).repeat_interleave(T),
        x_final=rep(batch.x_final), step=one(batch.step), x=one(batch.x),
        x_next=one(batch.x_next), sigma=one(batch.sigma), sigma_next=one(batch.sigma_next),
        log_prob_old=one(batch.log_prob_old), mean_old=one(batch.mean_old), extras=extras)


def _cond_device(cond: Cond) -> torch.device:
    return next((v.device for v in cond.values() if torch.is_tensor(v)), torch.device("cpu"))


def chunk_slices(n: int, chunks: int) -> list[slice]:
    """`chunks` consecutive slices covering range(n), sizes differing by at most one (empty ones left out)."""
    bounds = [n * k // chunks for k in range(chunks + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Rollouts of consecutive chunks -> one Rollout (rows in order); flat rollouts (no extras) only."""
    if len(parts) == 1:
        return parts[0]
    if any(p.extras for p in parts):
        raise ValueError("cat_rollouts joins flat rollouts; these carry extras (tree edges?)")
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return Rollout(
        prompts=[t for p in parts for t in p.prompts], cond={k: torch.cat([p.cond[k] for p in parts]) for k in parts[0].cond},
        **{name: cat(name) for name in ("prompt_ids", "group_ids", "seeds", "init_seeds", "x_final", "step", "x", "x_next",
                                        "sigma", "sigma_next", "log_prob_old", "mean_old")})


def _as_train_mask(train_mask: torch.Tensor | None, batch: int, num_steps: int) -> torch.Tensor:
    if train_mask is None:
        return torch.zeros(batch, num_steps, dtype=torch.bool)
    if train_mask.ndim == 1:
        train_mask = train_mask.expand(batch, num_steps)
    counts = train_mask.sum(1)
    if (counts != counts[0]).any():
        raise ValueError("every sample must train the same number of steps")
    return train_mask


@torch.no_grad()
def rollout(
    policy: FlowPolicy,
    prompts: list[str],
    seeds: torch.Tensor,
    sigmas: torch.Tensor,
    kernel: str = "flow_sde",
    kernel_kwargs: dict | None = None,
    sde_mask: torch.Tensor | None = None,
    train_mask: torch.Tensor | None = None,
    prompt_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    init_seeds: torch.Tensor | None = None,
    guidance: float = 1.0,
    cond: Cond | None = None,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
) -> Rollout:
    """Sample B trajectories over `sigmas` ([N + 1]).

    sde_mask [N] bool: steps that use `kernel` (others are ODE steps); default all.
    train_mask [N] or [B, N] bool, a subset of sde_mask: transitions to store for training.
    batch_size: model forward batch (default all B at once).
    device: where the latents, noise and stored transitions live; default the policy's device
    (difrl.models.base.policy_device). Nothing leaves it during the trajectory: no per-step host round
    trip (on a GPU each one is a copy and a sync; docs/reference/specs/gpu-regime.md measured 1.15x pipe() with them).
    Ids and seeds stay on the CPU (they are indices and reward keys)."""
    B, N = len(prompts), len(sigmas) - 1
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    init_seeds = seeds if init_seeds is None else torch.as_tensor(init_seeds, dtype=torch.long)
    sde_mask = torch.ones(N, dtype=torch.bool) if sde_mask is None else sde_mask.bool()
    train_mask = _as_train_mask(train_mask, B, N)
    if (train_mask & ~sde_mask).any():
        raise ValueError("train_mask marks a step that is not stochastic (an ODE step has no log-prob)")
    device = policy_device(policy) if device is None else torch.device(device)
    cond = policy.encode(prompts) if cond is None else cond
    cond = {k: v.to(device) for k, v in cond.items()}
    step_fn, ode_fn = KERNELS[kernel], KERNELS["ode"]
    kernel_kwargs = kernel_kwargs or {}
    bs = batch_size or B

    lat = tuple(policy.latent_shape)
    x = initial_latents(init_seeds, lat, device)
    # small latents: every SDE step's noise in one vectorised draw ([S, B, *latent]; per-call overhead
    # dominates there). Large ones: step by step, so the fp64 intermediates stay one step's size.
    sde_steps = sde_mask.nonzero().flatten().tolist()
    step_noise = {}
    if sde_steps and B and len(sde_steps) * B * x[0].numel() <= _ONE_DRAW_MAX_ELEMENTS:
        step_noise = dict(zip(sde_steps, sample_noise(seeds, sde_steps, lat, device)))
    T = int(train_mask[0].sum()) if B else 0
    rec = {k: [] for k in ("x", "x_next", "sigma", "sigma_next", "log_prob", "mean", "step")}
    sigma_values = sigmas.detach().cpu().tolist()  # python floats: one read of the schedule, no per-step sync
    for i in range(N):
        sigma, sigma_next = sigma_values[i], sigma_values[i + 1]
        noise = step_noise.get(i)
        if noise is None and sde_mask[i]:
            noise = sample_noise(seeds, i, lat, device)
        outs: list[StepOutput] = []
        for lo in range(0, B, bs):
            sl = slice(lo, lo + bs)
            xb = x[sl]
            sig = torch.full((xb.shape[0],), sigma, device=device)
            v = policy.velocity(xb, sig, cond_select(cond, sl), guidance)
            if sde_mask[i]:
                outs.append(step_fn(xb, v, sig, torch.full_like(sig, sigma_next), noise[sl], **kernel_kwargs))
            else:
                outs.append(ode_fn(xb, v, sig, torch.full_like(sig, sigma_next)))
        out = outs[0] if len(outs) == 1 else StepOutput(*(torch.cat(parts) for parts in zip(*outs)))
        if train_mask[:, i].any():
            rows = train_mask[:, i]
            rec["x"].append((rows, x))
            rec["x_next"].append((rows, out.x_next))
            rec["log_prob"].append((rows, out.log_prob))
            rec["mean"].append((rows, out.mean))
            rec["sigma"].append((rows, torch.full((B,), sigma, device=device)))
            rec["sigma_next"].append((rows, torch.full((B,), sigma_next, device=device)))
            rec["step"].append((rows, torch.full((B,), i, dtype=torch.long, device=device)))
        x = out.x_next

    def stack(name: str, trailing: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
        # each sample's T trained transitions in step order: [B, T, *trailing]
        if not rec[name]:
            return torch.empty((B, 0, *trailing), dtype=dtype, device=device)
        rows = torch.stack([r for r, _ in rec[name]], dim=1)  # [B, S] bool, on the CPU
        vals = torch.stack([v for _, v in rec[name]], dim=1)  # [B, S, *trailing] on `device`
        # the trained (b, s) pairs, row-major (b, then step): positions found on the CPU mask and gathered on
        # the device, so the stored values never make a round trip (a boolean index would sync on a GPU)
        b, s = (i.to(device) for i in rows.nonzero(as_tuple=True))
        return vals[b, s].reshape(B, T, *trailing).to(dtype)

    return Rollout(
        prompts=list(prompts),
        prompt_ids=torch.zeros(B, dtype=torch.long) if prompt_ids is None else torch.as_tensor(prompt_ids),
        group_ids=torch.arange(B) if group_ids is None else torch.as_tensor(group_ids),
        seeds=seeds, init_seeds=init_seeds, cond=cond, x_final=x,
        step=stack("step", (), torch.long), x=stack("x", lat), x_next=stack("x_next", lat),
        sigma=stack("sigma", ()), sigma_next=stack("sigma_next", ()), log_prob_old=stack("log_prob", ()),
        mean_old=stack("mean", lat),
    )


def regenerate(policy: FlowPolicy, batch: Rollout, sigmas: torch.Tensor, **kwargs) -> Rollout:
    """Re-run the trajectories of `batch` from their seeds (same prompts, ids and initial noise)."""
    return rollout(policy, batch.prompts, batch.seeds, sigmas, prompt_ids=batch.prompt_ids,
                   group_ids=batch.group_ids, init_seeds=batch.init_seeds, **kwargs)


def recompute(policy: FlowPolicy, batch: Rollout, kernel: str, kernel_kwargs: dict | None = None,
              guidance: float = 1.0) -> StepOutput:
    """The stored transitions of `batch` (flat samples or tree edges) under the current policy, one
    forward over all B*T rows, each scored with its stored ``extras["logprob_scale"]`` (a tree's split
    edges; 1 where there is none: then this is exactly ``KERNELS[kernel](..., action=x_next)``).
    The trainer's ``transition_log_prob`` is this. Returns StepOutput with log_prob [B, T],
    mean [B*T, ...], std [B*T] (the std the log-prob used)."""
    B, T = batch.step.shape
    flat = lambda t: t.reshape(B * T, *t.shape[2:])  # noqa: E731
    x, x_next, sigma, sigma_next = flat(batch.x), flat(batch.x_next), flat(batch.sigma), flat(batch.sigma_next)
    v = policy.velocity(x, sigma, cond_repeat(batch.cond, T), guidance)
    scale = batch.extras.get("logprob_scale")
    scale = 1.0 if scale is None else flat(scale)
    out = split_step(kernel, x, v, sigma, sigma_next, action=x_next, logprob_scale=scale, **(kernel_kwargs or {}))
    return StepOutput(out.x_next, out.log_prob.view(B, T), out.mean, out.std)
