"""The rollout copy: a separate, quantized copy of the policy, refreshed from it after every update.

    copy = RolloutCopy(policy_module, "nvfp4", **QUANT_PRESETS["digits"])
    with copy.active(policy):            # policy.velocity now runs the quantized copy
        batch = rollout(policy, ...)
    ... optimizer.step() ...
    copy.sync(policy_module)             # re-merge LoRA, re-quantize; raises WeightSyncError on a no-op sync

LoRA is merged into the copy's weights (W = W_base + scaling * B @ A, Sol-RL's sync_lora_to_inference,
specs §1.2), so the quantized GEMM sees the weights the policy really uses. Frameworks have shipped a
silent no-sync bug (the inference engine kept stale weights after updates); here a sync after a change
of the policy that leaves every rollout weight unchanged stops the run, and after every sync `verify`
checks that the copy holds the policy's current weights as its format quantizes them (every
high-precision tensor whole, a moving block of rows of each quantized layer), so a sync that skips one
layer stops the run too.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from difrl.quant import formats as F
from difrl.quant.linear import QuantLinear, QuantReport, differs, quantize_module, quantized_layers
from difrl.utils.modules import use_module


class WeightSyncError(RuntimeError):
    pass


def _is_lora_layer(m: nn.Module) -> bool:
    return hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and hasattr(m, "active_adapters")


def _plain(module: nn.Module) -> nn.Module:
    """The model under a peft wrapper (PeftModel -> its base model with LoRA layers injected)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


@torch.no_grad()
def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """State dict of `module` with every active LoRA adapter merged into its base weight, keyed by the plain
    model's names (no peft prefixes, no `.base_layer`). The training module itself is not modified."""
    base = _plain(module)
    out = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    for name, m in base.named_modules():
        if _is_lora_layer(m) and not getattr(m, "merged", False) and not getattr(m, "disable_adapters", False):
            key = f"{name}.weight"
            w = out[key].clone()
            for adapter in m.active_adapters:
                if adapter in getattr(m, "lora_A", {}):
                    w += m.get_delta_weight(adapter).to(w.dtype)
            out[key] = w
    return out


def _fingerprint(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """A cheap summary that changes when any floating weight changes (sum and sum of squares per tensor)."""
    parts = [torch.stack([t.double().sum(), (t.double() ** 2).sum()]) for t in sd.values() if t.is_floating_point()]
    return torch.stack(parts) if parts else torch.zeros(0)


class RolloutCopy:
    """A plain (LoRA-merged) deep copy of the policy module with its linear layers quantized to `fmt`."""

    def __init__(self, module: nn.Module, fmt: str, skip=(), min_dim: int = 0, backend: str = "auto"):
        self.fmt = fmt
        with torch.no_grad():
            plain = copy.deepcopy(_plain(module))
            plain = _unload_lora(plain)  # peft layers -> their base linears (sync merges the deltas in)
        self.module: nn.Module = plain.requires_grad_(False).eval()
        # fp32: an exact copy (a stale rollout policy without quantization)
        self.report: QuantReport = QuantReport(fmt) if fmt == "fp32" else quantize_module(self.module, fmt, skip, min_dim, backend)
        self.syncs = 0
        self._source_fp: torch.Tensor | None = None
        self.sync(module, check=False)

    @torch.no_grad()
    def sync(self, source: nn.Module, check: bool = True) -> dict:
        """Copy `source`'s current (merged) weights in and re-quantize. With `check`, a sync after the policy
        changed that leaves every rollout weight as it was raises WeightSyncError."""
        # every comparison stays a device tensor until one read at the end (a read each would be a GPU sync each)
        sd = merged_state_dict(source)
        fp = _fingerprint(sd)
        dev = fp.device
        source_changed = (torch.ones((), dtype=torch.bool, device=dev) if self._source_fp is None
                          else differs(fp, self._source_fp.to(dev)))
        layers = quantized_layers(self.module)
        layer_flags, missing = [], []
        for name, layer in layers.items():
            w, b = sd.get(f"{name}.weight"), sd.get(f"{name}.bias")
            if w is None:
                missing.append(f"{name}.weight")
                continue
            layer_flags.append(layer.update_weight(w, b).to(dev))
        other_flags = []
        own = self.module.state_dict(keep_vars=True)  # parameters and persistent buffers (not e.g. rotary caches)
        for key, t in own.items():
            if t is None:
                continue
            mod_name = key.rpartition(".")[0]
            if mod_name in layers or any(mod_name.startswith(n + ".") for n in layers):
                continue  # quantized layers (and a TELinear's inner te.Linear) were handled above
            src = sd.get(key)
            if src is None:
                missing.append(key)
                continue
            other_flags.append(differs(t, src.to(t.dtype)).to(dev))
            t.copy_(src)  # an equal tensor copied again is still equal: no host read needed to skip it
        if missing:
            raise WeightSyncError(f"rollout copy sync: the policy has no tensor for {missing[:5]}"
                                  f"{' ...' if len(missing) > 5 else ''} (the copy and the policy disagree on names)")
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
        self.verify(sd, layers)
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
        checks: list[tuple[torch.Tensor, object]] = []  # (mismatch as a device bool, the error message's maker)
        for name, layer in layers.items():
            w, b = sd[f"{name}.weight"], sd.get(f"{name}.bias")
            N = w.shape[0]
            tile = F.weight_tile_rows(self.fmt)
            n_tiles, per = -(-N // tile), max(1, sample_rows // tile)
            first = (self.syncs * 7919 + sum(map(ord, name))) % max(1, n_tiles - per + 1)  # moves with each sync
            start, stop = first * tile, min(N, (first + per) * tile)
            if isinstance(layer, QuantLinear):
                have, want = layer.weight_hat_rows(start, stop), F.qdq_weight_rows(w.float(), self.fmt, start, stop)
                bias = layer.bias
            else:  # TELinear: te.Linear holds the bf16 weight; TE quantizes it in its GEMM
                have, want = layer.inner.weight[start:stop].float(), w[start:stop].to(layer.inner.weight.dtype).float()
                bias = layer.inner.bias
            checks.append((differs(have, want), lambda name=name, have=have, want=want, start=start, stop=stop: (
                f"rollout copy sync {self.syncs}: layer {name!r} of the {self.fmt} copy does not hold the policy's "
                f"current weight quantized to {self.fmt} (rows {start}:{stop}, max |difference| "
                f"{float((have - want).abs().max()):.3g}): the sync skipped it or filled it from another tensor")))
            if b is not None:
                checks.append((differs(bias, b.to(bias.dtype)), lambda name=name: (
                    f"rollout copy sync {self.syncs}: the bias of layer {name!r} differs from the policy's")))
        for key, t in self.module.state_dict().items():
            mod_name = key.rpartition(".")[0]
            if mod_name in layers or any(mod_name.startswith(n + ".") for n in layers):
                continue
            checks.append((differs(t, sd[key].to(t.dtype)), lambda key=key: (
                f"rollout copy sync {self.syncs}: {key!r} of the copy differs from the policy's (kept in high "
                "precision, so it must be equal)")))
        if not checks:
            return
        dev = checks[0][0].device
        failed = torch.stack([flag.to(dev) for flag, _ in checks]).tolist()  # one host read for the whole copy
        if any(failed):
            raise WeightSyncError(checks[failed.index(True)][1]())

    @contextmanager
    def active(self, policy):
        """Run `policy` (an adapter with a `.module`) on the rollout copy inside the block."""
        with use_module(policy, self.module):
            yield self.module


def _unload_lora(plain: nn.Module) -> nn.Module:
    """Replace each peft LoRA layer of a (deep-copied) model by its base layer; sync merges the deltas."""
    for name, m in list(plain.named_modules()):
        if _is_lora_layer(m):
            parent_name, _, leaf = name.rpartition(".")
            parent = plain.get_submodule(parent_name) if parent_name else plain
            setattr(parent, leaf, m.get_base_layer())
    return plain
