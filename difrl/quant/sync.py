"""The rollout copy: a separate, quantized copy of the policy, refreshed from it after every update.

    copy = RolloutCopy(policy_module, "nvfp4", **QUANT_PRESETS["digits"])
    with copy.active(policy):            # policy.velocity now runs the quantized copy
        batch = rollout(policy, ...)
    ... optimizer.step() ...
    copy.sync(policy_module)             # re-merge LoRA, re-quantize; raises WeightSyncError on a no-op sync
    RolloutCopy(sharded, "fp8_row", skeleton=meta_copy, weights=one_unit_at_a_time)   # FSDP: difrl/train/flow/rollout_copy.py

LoRA is merged into the copy's weights (W = W_base + scaling * B @ A, Sol-RL's sync_lora_to_inference,
docs/reference/specs/lowprec-and-correctors.md §1.2), so the quantized GEMM sees the weights the policy really uses.
Frameworks have shipped a silent no-sync bug (the inference engine kept stale weights after updates); here a sync after
a change of the policy that leaves every rollout weight unchanged stops the run, and after every sync `verify`
checks that the copy holds the policy's current weights as its format quantizes them (every
high-precision tensor whole, a moving block of rows of each quantized layer), so a sync that skips one
layer stops the run too.

The policy's weights reach the copy as state-dict *parts* (`weights(source)`: an iterable of merged state dicts, by
default one, `merged_state_dict(source)`). A sharded policy (FSDP2) yields one part per FSDP unit, each gathered
just for its turn (difrl/train/flow/rollout_copy.py), and the copy is then built from a `skeleton` whose parameters are
empty meta tensors, filled and quantized one part at a time: the whole model is never held in high precision at
once. Sync, its no-op check and `verify` go part by part too, with a single host read at the end; every process
computes the same flags from the same gathered tensors, so all raise together (no process is left waiting in a
collective).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from difrl.quant import formats as F
from difrl.quant.linear import QuantLinear, QuantReport, differs, quantize_module, quantized_layers
from difrl.utils.modules import peft_base, use_module


class WeightSyncError(RuntimeError):
    pass


def _is_lora_layer(m: nn.Module) -> bool:
    return hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and hasattr(m, "active_adapters")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def merged_state_dict(module: nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """State dict of `module` with every active LoRA adapter merged into its base weight, keyed by the plain
    model's names (no peft prefixes, no `.base_layer`). The training module itself is not modified. `exclude`:
    submodule names (plain names) whose tensors are left out (a sharded policy's other FSDP units)."""
    base = peft_base(module)
    out = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items()
           if ".lora_" not in k and not _under(k.rpartition(".")[0].replace(".base_layer", ""), exclude)}
    for name, m in base.named_modules():
        if _under(name, exclude):
            continue
        if _is_lora_layer(m) and not getattr(m, "merged", False) and not getattr(m, "disable_adapters", False):
            key = f"{name}.weight"
            w = out[key].clone()
            for adapter in m.active_adapters:
                if adapter in getattr(m, "lora_A", {}):
                    w += m.get_delta_weight(adapter).to(w.dtype)
            out[key] = w
    return out


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits read as the integer of its width


def _fingerprint(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """A cheap summary that changes when any floating weight changes: per tensor, the sum (in int64) of its elements'
    bit patterns read as integers. Exact (no rounding: a change of one element always shows) and read in place (no
    fp64 copy of every weight, as a float sum and sum of squares would make). Changes of several elements could
    cancel in the sum; then the no-op check below does not raise (it can miss a no-op sync, never raise falsely)."""
    parts = [t.detach().contiguous().view(_BITS[t.element_size()]).sum(dtype=torch.int64).reshape(1)
             for t in sd.values() if t.is_floating_point() and t.element_size() in _BITS]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class RolloutCopy:
    """A plain (LoRA-merged) deep copy of the policy module with its linear layers quantized to `fmt`."""

    def __init__(self, module: nn.Module, fmt: str, skip=(), min_dim: int = 0, backend: str = "auto", *,
                 weights=None, skeleton: nn.Module | None = None, device: torch.device | str | None = None):
        """`weights(source)`: the source's merged weights as an iterable of state-dict parts (default one part,
        merged_state_dict(source)). `skeleton`: instead of a deep copy of `module`, a plain copy of it whose
        parameters are meta tensors of the full shapes and the dtypes the copy keeps; each part's tensors are put in
        (on `device`) and its linear layers quantized before the next part is read."""
        self.fmt = fmt
        self.weights = weights if weights is not None else (lambda source: [merged_state_dict(source)])
        if skeleton is None:
            with torch.no_grad():
                plain = copy.deepcopy(peft_base(module))
                plain = _unload_lora(plain)  # peft layers -> their base linears (sync merges the deltas in)
            self.module: nn.Module = plain.requires_grad_(False).eval()
            # fp32: an exact copy (a stale rollout policy without quantization)
            self.report: QuantReport = QuantReport(fmt) if fmt == "fp32" else quantize_module(self.module, fmt, skip, min_dim, backend)
        else:
            self.module = _unload_lora(peft_base(skeleton)).requires_grad_(False).eval()
            self.report = QuantReport(fmt)
            for part in self.weights(module):
                filled = _materialize(self.module, part, device)
                if fmt != "fp32":
                    self.report.rows += quantize_module(self.module, fmt, skip, min_dim, backend, only=filled).rows
            empty = [n for n, p in self.module.named_parameters() if p.is_meta]
            if empty:
                raise WeightSyncError(f"rollout copy: no part of the policy's weights filled {empty[:5]} (the copy and "
                                      "the policy disagree on names)")
            if device is not None:
                self.module.to(device)  # the buffers (FSDP shards parameters only)
        self.syncs = 0
        self._source_fp: torch.Tensor | None = None
        self.sync(module, check=False)

    @torch.no_grad()
    def sync(self, source: nn.Module, check: bool = True) -> dict:
        """Copy `source`'s current (merged) weights in and re-quantize, one part of `weights(source)` at a time. With
        `check`, a sync after the policy changed that leaves every rollout weight as it was raises WeightSyncError;
        then (`verify`) the copy must hold the policy's weights as its format quantizes them."""
        # every comparison stays a device tensor until one read at the end (a read each would be a GPU sync each)
        layers = quantized_layers(self.module)
        own = {key: t for key, t in self.module.state_dict(keep_vars=True).items()  # parameters, persistent buffers
               if t is not None and not _in_layers(key, layers)}  # (quantized layers, a TELinear's te.Linear: below)
        fps, layer_flags, other_flags, checks, seen = [], [], [], [], set()
        for sd in self.weights(source):
            fps.append(_fingerprint(sd))
            dev = fps[0].device
            part_layers = {}
            for name, layer in layers.items():
                w = sd.get(f"{name}.weight")
                if w is not None:
                    layer_flags.append(layer.update_weight(w, sd.get(f"{name}.bias")).to(dev))
                    part_layers[name] = layer
            part_own = [key for key in own if key in sd]
            for key in part_own:
                t = own[key]
                other_flags.append(differs(t, sd[key].to(t.dtype)).to(dev))
                t.copy_(sd[key])  # an equal tensor copied again is still equal: no host read needed to skip it
            seen |= {f"{n}.weight" for n in part_layers} | set(part_own)
            checks += self._checks(sd, part_layers, part_own, self.syncs + 1)
        missing = [k for k in [f"{n}.weight" for n in layers] + list(own) if k not in seen]
        if missing:
            raise WeightSyncError(f"rollout copy sync: the policy has no tensor for {missing[:5]}"
                                  f"{' ...' if len(missing) > 5 else ''} (the copy and the policy disagree on names)")
        fp = torch.cat([f.to(dev) for f in fps]) if fps else torch.zeros(0)
        dev = fp.device
        source_changed = (torch.ones((), dtype=torch.bool, device=dev) if self._source_fp is None
                          else differs(fp, self._source_fp.to(dev)))
        count = lambda flags: torch.stack(flags).sum() if flags else torch.zeros((), dtype=torch.long, device=dev)  # noqa: E731
        changed_layers, changed_other, source_changed = (
            int(v) for v in torch.stack([count(layer_flags), count(other_flags), source_changed.long()]).tolist())
        if check and source_changed and changed_layers + changed_other == 0:
            raise WeightSyncError(
                f"rollout copy sync after update {self.syncs + 1}: the policy's weights changed but no weight of the "
                f"{self.fmt} rollout copy did, so rollouts would keep coming from the old policy. Is the copy synced "
                "from the trained module (LoRA merged)? Is the learning rate so small that no quantized value moves?")
        self._source_fp = fp
        self.syncs += 1
        _raise_first(checks)
        return {"changed_layers": changed_layers, "changed_other": changed_other, "source_changed": bool(source_changed)}

    @torch.no_grad()
    def verify(self, sd: dict[str, torch.Tensor], layers: dict[str, nn.Module] | None = None,
               sample_rows: int = 64) -> None:
        """After every sync: the copy must equal the policy's current (merged) weights `sd` as its format
        quantizes them, not merely have changed. Every tensor kept in high precision is compared whole; for every
        quantized layer, its bias whole and a block of `sample_rows` weight rows (on the format's scale tiles, at
        a position that moves with each sync; all rows of a smaller layer) against the source rows quantized
        afresh with the whole weight's per-tensor scale (difrl.quant.formats.qdq_weight_rows). A layer that a
        sync skipped, or filled from another tensor, raises WeightSyncError naming it."""
        layers = quantized_layers(self.module) if layers is None else layers
        own = [key for key in self.module.state_dict() if not _in_layers(key, layers)]
        _raise_first(self._checks(sd, layers, own, self.syncs, sample_rows))

    def _checks(self, sd: dict[str, torch.Tensor], layers: dict[str, nn.Module], own_keys, syncs: int,
                sample_rows: int = 64) -> list:
        """verify's comparisons of `layers` and the high-precision tensors `own_keys` against `sd`: a list of
        (mismatch as a device bool, the error message's maker); `syncs` places the sampled rows."""
        checks: list[tuple[torch.Tensor, object]] = []
        for name, layer in layers.items():
            w, b = sd[f"{name}.weight"], sd.get(f"{name}.bias")
            N = w.shape[0]
            tile = F.weight_tile_rows(self.fmt)
            n_tiles, per = -(-N // tile), max(1, sample_rows // tile)
            first = (syncs * 7919 + sum(map(ord, name))) % max(1, n_tiles - per + 1)  # moves with each sync
            start, stop = first * tile, min(N, (first + per) * tile)
            if isinstance(layer, QuantLinear):
                have, want = layer.weight_hat_rows(start, stop), F.qdq_weight_rows(w.float(), self.fmt, start, stop)
                bias = layer.bias
            else:  # TELinear: te.Linear holds the bf16 weight; TE quantizes it in its GEMM
                have, want = layer.inner.weight[start:stop].float(), w[start:stop].to(layer.inner.weight.dtype).float()
                bias = layer.inner.bias
            checks.append((differs(have, want), lambda name=name, have=have, want=want, start=start, stop=stop: (
                f"rollout copy sync {syncs}: layer {name!r} of the {self.fmt} copy does not hold the policy's "
                f"current weight quantized to {self.fmt} (rows {start}:{stop}, max |difference| "
                f"{float((have - want).abs().max()):.3g}): the sync skipped it or filled it from another tensor")))
            if b is not None:
                checks.append((differs(bias, b.to(bias.dtype)), lambda name=name: (
                    f"rollout copy sync {syncs}: the bias of layer {name!r} differs from the policy's")))
        state = self.module.state_dict()
        for key in own_keys:
            t = state[key]
            checks.append((differs(t, sd[key].to(t.dtype)), lambda key=key: (
                f"rollout copy sync {syncs}: {key!r} of the copy differs from the policy's (kept in high "
                "precision, so it must be equal)")))
        return checks

    @contextmanager
    def active(self, policy):
        """Run `policy` (an adapter with a `.module`) on the rollout copy inside the block."""
        with use_module(policy, self.module):
            yield self.module


def _in_layers(key: str, layers: dict[str, nn.Module]) -> bool:
    """Is state-dict `key` a tensor of a quantized layer (or of a TELinear's inner te.Linear)?"""
    mod_name = key.rpartition(".")[0]
    return mod_name in layers or any(mod_name.startswith(n + ".") for n in layers)


def _raise_first(checks: list) -> None:
    """One host read for all of `checks` ((device bool, message maker) pairs); WeightSyncError for the first set."""
    if not checks:
        return
    dev = checks[0][0].device
    failed = torch.stack([flag.to(dev) for flag, _ in checks]).tolist()
    if any(failed):
        raise WeightSyncError(checks[failed.index(True)][1]())


@torch.no_grad()
def _materialize(module: nn.Module, part: dict[str, torch.Tensor], device) -> set[str]:
    """Replace the meta parameters of `module` named in `part` by `part`'s tensors (in the meta tensor's dtype, on
    `device` or the tensor's own); tied parameters stay tied. Returns the names of the modules touched."""
    made: dict[int, nn.Parameter] = {}
    touched = set()
    for key, t in part.items():
        mod_name, _, attr = key.rpartition(".")
        try:
            mod = module.get_submodule(mod_name)
        except AttributeError:
            continue  # a tensor the copy does not have (as in sync: left out)
        p = mod._parameters.get(attr)
        if p is None or not p.is_meta:
            continue
        if id(p) not in made:
            made[id(p)] = nn.Parameter(t.detach().to(device or t.device, p.dtype, copy=True), requires_grad=False)
        mod._parameters[attr] = made[id(p)]
        touched.add(mod_name)
    return touched


def _unload_lora(plain: nn.Module) -> nn.Module:
    """Replace each peft LoRA layer of a (deep-copied) model by its base layer; sync merges the deltas."""
    for name, m in list(plain.named_modules()):
        if _is_lora_layer(m):
            parent_name, _, leaf = name.rpartition(".")
            parent = plain.get_submodule(parent_name) if parent_name else plain
            setattr(parent, leaf, m.get_base_layer())
    return plain
