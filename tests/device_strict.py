"""A second device on a CPU machine, strict the way CUDA and NCCL are, for running whole trainers in the tests.

    with emulated_device():                         # tensors on `DEVICE` now carry data
        net.to(DEVICE)                              # the policy lives there, as on a GPU
        monkeypatch.setattr(accelerate, "Accelerator", StrictAccelerator)
        train(cfg)                                  # any collective handed a host tensor raises HostTensorInCollective

Why not plain `meta`: a meta tensor has shapes but no data, so a trainer on it cannot score, rank or log, and
cannot run a whole iteration. Why not gloo: it accepts host tensors in every collective, where NCCL raises
"Tensors must be CUDA and dense"; a green gloo test proves nothing about that (docs/architecture.md, Many processes).

Here a tensor "on the device" is a wrapper subclass that reports `DEVICE` (PyTorch's meta device) and holds
its values in a host tensor (`.inner`). A TorchDispatchMode runs every aten op on the inner tensors, so values
are exact (the same kernels as on the CPU), and re-wraps the results that belong on the device. What CUDA refuses
is refused here too:
- an op mixing device tensors with host tensors of one element or more (0-dim host tensors are allowed, as
  CUDA allows CPU scalars; so are host index tensors in advanced indexing, and copies between the two);
- `.numpy()` of a device tensor (it is not host memory);
and `StrictAccelerator` (in place of accelerate's Accelerator: one process) raises HostTensorInCollective for any
gather / reduce / broadcast / pad input that is not on `DEVICE`, as NCCL does. It counts every collective, and
the mode counts device-to-host reads (`.item()`, `float()`, `.tolist()`, `nonzero`, `.cpu()`: each is a sync on a
GPU) in `host_reads` and the bytes they bring to the host in `host_bytes` (a `nonzero` or `masked_select` counts
8: its result stays on the device, only its length is read).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

import torch
from torch.utils import _pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

DEVICE = torch.device("meta")
aten = torch.ops.aten

# ops that legitimately take tensors on both sides (CUDA: copies, and CPU index tensors in advanced indexing)
MIXING_OK = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
             aten._index_put_impl_.default, aten.index_put.default, aten._copy_from.default,
             aten._copy_from_and_resize.default}
# device -> host reads: one sync each on a GPU
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
              aten.is_nonzero.default}


class OnDevice(torch.Tensor):
    """A tensor that reports DEVICE; its values live in `self.inner` (a host tensor of the same shape)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        assert type(inner) is torch.Tensor or isinstance(inner, torch.nn.Parameter), type(inner)
        out = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                  storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                  layout=inner.layout, device=DEVICE, requires_grad=False)
        out.inner = inner
        return out

    def __repr__(self, *, tensor_contents=None):
        return f"OnDevice({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # an op on a device tensor where the mode is not active (another thread: the reward stage's overlap thread;
        # dispatch modes are per thread): the same rules, counted by the innermost emulated_device()
        if not _ACTIVE:
            raise RuntimeError(f"{func}: a device tensor was used outside emulated_device()")
        return _ACTIVE[-1].__torch_dispatch__(func, types, args, kwargs)

    def tolist(self):  # a host read, as on CUDA (PyTorch's tolist refuses subclasses)
        if _ACTIVE:
            _ACTIVE[-1].host_reads += 1
            _ACTIVE[-1].host_bytes += self.inner.numel() * self.inner.element_size()
        return self.inner.tolist()

    def numpy(self, *args, **kwargs):  # CUDA: "can't convert cuda:0 device type tensor to numpy"
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")


class HostTensorInCollective(AssertionError):
    """A collective received a tensor that is not on the accelerator's device (NCCL raises here)."""


def on_device(t) -> bool:
    return isinstance(t, OnDevice)


def _is_device_kw(dev) -> bool:
    return dev is not None and torch.device(dev).type == DEVICE.type


def _device_as_keyword(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An op's `device` argument passed by position (aten.to.device(self, device, dtype)) moved to the keywords."""
    names = [a.name for a in func._schema.arguments]
    if "device" in names and names.index("device") < len(args):
        i = names.index("device")
        kwargs = {**kwargs, **{n: v for n, v in zip(names[i:], args[i:])}}
        args = args[:i]
    return args, kwargs


def _read_bytes(func, args: tuple) -> int:
    """Bytes a device -> host read brings to the host: a copy's whole source, a scalar's element, 8 for the length a
    nonzero / masked_select syncs on (its result stays on the device), 1 for equal / is_nonzero's answer."""
    if func in (aten._to_copy.default, aten.copy_.default):
        src = args[0] if func is aten._to_copy.default else args[1]
        return src.numel() * src.element_size()
    if func is aten._local_scalar_dense.default:
        return args[0].element_size()
    return 8 if func in (aten.nonzero.default, aten.masked_select.default) else 1


class EmulatedDevice(TorchDispatchMode):
    """The dispatch mode that gives DEVICE tensors their data (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0  # device -> host reads (syncs on a GPU)
        self.host_bytes = 0  # the bytes they bring to the host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = _device_as_keyword(func, args, kwargs or {})
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        dev_in = any(on_device(a) for a in flat)
        to_device = _is_device_kw(kwargs.get("device"))
        if kwargs.get("device") is not None and not to_device:
            dev_out = False  # .to("cpu") / .cpu(): the host copy
        else:
            dev_out = dev_in or to_device
        if dev_in and func not in MIXING_OK:
            host = [a for a in flat if isinstance(a, torch.Tensor) and not on_device(a) and a.dim() > 0]
            if host:
                raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found at least two "
                                   f"devices, {DEVICE} and cpu (a host tensor of shape {tuple(host[0].shape)})")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default) \
                and not on_device(args[0]) and any(on_device(i) for i in args[1] if i is not None):
            raise RuntimeError(f"{func}: indices should be either on cpu or on the same device as the indexed tensor "
                               "(cpu)")  # CUDA: a host tensor cannot be indexed with device indices
        if dev_in and (func in HOST_READS or (kwargs.get("device") is not None and not to_device)
                       or (func is aten.copy_.default and not on_device(args[0]))):
            self.host_reads += 1  # a value read on the host or a copy to it: a sync each on a GPU
            self.host_bytes += _read_bytes(func, args)
        unwrap = lambda a: a.inner if on_device(a) else a  # noqa: E731
        inner_args, inner_kwargs = pytree.tree_map(unwrap, (args, kwargs))
        if _is_device_kw(inner_kwargs.get("device")):
            inner_kwargs["device"] = torch.device("cpu")
        out = func(*inner_args, **inner_kwargs)
        if not dev_out:
            return out
        # in-place and out= ops return their (host) argument: hand back the device tensor that wraps it
        wrappers = {id(a.inner): a for a in flat if on_device(a)}
        def wrap(t):
            if not isinstance(t, torch.Tensor) or on_device(t):
                return t
            return wrappers[id(t)] if id(t) in wrappers else OnDevice(t)

        # a view of a normal tensor taken in inference mode is a normal tensor (it shares the base's version counter)
        normal = torch.is_inference_mode_enabled() and any(on_device(a) and not a.is_inference() for a in flat)
        with torch.inference_mode(False) if normal else nullcontext():
            wrapped = pytree.tree_map(wrap, out)
        aliases = any(getattr(r, "alias_info", None) for r in func._schema.returns)
        if func is aten.detach.default or not aliases or torch.is_inference_mode_enabled():  # inference: no views
            return wrapped
        return return_and_correct_aliasing(func, args, kwargs, wrapped)


class DataOnDevice(TorchFunctionMode):
    """torch.tensor / as_tensor / new_tensor of Python data build the tensor on the device without an aten op that
    the dispatch mode sees: they are built on the host here and moved (the move is the dispatch mode's)."""

    BUILDERS = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.BUILDERS and not _PAUSED:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            target = kwargs.get("device", args[0].device if func is torch.Tensor.new_tensor else None)
            if _is_device_kw(target) and not isinstance(data, torch.Tensor):
                kwargs["device"] = "cpu"
                return func(*args, **kwargs).to(DEVICE)
        return func(*args, **kwargs)


_ACTIVE: list[EmulatedDevice] = []
_PAUSED: list[bool] = []


@contextmanager
def emulated_device():
    """Inside the block, tensors can live on DEVICE with their data; yields the mode (its `host_reads`)."""
    mode = EmulatedDevice()
    run = threading.Thread.run

    def run_in_mode(thread):  # dispatch modes are per thread: a thread started in the block (the reward stage's
        with DataOnDevice(), mode:  # overlap thread) sees the same device
            run(thread)

    threading.Thread.run = run_in_mode
    with DataOnDevice(), mode:
        _ACTIVE.append(mode)
        try:
            yield mode
        finally:
            _ACTIVE.pop()
            threading.Thread.run = run


def move_to_device(obj):
    """`obj.to(DEVICE)` (a module or a diffusers pipeline) with the parameter objects kept: tied weights stay tied
    (BERT's embeddings and decoder), as `.to("cuda")` keeps them. A plain `.to` would replace each parameter by a new
    one per module, since a wrapper subclass cannot take the place of a plain tensor's data."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return obj.to(DEVICE)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


@contextmanager
def host_only():
    """Inside an emulated_device() block: plain PyTorch again (e.g. a loader that builds on the real meta device)."""
    from torch.utils._python_dispatch import _disable_current_modes

    _PAUSED.append(True)
    try:
        with _disable_current_modes():
            yield
    finally:
        _PAUSED.pop()


def _check(what: str, obj) -> None:
    for t in pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor) and not on_device(t):
            raise HostTensorInCollective(f"{what} received a tensor on {t.device} of shape {tuple(t.shape)}; NCCL "
                                         f"takes only tensors on the accelerator's device ({DEVICE})")


class StrictAccelerator:
    """accelerate's Accelerator for one process on DEVICE, whose collectives check their inputs as NCCL does.
    `calls` counts them by name; the trainers are expected to make every collective through
    difrl.utils.collectives, which this checks from the outside."""

    instances: list["StrictAccelerator"] = []

    def __init__(self, *args, **kwargs):
        from accelerate.utils import DistributedType

        self.device = DEVICE
        self.num_processes, self.process_index, self.local_process_index = 1, 0, 0
        self.is_main_process = self.is_local_main_process = True
        self.distributed_type = DistributedType.NO
        self.mixed_precision = kwargs.get("mixed_precision") or "no"
        self.calls: dict[str, int] = {}
        StrictAccelerator.instances.append(self)

    def _count(self, name: str, obj) -> None:
        _check(f"accelerator.{name}", obj)
        self.calls[name] = self.calls.get(name, 0) + 1

    def gather(self, tensor):
        self._count("gather", tensor)
        return tensor

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        self._count("reduce", tensor)
        return pytree.tree_map(lambda t: t * scale if scale != 1.0 else t, tensor)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        self._count("pad_across_processes", tensor)
        return tensor

    def gather_for_metrics(self, tensor, use_gather_object: bool = False):
        self._count("gather_for_metrics", tensor)
        return tensor

    def prepare(self, *objects):
        return objects[0] if len(objects) == 1 else objects

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        return model

    def backward(self, loss, **kwargs):
        loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def no_sync(self, model):
        return nullcontext()

    def print(self, *args, **kwargs):
        print(*args, **kwargs)

    def wait_for_everyone(self):
        pass

    def end_training(self):
        pass
