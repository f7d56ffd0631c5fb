"""The simulated cluster difrl plan runs the trainer in: a fake process group, a fake device, memory trackers.

    with simulated_processes(8) as accelerator, Collectives() as coll, simulated_device():
        ...                                   # the trainer's own functions, rank 0 of 8, on fake tensors
        tracker = peak_tracker(net, optimizer)  # FSDP2 categories; plain_tracker(net) for one unsharded process

docs/reference/specs/scale.md §3.2 has the tools (torch.testing's fake process group, FakeTensorMode,
torch.distributed._tools' trackers); difrl/train/planner/flow.py says what is run on them and what each row means.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

GIB = 1024 ** 3
# torch.distributed's collectives and DTensor's functional ones, counted by name; bytes: the tensor that travels
DIST_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                    "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast", "all_to_all_single",
                    "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list", "gather_object")
FUNCOL_COLLECTIVES = ("all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                      "all_reduce", "all_to_all_single", "broadcast")  # DTensor's full_tensor: all_gather_single


# ---------------------------------------------------------------------------------- the simulated processes


@contextlib.contextmanager
def fake_parameter_swaps():
    """Module.to / peft's adapter placement on fake parameters: torch swaps every fake parameter for its converted copy
    (Module._apply) and refuses while anything holds a weak reference to it, which FakeTensorMode's own bookkeeping
    does. Inside this block a refused swap of two fake tensors sets the data instead (what _apply does for ordinary
    tensors; fake tensors have no storage to copy); any other swap is torch's. Restored on exit."""
    import torch.utils as tu
    from torch._subclasses.fake_tensor import FakeTensor

    original = tu.swap_tensors

    def swap(t1, t2):
        try:
            return original(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            with torch.no_grad():
                t1.data = t2.data

    tu.swap_tensors = swap
    try:
        yield
    finally:
        tu.swap_tensors = original


def simulated_device():
    """FakeTensorMode for the simulated GPU, with the host's own numbers left real.

    Under plain FakeTensorMode every op is faked, also those on the small host tensors the trainer reads as numbers
    (the step masks' `.tolist()`, sample indices, the schedule's sigmas), which a fake tensor refuses. Here an op
    whose tensor arguments are all real runs for real (the trainer made them on the host: masks, seeds, sigmas), so
    does a draw from a seeded torch.Generator (the update's permutations, the samples' noise: counted as memory all
    the same), and everything that touches a fake tensor, or makes a new one from nothing (parameters,
    activations), is fake. A value the trainer reads from the simulated device itself (a loss, a norm) still raises
    DataDependentOutputException: the simulation keeps such reads out (plan_config turns off the ratio check), or
    reads zeros where a check only reads flags (`zero_reads`: the rollout copy's sync).

    `mode.host()` marks host code whose bookkeeping is made from nothing (the masked samplers' plans, confidences
    and records, the re-masks: torch.arange / full / zeros of [B, L]); `mode.device()` inside it marks the device
    code again (a network forward, a backward, an optimizer step). In host code a tensor made from nothing is real;
    a real tensor written with simulated values (a sampler records the tokens and confidences it drew) gets zeros
    there, the stand-in for values the simulation does not have; and a real boolean mask indexing a simulated
    tensor is read on the host (its count is the host's, not the device's). Outside host() nothing changes."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.utils import _pytree as pytree

    def real(t):
        return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and type(t) in (torch.Tensor, nn.Parameter)

    class HostAwareFakeMode(FakeTensorMode):
        reads_zero = False  # inside `zero_reads()`: a value read from the simulated device reads as 0 / False

        @contextlib.contextmanager
        def zero_reads(self):
            """Inside the block reading a simulated-device value (item, tolist, bool) gives 0 / False instead of
            raising: for checks that read flags (the rollout copy's sync and verify), which then never fire."""
            self.reads_zero = True
            try:
                yield
            finally:
                self.reads_zero = False
        on_host = False
        inner = 0  # > 0: inside a simulated op (its decomposition's own factories are the device's)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.reads_zero and func is torch.ops.aten._local_scalar_dense.default:
                dtype = args[0].dtype
                return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
            flat = [a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
            host_random = not flat and (kwargs or {}).get("generator") is not None  # seeded host draws: permutations
            if host_random or (flat and not any(isinstance(a, FakeTensor) for a in flat) and all(map(real, flat))) \
                    or (self.on_host and not flat and not self.inner):  # host code's bookkeeping made from nothing
                with unset_fake_temporarily():
                    return func(*args, **(kwargs or {}))
            if self.on_host and func._schema.is_mutable and args and real(args[0]):  # a host record of device values
                with unset_fake_temporarily():
                    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, FakeTensor) else t  # noqa: E731
                    return func(*pytree.tree_map(zeros, args), **pytree.tree_map(zeros, kwargs or {}))
            if self.on_host and func is torch.ops.aten.index.Tensor and any(
                    real(i) and i.dtype == torch.bool for i in args[1] if i is not None):
                with unset_fake_temporarily():  # a host mask's positions, read on the host
                    idx = [i for j in args[1] for i in ((j.nonzero(as_tuple=True)) if real(j) and j.dtype == torch.bool
                                                        else (j,))]
                args = (args[0], idx)
            self.inner += 1
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.inner -= 1

        @contextlib.contextmanager
        def _code(self, on_host: bool):
            saved, self.on_host = self.on_host, on_host
            try:
                yield
            finally:
                self.on_host = saved

        def host(self):
            return self._code(True)

        def device(self):
            return self._code(False)

    return HostAwareFakeMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def simulated_processes(gpus: int, fsdp: bool = True):
    """Rank 0 of `gpus` processes on a fake process group, with the environment `accelerate launch` sets for
    configs/accelerate/fsdp.yaml (FSDP2, resharded after forward, no offload) when `fsdp` and gpus > 1. Yields the
    Accelerator, its FSDP branches taken; restores the environment and destroys the group after."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    from difrl.train.dist.sharded_step import take_fsdp_branches

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
        # accelerate names a CPU process's device cpu:<local rank>; fake tensors tell cpu:0 from the cpu the model is
        # built on (a real run cannot), so the simulated device is plain cpu
        for state in (PartialState, AcceleratorState):
            state._shared_state["device"] = torch.device("cpu")
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
            out = fn(*args, **kwargs)
            # bytes: the collective's largest buffer (an all-gather's full output, a reduce-scatter's full input), an
            # argument of torch.distributed's (outputs are passed in) or what a functional collective returns
            tensors = [a for a in (*args, *kwargs.values(), out) if torch.is_tensor(a)]
            lists = [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
            nbytes = max([t.numel() * t.element_size() for t in tensors + lists] or [0])
            row = self.by_phase.setdefault(self.current, {}).setdefault(f"{kind}.{name}", [0, 0])
            row[0] += 1
            row[1] += nbytes
            return out

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
    from difrl.train.dist.full_tensors import is_sharded

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
    from difrl.train.dist.full_tensors import is_sharded

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


def device_metrics():
    from difrl.train.metrics import Metrics

    class DeviceMetrics(Metrics):
        """The metrics as a GPU run keeps them (masked sums with no data-dependent shape): the simulated device is the
        CPU, where Metrics would select the masked values first."""

        @staticmethod
        def on_host(t: torch.Tensor) -> bool:
            return False

    return DeviceMetrics


class ResidentBlind:
    """A torch memory tracker that never counts the storages of the resident tensors it is given (`ignore_resident`):
    the frozen encoders, the reference, the shadows and the rollout copy, whose bytes Memory adds to every phase from
    the objects themselves. Without it the tracker counts them a second time from the first op that reads them (an
    embedding reads the whole text encoder: FLUX.2-dev's 24-billion-parameter encoder appeared twice, 44.9 GiB in
    "frozen" and ~42.7 GiB more in "activations"). Every tracker registers tensors through
    `_update_and_maybe_create_winfos` (modules' parameters, inputs, gradients) or `_track` (every op's outputs, views
    of a parameter included: a Linear's weight.t()), the two methods overridden here
    (torch.distributed._tools.mem_tracker)."""

    _resident = None

    def ignore_resident(self, tensors) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages
        from torch.utils.weak import WeakIdKeyDictionary

        self._resident = WeakIdKeyDictionary()  # storage -> True; a DTensor's: its local shard's
        for t in tensors:
            for st in get_untyped_storages(t):
                self._resident[st] = True

    def _is_resident(self, t) -> bool:
        from torch.distributed._tools.common_utils import get_untyped_storages

        storages = get_untyped_storages(t) if self._resident is not None else ()
        return bool(storages) and all(st in self._resident for st in storages)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        return set() if self._is_resident(t) else super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _track(self, reftype, t) -> None:
        if not self._is_resident(t):
            super()._track(reftype, t)


def resident_tensors(*modules, shadows=()) -> list[torch.Tensor]:
    """The parameters and buffers of `modules` (None skipped) and the tensors of the `shadows` (EMA-like objects with a
    `shadow` dict): what Memory's `resident` bytes measure, for ResidentBlind.ignore_resident."""
    out = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())]
    return out + [t for e in shadows for t in e.shadow.values()]


def plain_tracker(net: nn.Module | None = None):
    """torch's MemTracker for an unsharded run (one GPU), reading global peaks only. MemTracker snapshots every module
    at every call (thousands per forward of a 12-billion-parameter model: slow here) and installs gradient hooks on the
    parameters of every module it sees run, which torch refuses for frozen ones (the text encoders). Here only `net`
    (the trained network, given) is registered, once, at its first call: its parameters count as parameters and its
    gradients as gradients; the reference and the frozen encoders are counted on the objects (Memory's `resident`), as
    under FSDP; every other tensor made inside is MemTracker's (activations, temporaries, optimizer state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PlainTracker(ResidentBlind, MemTracker):
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

    class PeakTracker(ResidentBlind, FSDPMemTracker):
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
