"""Training state: EMA of trainable weights and atomic checkpoints that resume bit-exactly.

    ema = EMA(params_by_name, decay=0.9)
    save_checkpoint(run_dir, iteration, module, optimizer, ema, extra={...})
    ckpt = load_latest_checkpoint(run_dir)         # None if the run has none yet

A checkpoint is a directory ``checkpoints/iter-NNNNNN/`` holding ``trainable.safetensors``
(the parameters being optimised, by name), ``ema.safetensors``, ``optimizer.pt`` (tensors and
plain containers: it loads with ``weights_only=True``), ``rng.safetensors`` and ``state.json``.
It is written under a temporary name and renamed into place, then ``checkpoints/latest`` is
rewritten atomically, so a run killed at any moment leaves the previous checkpoint intact.
Everything random in a run is derived from (seed, iteration), so the saved RNG is a safeguard,
not a requirement.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difrl.utils.io import (atomic_write_json, atomic_write_text, load_safetensors_checked, load_torch_state,
                            save_safetensors, save_torch_state)


class EMA:
    """Exponential moving average of named tensors, decay warmed up as min(decay, (1 + n) / (10 + n))."""

    def __init__(self, params: dict[str, nn.Parameter], decay: float):
        self.decay = decay
        self.params = params
        self.shadow = {k: p.detach().clone() for k, p in params.items()}
        self.num_updates = 0

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """shadow <- d shadow + (1 - d) live; d = `decay` if given, else the warmed-up self.decay."""
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates)) if decay is None else decay
        for k, p in self.params.items():
            self.shadow[k].lerp_(p.detach(), 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange live and EMA weights (call twice to restore)."""
        for k, p in self.params.items():
            tmp = p.detach().clone()
            p.copy_(self.shadow[k])
            self.shadow[k].copy_(tmp)

    @contextmanager
    def swapped(self):
        """The EMA weights live inside the block, the trained ones restored after it."""
        self.swap()
        try:
            yield
        finally:
            self.swap()


def trainable_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in module.named_parameters() if p.requires_grad}


@dataclass
class Checkpoint:
    path: Path
    iteration: int  # iterations completed
    trainable: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    optimizer: dict
    rng: dict[str, torch.Tensor]
    state: dict
    extras: dict[str, tuple[dict[str, torch.Tensor], int]] | None = None  # name -> (tensors, num_updates)


def save_checkpoint(run_dir: Path, iteration: int, module: nn.Module, optimizer, ema: EMA | None,
                    state: dict, keep: int = 2, extras: dict[str, EMA] | None = None) -> Path:
    """`extras`: other named copies of the trainable weights (DiffusionNFT's old policy, the stale rollout
    copy's source), each saved as NAME.safetensors."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"iter-{iteration:06d}"
    tmp = root / f".tmp-iter-{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_safetensors(dict(trainable_params(module)), tmp / "trainable.safetensors")
    if ema is not None:
        save_safetensors(ema.shadow, tmp / "ema.safetensors", {"num_updates": ema.num_updates})
    for name, extra in (extras or {}).items():
        save_safetensors(extra.shadow, tmp / f"{name}.safetensors", {"num_updates": extra.num_updates})
    save_torch_state(optimizer.state_dict(), tmp / "optimizer.pt")
    save_safetensors({"torch": torch.get_rng_state()}, tmp / "rng.safetensors")
    atomic_write_json(tmp / "state.json", {"iteration": iteration, **state})
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    atomic_write_text(root / "latest", final.name + "\n")
    older = sorted(p for p in root.glob("iter-*") if p != final)
    for old in older[:max(len(older) - (keep - 1), 0)]:  # keep the newest `keep` checkpoints
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    root = Path(run_dir) / "checkpoints"
    latest = root / "latest"
    if not latest.exists():
        return None
    path = root / latest.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{latest} points to {path.name}, which does not exist; the run directory is damaged")
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint state {path / 'state.json'} is corrupted or missing ({e})") from e
    trainable, _ = load_safetensors_checked(path / "trainable.safetensors", "checkpoint weights")
    ema = None
    if (path / "ema.safetensors").exists():
        ema, meta = load_safetensors_checked(path / "ema.safetensors", "checkpoint EMA weights")
        state["ema_num_updates"] = int(meta.get("num_updates", 0))
    extras = {}
    for f in sorted(path.glob("*.safetensors")):
        if f.stem not in ("trainable", "ema", "rng"):
            tensors, meta = load_safetensors_checked(f, f"checkpoint {f.stem} weights")
            extras[f.stem] = (tensors, int(meta.get("num_updates", 0)))
    optimizer = load_torch_state(path / "optimizer.pt", "checkpoint optimizer state")
    rng, _ = load_safetensors_checked(path / "rng.safetensors", "checkpoint RNG state")
    return Checkpoint(path, int(state["iteration"]), trainable, ema, optimizer, rng, state, extras)


def restore_checkpoint(ckpt: Checkpoint, module: nn.Module, optimizer, ema: EMA | None,
                       extras: dict[str, EMA] | None = None) -> None:
    params = trainable_params(module)
    if set(params) != set(ckpt.trainable):
        extra, missing = sorted(set(ckpt.trainable) - set(params)), sorted(set(params) - set(ckpt.trainable))
        raise ValueError(f"checkpoint {ckpt.path} does not match this model: unexpected {extra[:4]}, missing {missing[:4]} "
                         "(was it trained with another model or LoRA setting?)")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(ckpt.trainable[k])
    optimizer.load_state_dict(ckpt.optimizer)
    if ema is not None:
        if ckpt.ema is None:
            raise ValueError(f"checkpoint {ckpt.path} has no EMA weights but train.ema_decay > 0")
        ema.shadow = {k: v.clone() for k, v in ckpt.ema.items()}
        ema.num_updates = ckpt.state.get("ema_num_updates", 0)
    for name, extra in (extras or {}).items():
        if name not in (ckpt.extras or {}):
            raise ValueError(f"checkpoint {ckpt.path} has no {name}.safetensors, which this config needs (was it "
                             f"written with another train.objective or rollout.sync_every?)")
        tensors, num_updates = ckpt.extras[name]
        if set(tensors) != set(extra.shadow):
            raise ValueError(f"checkpoint {ckpt.path}: {name}.safetensors does not match this model's trainable weights")
        extra.shadow = {k: v.clone() for k, v in tensors.items()}
        extra.num_updates = num_updates
    torch.set_rng_state(ckpt.rng["torch"])
