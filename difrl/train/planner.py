"""Real scale, simulated: `difrl plan` runs the trainer's own setup and one iteration at real size on this machine.

    difrl plan configs/flux_flow_grpo.yaml train.lora.enabled=false train.grad_accum=24 train.kl_beta=0.04 \\
        --gpus 8 --gpu-memory 80 --json plan.json          # FLUX.1-dev full fine-tune on 8 x 80 GiB: does it fit?
    difrl plan configs/wan_dance_grpo.yaml --gpus 1 --arch wan2.1-t2v-14b

How. One process plays rank 0 of N: a fake process group (torch.testing._internal.distributed.fake_pg: collectives
return at once with correctly shaped outputs) and FakeTensorMode (tensors carry shape, dtype and device, no storage),
so a 12-billion-parameter pipeline is built from its architecture configs (difrl.models.arch: the shipped reference
checkpoint of the family when model.path is not a local directory, or `--arch`) in seconds and no memory. An
Accelerator is made as `accelerate launch --config_file configs/accelerate/fsdp.yaml` would make it, with accelerate's
FSDP branches taken as on GPUs (difrl.train.sharding.take_fsdp_branches). Then the functions `difrl train` calls run
on it, not a replica of them:

- setup: the world around the adapter (difrl.worlds.diffusers.flow_world), difrl.train.flow_plan.plan (the split and
  micro-batching), difrl.train.flow.setup_training (LoRA or masters and reference, FSDP2, optimizer, EMA, copy);
- rollout: difrl.rollout.rollout of one forward batch (sampler.rollout_batch samples, every sampler step, prompts
  encoded); the process's other batches are the same computation, so their stored trajectories are that batch's
  repeated (cat_rollouts) to the process's sample count and their forwards are counted, not run;
- update: difrl.train.flow.policy_update over those samples, with the configured micro-batch and accumulation: its
  first micro-step and the update's last one (which clips, steps AdamW and updates the EMA) run (`MICRO_STEPS`);
  the ones between repeat the first exactly (same shapes, same collectives, gradients already allocated), so their
  collectives are counted, not run. AdamW's moments exist as from the first update on (steady_optimizer_state).

Memory is measured per phase by torch's trackers (torch.distributed._tools: FSDPMemTracker for the sharded network,
which attributes sharded / unsharded parameters and gradients, optimizer state, activations, temporaries and the
all-gather / reduce-scatter buffers; MemTracker for setup and unsharded runs), plus what lives outside the trained
network, measured on the objects themselves: the frozen reference, the EMA / NFT / copy-source shadows, the text
encoders and VAE, the rollout copy. Collectives are counted with their bytes as they are called
(torch.distributed and DTensor's functional collectives). What is not simulated, said in every row's `not_simulated`:
reward models (run on the same GPU: add their size), the evaluation, the checkpoint writes, CUDA's caching allocator
and workspaces (fragmentation: keep headroom, `FIT_MARGIN`), NCCL buffers, and kernels' internal scratch.

The simulated device is the CPU (fake tensors need no driver; FSDP2 on a fake CUDA device would), so everything the
trainer puts on `accelerator.device` counts as device memory; nothing is on the host in a simulated run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

GIB = 1024 ** 3
MICRO_STEPS = 2  # micro-steps of the update that run: the first (accumulating) and the update's last (optimizer step)
FIT_MARGIN = 0.9  # a plan fits when its peak is at most this fraction of the GPU (allocator fragmentation, NCCL, CUDA context)
NOT_SIMULATED = ("reward models", "evaluation", "checkpoint writes", "CUDA allocator fragmentation and context",
                 "NCCL buffers")
# torch.distributed's collectives and DTensor's functional ones, counted by name; bytes: the tensor that travels
DIST_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                    "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast", "all_to_all_single",
                    "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list", "gather_object")
FUNCOL_COLLECTIVES = ("all_gather_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast")


# ---------------------------------------------------------------------------------- the simulated processes


def simulated_device():
    """FakeTensorMode for the simulated GPU, with the host's own numbers left real.

    Under plain FakeTensorMode every op is faked, also those on the small host tensors the trainer reads as numbers
    (the step masks' `.tolist()`, sample indices, the schedule's sigmas), which a fake tensor refuses. Here an op
    whose tensor arguments are all real runs for real (the trainer made them on the host: masks, seeds, sigmas), so
    does a draw from a seeded torch.Generator (the update's permutations, the samples' noise: counted as memory all
    the same), and everything that touches a fake tensor, or makes a new one from nothing (parameters,
    activations), is fake. A value the trainer reads from the simulated device itself (a loss, a norm) still raises
    DataDependentOutputException: the simulation keeps such reads out (plan_config turns off the ratio check)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.utils import _pytree as pytree

    class HostAwareFakeMode(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
            host_random = not flat and (kwargs or {}).get("generator") is not None  # seeded host draws: permutations
            if host_random or (flat and not any(isinstance(a, FakeTensor) for a in flat)
                               and all(type(a) in (torch.Tensor, nn.Parameter) for a in flat)):
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return HostAwareFakeMode(allow_non_fake_inputs=True)



@contextlib.contextmanager
def simulated_processes(gpus: int, fsdp: bool = True):
    """Rank 0 of `gpus` processes on a fake process group, with the environment `accelerate launch` sets for
    configs/accelerate/fsdp.yaml (FSDP2, resharded after forward, no offload) when `fsdp` and gpus > 1. Yields the
    Accelerator, its FSDP branches taken; restores the environment and destroys the group after."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    from difrl.train.sharding import take_fsdp_branches

    if dist.is_initialized():
        raise RuntimeError("difrl plan simulates its own process group: run it in a process that has none")
    env = {"ACCELERATE_MIXED_PRECISION": "no"}
    if gpus > 1:  # one GPU: one plain process, as `difrl train` runs it
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(gpus), "LOCAL_WORLD_SIZE": str(min(gpus, 8)),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    if fsdp and gpus > 1:
        env.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
                    "FSDP_OFFLOAD_PARAMS": "false", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"})
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_FSDP")
    saved = {k: os.environ.get(k) for k in (*env, *launch)}
    for k in launch:  # this process's own launch, if any, is not the simulated one
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        if gpus > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
        # device_placement off: the simulated model is built on the simulated device already, and moving fake
        # parameters (Module.to swaps them) is refused while a memory tracker holds weak references to them
        accelerator = Accelerator(cpu=True, device_placement=False)
        take_fsdp_branches(accelerator)
        yield accelerator
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Collectives:
    """Counts every collective called inside `phase(name)` (count and bytes per phase): torch.distributed's (FSDP2's
    all-gathers and reduce-scatters, accelerate's gathers) and DTensor's functional ones (full_tensor, grad-norm)."""

    def __init__(self):
        self.by_phase: dict[str, dict[str, list[int]]] = {}
        self.current = "setup"
        self._saved: list = []

    def _wrap(self, module, name: str, kind: str):
        fn = getattr(module, name)

        def counted(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            lists = [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
            nbytes = max([t.numel() * t.element_size() for t in tensors + lists] or [0])
            row = self.by_phase.setdefault(self.current, {}).setdefault(f"{kind}.{name}", [0, 0])
            row[0] += 1
            row[1] += nbytes
            return fn(*args, **kwargs)

        self._saved.append((module, name, fn))
        setattr(module, name, counted)

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for name in DIST_COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, "dist")
        for name in FUNCOL_COLLECTIVES:
            if hasattr(funcol, name):
                self._wrap(funcol, name, "funcol")
        return self

    def __exit__(self, *exc):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def scale(self, phase: str, factor: float) -> None:
        """Counts of `phase` that stand for `factor` times as many identical calls (micro-steps, rollout batches)."""
        for row in self.by_phase.get(phase, {}).values():
            row[0], row[1] = round(row[0] * factor), round(row[1] * factor)

    def summary(self, phase: str) -> dict:
        rows = self.by_phase.get(phase, {})
        return {"count": sum(r[0] for r in rows.values()), "gib": sum(r[1] for r in rows.values()) / GIB,
                "by_kind": {k: {"count": r[0], "gib": r[1] / GIB} for k, r in sorted(rows.items())}}


def module_bytes(*modules) -> int:
    """Bytes of the parameters and buffers of `modules` held by this process (a DTensor's local shard), each storage
    once (tied weights, shared base layers)."""
    from difrl.train.sharding import is_sharded

    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for t in [*m.parameters(), *m.buffers()]:
            local = t.to_local() if is_sharded(t) else t
            if id(t) not in seen:
                seen.add(id(t))
                total += local.numel() * local.element_size()
    return total


def tensor_bytes(tensors) -> int:
    from difrl.train.sharding import is_sharded

    total = 0
    for t in tensors:
        local = t.to_local() if is_sharded(t) else t
        total += local.numel() * local.element_size()
    return total


def steady_optimizer_state(optimizer, params: dict) -> None:
    """AdamW's moments as they are from the first optimizer step on (the simulated iteration is any later one): a
    step with zero gradients and learning rate 0 creates them and moves no weight (weight decay is scaled by lr)."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params.values():
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def _device_metrics():
    from difrl.train.metrics import Metrics

    class DeviceMetrics(Metrics):
        """The metrics as a GPU run keeps them (masked sums with no data-dependent shape): the simulated device is the
        CPU, where Metrics would select the masked values first."""

        @staticmethod
        def on_host(t: torch.Tensor) -> bool:
            return False

    return DeviceMetrics


def plain_tracker(net: nn.Module | None = None):
    """torch's MemTracker for an unsharded run (one GPU), reading global peaks only. MemTracker snapshots every module
    at every call (thousands per forward of a 12-billion-parameter model: slow here) and installs gradient hooks on the
    parameters of every module it sees run, which torch refuses for frozen ones (the text encoders). Here only `net`
    (the trained network, given) is registered, once, at its first call: its parameters count as parameters and its
    gradients as gradients; the reference and the frozen encoders are counted on the objects (Memory's `resident`), as
    under FSDP; every other tensor made inside is MemTracker's (activations, temporaries, optimizer state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PlainTracker(MemTracker):
        _registered = False

        def _pre_fw_hook(self, module, inputs):
            if net is None or module is not net or self._registered:
                return
            self._registered = True
            from torch.distributed._tools.mem_tracker import _MemRefType

            for p in net.parameters():  # MemTracker's registration, with hooks only where there is a gradient (LoRA)
                self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
                if p.requires_grad:
                    def hook(g, tracker=self):  # returns None: the gradient is not replaced
                        tracker._update_and_maybe_create_winfos(g, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(hook), p.register_post_accumulate_grad_hook(lambda q, h=hook: h(q.grad)))
            for b in net.buffers():
                self._update_and_maybe_create_winfos(b, _MemRefType.BUFFER)

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return PlainTracker()


def peak_tracker(net, optimizer):
    """torch's FSDPMemTracker for `net`, reading global peaks only. It keeps per-module statistics for one call of each
    unit per iteration and refuses a second (NotImplementedError); a rollout calls every unit once per sampler step.
    Each forward call of a unit here starts its module statistics afresh (they are not read), the global peak and its
    categories stay the tracker's."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class PeakTracker(FSDPMemTracker):
        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def restart(*args, **kwargs):
                if not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return restart

    return PeakTracker(net, optimizer)


class Memory:
    """Per-phase peaks of this process's memory, by category. Inside `tracking(tracker)` a torch memory tracker
    (FSDPMemTracker / MemTracker) sees every tensor made or touched; `phase(name)` restarts its peak, and the
    phase's peak is the tracker's peak snapshot plus `resident` (bytes outside what the tracker sees: the reference,
    shadows, frozen encoders, measured on the objects)."""

    FSDP = {"Sharded Param": "params", "Unsharded Param": "unsharded_params", "Buffer": "params",
            "Sharded Grad": "grads", "Unsharded Grad": "unsharded_grads", "Activation": "activations",
            "Temp": "activations", "Inputs": "activations", "All Gather": "collective_buffers",
            "Reduce Scatter": "collective_buffers", "OptState": "optimizer"}
    PLAIN = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Activation": "activations",
             "Temp": "activations", "Optstate": "optimizer", "Other": "other"}

    def __init__(self):
        self.phases: dict[str, dict[str, float]] = {}

    @staticmethod
    def _categories(snapshot: dict, names: dict) -> dict[str, int]:
        out: dict[str, int] = {}
        for dev, dev_snap in snapshot.items():
            if torch.device(dev).type == "meta":  # placeholders (a reference skeleton before it is filled): no memory
                continue
            for key, value in dev_snap.items():
                key = getattr(key, "value", key)  # torch's _RefType enums, e.g. "Sharded Param"
                if key == "Total":
                    continue
                cat = names.get(str(key), "other")
                out[cat] = out.get(cat, 0) + int(value)
        return out

    @staticmethod
    def restart_peak(tracker) -> None:
        # torch 2.14.1's MemTracker keeps its peak in _peak_mem / _peak_mem_snap (set the same way on __enter__);
        # tests/test_planner.py fails if that changes
        tracker._peak_mem_snap = tracker.get_tracker_snapshot()
        tracker._peak_mem = {dev: next(v for k, v in snap.items() if getattr(k, "value", k) == "Total")
                             for dev, snap in tracker._peak_mem_snap.items()}

    def record(self, name: str, tracker, names: dict, resident: dict[str, int]) -> None:
        cats = self._categories(tracker.get_tracker_snapshot("peak"), names)
        for k, v in resident.items():
            cats[k] = cats.get(k, 0) + v
        row = {f"{k}_gib": v / GIB for k, v in sorted(cats.items())}
        row["peak_gib"] = sum(cats.values()) / GIB
        self.phases[name] = row


# ---------------------------------------------------------------------------------- the plan of a flow run


def resolve_arch(cfg, arch: str | None) -> tuple[Path, str]:
    """The architecture simulated: `--arch`, else model.path when it is a local pipeline directory (its configs,
    no weights read), else the shipped reference checkpoint of model.kind (difrl.models.arch.REFERENCE_ARCH)."""
    from difrl.models.arch import REFERENCE_ARCH, arch_dir

    if arch is not None:
        return arch_dir(arch), arch
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is not None and (path / "model_index.json").is_file():
        return path, str(path)
    if cfg.model.kind not in REFERENCE_ARCH:
        raise ValueError(f"difrl plan simulates the diffusers families ({', '.join(REFERENCE_ARCH)}); model.kind="
                         f"{cfg.model.kind} has no architecture to build (give a local pipeline directory as model.path)")
    return arch_dir(REFERENCE_ARCH[cfg.model.kind]), REFERENCE_ARCH[cfg.model.kind]


def plan_config(cfg):
    """The config as the simulation runs it: prompts placeholders when the prompt file is not on this machine (their
    text does not change a shape: the pipelines pad to the text length), and the first-step ratio check off (it reads
    values, which fake tensors do not have)."""
    mc = cfg.model
    if mc.prompts is None and not (mc.prompt_file and Path(mc.prompt_file).is_file()):
        mc = dataclasses.replace(mc, prompts=[f"prompt {i}" for i in range(cfg.rollout.prompts_per_iter)], prompt_file=None)
    return dataclasses.replace(cfg, model=mc, train=dataclasses.replace(cfg.train, ratio_check=False))


def plan_flow(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None,
              micro_steps: int = MICRO_STEPS, config_name: str = "") -> dict:
    """One row: the per-rank peaks of setup, rollout and update, the categories at the overall peak, collectives per
    phase, and whether it fits `gpu_memory_gib` (None: no verdict)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp import FSDPModule

    from difrl.models.adapters import arch_flow_policy
    from difrl.rollout import cat_rollouts, rollout
    from difrl.train.flow import policy_update, setup_training
    from difrl.train.flow_plan import plan, step_masks
    from difrl.train.objectives import nft_sigmas
    from difrl.utils.rng import mix_seed
    from difrl.worlds import world_file
    from difrl.worlds.diffusers import policy_options

    if cfg.rollout.kind != "flat":
        raise ValueError(f"difrl plan simulates flat rollouts; rollout.kind={cfg.rollout.kind} is not simulated yet")
    cfg = plan_config(cfg)
    path, arch_name = resolve_arch(cfg, arch)
    DeviceMetrics = _device_metrics()
    t0 = time.perf_counter()
    memory, collectives = Memory(), Collectives()
    with simulated_processes(gpus) as accelerator, collectives, simulated_device():
        # ================================================================ setup
        setup_tracker = plain_tracker()
        with setup_tracker:
            options = {**policy_options(cfg.model.kind, cfg), "device": None}
            policy = arch_flow_policy(cfg.model.kind, path, **options)
            world = world_file(cfg.model.kind).flow_world(cfg.model.kind, None, cfg, policy=policy)
            with tempfile.TemporaryDirectory() as tmp, unset_fake_temporarily():
                n_total, per_proc, T, _, micro = plan(cfg, world, gpus, Path(tmp), lambda *a: None)
                sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
            trainee = setup_training(cfg, policy, accelerator)
        memory.record("setup", setup_tracker, Memory.PLAIN, {})
        steady_optimizer_state(trainee.optimizer, trainee.params)
        frozen = [c for n, c in policy.pipe.components.items() if isinstance(c, nn.Module) and n != "transformer"]
        shadows = [e for e in (trainee.ema, trainee.old) if e is not None]
        resident = {"reference": module_bytes(trainee.reference), "frozen": module_bytes(*frozen),
                    "ema": sum(tensor_bytes(e.shadow.values()) for e in shadows)}
        if trainee.rollout_copy is not None:
            resident["rollout_copy"] = module_bytes(getattr(trainee.rollout_copy, "module", None))
        if isinstance(trainee.net, FSDPModule):
            tracker, names = peak_tracker(trainee.net, trainee.optimizer), Memory.FSDP
        else:
            tracker, names = plain_tracker(trainee.net), Memory.PLAIN
            tracker.track_external(trainee.net, trainee.optimizer)

        # ================================================================ rollout
        with unset_fake_temporarily():  # the iteration's indices and masks are real: the sampler reads them as numbers
            B = min(cfg.sampler.rollout_batch or per_proc, per_proc)  # one forward batch
            k = torch.arange(B)
            seeds = torch.tensor([mix_seed(cfg.seed, 0, 0, int(i)) for i in k])
            sde_mask, train_mask, _ = step_masks(cfg, 0, n_total)
            prompt_ids, group_ids = k // cfg.rollout.group_size, k // cfg.rollout.group_size
        prompts = [world.prompts[int(i) % len(world.prompts)] for i in prompt_ids]
        with tracker:
            collectives.current = "rollout"
            Memory.restart_peak(tracker)
            trainee.unwrapped.eval()
            part = rollout(policy, prompts, seeds, sigmas, cfg.sampler.kind, cfg.sampler.kernel_kwargs(), sde_mask,
                           train_mask[:B], prompt_ids, group_ids, seeds, cfg.sampler.guidance, batch_size=B)
            batch = cat_rollouts([part] * -(-per_proc // B)) if per_proc > B else part
            memory.record("rollout", tracker, names, resident)
            collectives.scale("rollout", per_proc / B)

            # ============================================================ update
            collectives.current = "update"
            Memory.restart_peak(tracker)
            trainee.unwrapped.train()
            with unset_fake_temporarily():
                advantages, keep = torch.zeros(len(batch)), torch.ones(len(batch), dtype=torch.bool)
            train_sigmas = nft_sigmas(cfg, sigmas) if cfg.train.objective == "nft" else None
            policy_update(cfg, policy, trainee, accelerator, batch, advantages, keep, None, T, micro, 0,
                          DeviceMetrics(cfg.sampler.num_steps), train_sigmas, max_micro_steps=micro_steps)
            memory.record("update", tracker, names, resident)
            ran = min(micro_steps, cfg.train.inner_epochs * -(-len(batch) // micro.records))
            total_micro = cfg.train.inner_epochs * -(-len(batch) // micro.records)
            collectives.scale("update", total_micro / ran)
    seconds = time.perf_counter() - t0
    return plan_row(cfg, config_name, arch_name, gpus, gpu_memory_gib, memory, collectives, micro, per_proc, seconds)


def plan_row(cfg, config_name: str, arch_name: str, gpus: int, gpu_memory_gib, memory: Memory, collectives: Collectives, micro,
             per_proc: int, seconds: float) -> dict:
    """The JSON row: identity of the run, the peak phase's categories at top level, every phase's peak."""
    phases = memory.phases
    worst = max(("rollout", "update"), key=lambda p: phases[p]["peak_gib"])
    row = {"config": config_name, "arch": arch_name, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib,
           "method": "full" if not cfg.train.lora.enabled else f"lora r{cfg.train.lora.rank}",
           "model_dtype": cfg.model.dtype, "grad_accum": cfg.train.grad_accum, "micro_batch": micro.transitions,
           "samples_per_gpu": per_proc, "kl_reference": cfg.train.kl_beta > 0, "ema": cfg.train.ema_decay > 0,
           "peak_phase": worst, "peak_gib": phases[worst]["peak_gib"], "setup_peak_gib": phases["setup"]["peak_gib"],
           "rollout_peak_gib": phases["rollout"]["peak_gib"], "update_peak_gib": phases["update"]["peak_gib"]}
    row.update({k: v for k, v in phases[worst].items() if k != "peak_gib"})
    row["phases"] = phases  # every phase's peak and its categories
    overall = max(row["peak_gib"], row["setup_peak_gib"])
    row["fits"] = None if gpu_memory_gib is None else bool(overall <= FIT_MARGIN * gpu_memory_gib)
    for phase in ("setup", "rollout", "update"):
        s = collectives.summary(phase)
        row[f"{phase}_collectives"], row[f"{phase}_collective_gib"] = s["count"], s["gib"]
    row["collectives_by_kind"] = {p: collectives.summary(p)["by_kind"] for p in ("setup", "rollout", "update")}
    row["not_simulated"] = list(NOT_SIMULATED)
    row["simulation_seconds"] = seconds
    return row


# ---------------------------------------------------------------------------------- the command


def format_rows(rows: list[dict]) -> str:
    """A plain table of the rows for the terminal."""
    cols = ("arch", "method", "gpus", "peak_gib", "setup_peak_gib", "params_gib", "grads_gib", "unsharded_grads_gib",
            "optimizer_gib", "activations_gib", "reference_gib", "ema_gib", "frozen_gib", "fits")
    lines = [" | ".join(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, 0.0)
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(args: argparse.Namespace, load_config) -> int:
    """`difrl plan CONFIG [key=value ...] --gpus N [--gpu-memory GiB] [--arch NAME] [--json PATH]`."""
    cfg = load_config(args.config, args.overrides)
    rows = [plan_flow(cfg, n, args.gpu_memory, args.arch, config_name=args.config) for n in args.gpus]
    print(format_rows(rows))
    for r in rows:
        if r["fits"] is not None:
            verdict = "fits" if r["fits"] else "does NOT fit"
            print(f"difrl plan: {r['arch']} {r['method']} on {r['gpus']} GPU(s): peak {max(r['peak_gib'], r['setup_peak_gib']):.1f} "
                  f"GiB per GPU ({r['peak_phase']}; setup {r['setup_peak_gib']:.1f}) {verdict} {args.gpu_memory:g} GiB "
                  f"(at most {FIT_MARGIN:.0%} of it: allocator and NCCL headroom)")
    print(f"simulated, not measured on a GPU; not simulated: {', '.join(NOT_SIMULATED)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"difrl plan: {len(rows)} row(s) written to {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a flow config (YAML); model.path may be a placeholder: the family's reference "
                                  "architecture is simulated")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for difrl train")
    p.add_argument("--gpus", type=int, nargs="+", default=[1], help="processes (GPUs) to simulate; several: one row each")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU for the verdict (e.g. 80, 141)")
    p.add_argument("--arch", default=None, help="a shipped architecture (difrl/assets/arch/) instead of the family's "
                                                "reference checkpoint")
    p.add_argument("--json", default=None, help="write the rows to this file as a JSON list")


