"""Training state: atomic checkpoints of the trainable weights, their EMA (difrl.train.ema) and the optimizer
that resume bit-exactly.

    ema = EMA(params_by_name, decay=0.9)
    save_checkpoint(run_dir, iteration, module, optimizer, ema, extra={...})
    ckpt = load_latest_checkpoint(run_dir)         # newest intact one; None if the run has none yet

A checkpoint is a directory ``checkpoints/iter-NNNNNN/`` holding ``trainable.safetensors``
(the parameters being optimised, by name), ``ema.safetensors``, ``optimizer.pt`` (tensors and
plain containers: it loads with ``weights_only=True``), ``rng.safetensors`` and ``state.json``.
It is written under a temporary name, with ``manifest.json`` (size and SHA-256 of every file) written
last, and renamed into place, then ``checkpoints/latest`` is rewritten atomically, so a run killed at
any moment leaves the previous checkpoint intact. On resume every file is checked against the
manifest; a damaged checkpoint (flipped bytes, a truncated, missing or foreign file, garbage state, a
missing manifest) is reported by name and the previous one is used (the newest two are kept), and when
every checkpoint is damaged the run stops with an error instead of starting again from scratch. A
checkpoint without ``manifest.json`` cannot be told from one whose manifest was lost, so it counts as
damaged unless the caller allows it (``allow_unverified=True``; the trainers' config key
``resume_unverified=true``): then it loads with a warning, its files checked only as they parse.
Everything random in a run is derived from (seed, iteration), so the saved RNG is a safeguard,
not a requirement.

That is the gathered format (train.checkpoint_format=gathered: full tensors, written by the main process). A
sharded checkpoint (the default under FSDP: difrl/train/run/sharded_state.py) holds DCP's files in place of
trainable / ema / optimizer / extras, with the same rng.safetensors, state.json, manifest, temporary name,
rename, `latest` and pruning (publish); load_latest_checkpoint verifies it the same way, and restore_checkpoint
reads its tensors into the live (sharded or plain) ones, whatever the number of processes that wrote it. With
several processes none hashes, gathers or verifies for the others: each hashes the shard files it wrote and, on
resume, its share of the files, and the verdicts are agreed (difrl/train/run/manifest.py); a gathered snapshot is held
in full by the main process only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from difrl.train.dist.full_tensors import is_sharded, like, reshard
from difrl.train.ema import EMA  # noqa: F401  (the averaged weights, checkpointed here; re-exported)
from difrl.train.run.manifest import MANIFEST, SHARED, all_gather_objects, check, file_record, verdict
from difrl.train.run.rundir import checkpoint_dirs  # noqa: F401  (one parser of iter-* names; re-exported)
from difrl.train.run.sharded_state import (CheckpointError, is_sharded_checkpoint, load_sharded, read_metadata,  # noqa: F401
                                       write_shards)
from difrl.utils.io import (atomic_write_json, atomic_write_text, load_safetensors_checked, load_torch_state,
                            save_safetensors, save_torch_state)
from difrl.utils.modules import trainable_params  # noqa: F401  (used here; re-exported: the trainers import it from here)


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
    metadata: object = None  # a sharded checkpoint (difrl.train.run.sharded_state): DCP's Metadata; its tensors load
    # in restore_checkpoint, into the live (sharded) ones, and trainable, ema and optimizer are None


def write_manifest(path: Path, hashed: dict | None = None) -> None:
    """path/manifest.json: {"format": 1, "files": {name: {"bytes": n, "sha256": hex}}} over every other file, hashed
    from the bytes on disk (difrl.train.run.manifest.file_record). `hashed`: entries made already (a sharded save: each
    process hashed the shard files it wrote); the rest of the directory is hashed here."""
    files = dict(hashed or {})
    files |= {f.name: file_record(f) for f in sorted(path.iterdir())
              if f.is_file() and f.name != MANIFEST and f.name not in files}
    atomic_write_json(path / MANIFEST, {"format": 1, "files": dict(sorted(files.items()))})


def verify_manifest(path: Path, allow_unverified: bool = False) -> bool:
    """Check every file of checkpoint `path` against its manifest (in this one process): raises CheckpointError
    naming each missing, resized, changed or unlisted file. No manifest.json (written before manifests existed, or
    the manifest was deleted: the two look the same) is a CheckpointError too, unless `allow_unverified`: then this
    returns False (not verified; its files are still checked as they load). Several processes share the work:
    load_latest_checkpoint(process=...)."""
    verified, problem = verdict(path, [check(path, allow_unverified)])
    if problem is not None:
        raise CheckpointError(problem)
    return verified


@dataclass
class Snapshot:
    """What a checkpoint holds, as full (unsharded) tensors: the trainable weights by name, the optimizer's
    state dict, the EMA's and the extras' (tensors, num_updates)."""
    trainable: dict[str, torch.Tensor]
    optimizer: dict
    ema: tuple[dict[str, torch.Tensor], int] | None
    extras: dict[str, tuple[dict[str, torch.Tensor], int]]


def snapshot(module: nn.Module, optimizer, ema: EMA | None, extras: dict[str, EMA] | None = None,
             keep: bool | None = None) -> Snapshot | None:
    """The checkpoint's content, what one unsharded process would save. Under FSDP every process must call it
    (sharded tensors are gathered one at a time, in the same order everywhere), and only the process that writes the
    checkpoint keeps them: `keep` (default: this is the main process, rank 0, or there is no process group); the
    others drop each gathered tensor as soon as its all-gather returns and get None (no process but the writer ever
    holds the full model, its EMA and AdamW's moments: about 190 GB for a 12B FLUX)."""
    from difrl.train.dist.full_tensors import gather_to_host

    if keep is None:
        keep = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    def full(tensors: dict) -> dict:
        return {k: gather_to_host(v, keep) for k, v in tensors.items()}

    reshard(module)  # its parameters are the shards again, not what a forward left gathered

    opt = optimizer.state_dict()
    opt = {**opt, "state": {i: {k: gather_to_host(v, keep) if torch.is_tensor(v) else v for k, v in st.items()}
                            for i, st in sorted(opt["state"].items())}}
    trained = full(trainable_params(module))
    ema_full = None if ema is None else (full(ema.shadow), ema.num_updates)
    extras_full = {name: (full(e.shadow), e.num_updates) for name, e in (extras or {}).items()}
    return Snapshot(trained, opt, ema_full, extras_full) if keep else None


def save_checkpoint(run_dir: Path, iteration: int, module: nn.Module, optimizer, ema: EMA | None,
                    state: dict, keep: int = 2, extras: dict[str, EMA] | None = None) -> Path:
    """`extras`: other named copies of the trainable weights (DiffusionNFT's old policy, the stale rollout
    copy's source), each saved as NAME.safetensors. See write_checkpoint."""
    return write_checkpoint(run_dir, iteration, snapshot(module, optimizer, ema, extras), state, keep)


def write_checkpoint(run_dir: Path, iteration: int, snap: Snapshot, state: dict, keep: int = 2) -> Path:
    """Write `snap` as checkpoint `iteration` (one process); `keep`: see publish."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp-iter-{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_safetensors(snap.trainable, tmp / "trainable.safetensors")
    if snap.ema is not None:
        save_safetensors(snap.ema[0], tmp / "ema.safetensors", {"num_updates": snap.ema[1]})
    for name, (tensors, num_updates) in snap.extras.items():
        save_safetensors(tensors, tmp / f"{name}.safetensors", {"num_updates": num_updates})
    save_torch_state(snap.optimizer, tmp / "optimizer.pt")
    write_extras(tmp, iteration, state)
    return publish(root, tmp, iteration, keep)


def write_extras(tmp: Path, iteration: int, state: dict, ema: EMA | None = None, extras: dict | None = None) -> None:
    """The main process's files of every checkpoint: rng.safetensors (its torch RNG state), state.json (the
    iteration, the trainer's counters, and for a sharded checkpoint the EMA's and extras' update counts)."""
    counts = {} if ema is None else {"ema_num_updates": ema.num_updates}
    counts |= {"extras_num_updates": {k: e.num_updates for k, e in extras.items()}} if extras else {}
    save_safetensors({"torch": torch.get_rng_state()}, tmp / "rng.safetensors")
    atomic_write_json(tmp / "state.json", {"iteration": iteration, **state, **counts})


def publish(root: Path, tmp: Path, iteration: int, keep: int = 2, hashed: dict | None = None) -> Path:
    """Complete the checkpoint written in `tmp` (main process, after every file is on disk): its manifest, then
    the rename to iter-N (a directory under that name is complete), `latest`, and the pruning. The newest
    max(keep, 2) checkpoints up to `iteration` are kept, so a damaged newest one can fall back to the previous
    (load_latest_checkpoint); any after `iteration` (the damaged one a resumed run fell back from) are removed.
    `hashed`: manifest entries made by the processes that wrote the files (write_manifest)."""
    final = root / f"iter-{iteration:06d}"
    write_manifest(tmp, hashed)  # last: a directory with a manifest is complete
    if final.exists():  # a resumed run redoing an iteration (or replacing a damaged checkpoint): out of the way first
        _discard(final, root)
    tmp.rename(final)
    atomic_write_text(root / "latest", final.name + "\n")
    # checkpoints after this iteration belong to a timeline the run left (a damaged one it fell back from):
    # out, so that the two kept are this one and the one before it
    newer = [p for p in checkpoint_dirs(root) if int(p.name[5:]) > iteration]
    for old in newer + checkpoint_dirs(root)[len(newer) + max(keep, 2):]:
        _discard(old, root)
    return final


def save_sharded(run_dir: Path, iteration: int, module: nn.Module, optimizer, ema: EMA | None, extras: dict | None,
                 state: dict, is_main: bool, barrier, keep: int = 2) -> Path:
    """Write sharded checkpoint `iteration` (difrl.train.run.sharded_state): every process calls it. Each writes its
    shards into ``.tmp-iter-N`` with DCP and hashes the files it wrote; the records are gathered (small objects), and
    every process checks that it sees every file (else all raise CheckpointError: the run directory is not shared);
    the main process adds rng.safetensors and state.json, the manifest from the records, and renames the directory
    into place (publish). No process reads another's shard files."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".tmp-iter-{iteration:06d}"
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    written = write_shards(tmp, module, optimizer, ema, extras)  # this process's __R_n.distcp
    hashed = {}
    for part in all_gather_objects({name: file_record(tmp / name) for name in written}):
        hashed |= part
    unseen = all_gather_objects(sorted(name for name in hashed if not (tmp / name).is_file()))
    if any(unseen):
        said = "; ".join(f"process {i} does not see {', '.join(names)}" for i, names in enumerate(unseen) if names)
        raise CheckpointError(f"checkpoint {tmp}: {said}, written by another process: {SHARED}")
    if is_main:
        write_extras(tmp, iteration, state, ema, extras)
        publish(root, tmp, iteration, keep, hashed)
    return root / f"iter-{iteration:06d}"


def latest_checkpoint(run_dir: Path, log, allow_unverified: bool, accelerator=None) -> Checkpoint | None:
    """load_latest_checkpoint for every process of a run (each calls it): each process verifies its share of the
    files (difrl.train.run.manifest), the verdict is agreed, and all load the same checkpoint or raise the same
    CheckpointError."""
    if accelerator is None or accelerator.num_processes == 1:
        return load_latest_checkpoint(run_dir, log, allow_unverified=allow_unverified)
    return load_latest_checkpoint(run_dir, log, allow_unverified, (accelerator.process_index, accelerator.num_processes))


def _discard(path: Path, root: Path) -> None:
    """Remove a checkpoint directory: renamed away first, so a kill mid-delete never leaves a half checkpoint
    under an iter-* name."""
    trash = root / f".old-{path.name}"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def load_latest_checkpoint(run_dir: Path, log=print, allow_unverified: bool = False,
                           process: tuple[int, int] = (0, 1)) -> Checkpoint | None:
    """The newest intact checkpoint of the run, or None if it has none. Each is verified against its manifest
    before it loads; a damaged one (a changed, truncated, missing or unlisted file, garbage state, no
    manifest.json) is reported through `log`, naming the checkpoint and the file, and the previous one is
    tried. When checkpoints exist but none is intact this raises CheckpointError: a run never silently starts
    again from scratch. `allow_unverified` (config key resume_unverified): a checkpoint without manifest.json
    loads with a warning instead (its files are checked only as they parse). `process`: (index, count) when every
    process of a run calls it (latest_checkpoint): each hashes its share of the files, the main process's list of
    checkpoints is walked, and every verdict is agreed, so all return the same checkpoint or raise the same error."""
    index, count = process
    root = Path(run_dir) / "checkpoints"
    latest = root / "latest"
    names = [p.name for p in checkpoint_dirs(root)]
    pointer = latest.read_text(errors="replace").strip() if latest.exists() else None
    if count > 1:  # the main process's view: every process walks the same candidates
        names, pointer = all_gather_objects((names, pointer))[0]
    candidates = [root / n for n in names]
    if pointer is not None and (root / pointer) not in candidates:
        log(f"difrl: {latest} names {(root / pointer).name!r}, which is not a checkpoint; looking for the newest "
            "intact one")
    if not candidates:
        if pointer is not None:
            raise CheckpointError(f"{latest} exists but {root} holds no checkpoint directory: the run directory is "
                                  "damaged (move checkpoints/ aside to start the run again)")
        return None
    damaged = []
    for path in candidates:
        report = check(path, allow_unverified, index, count)
        verified, problem = verdict(path, all_gather_objects(report) if count > 1 else [report])
        if problem is None:
            try:
                ckpt = _load_checkpoint(path)
            except CheckpointError as e:
                problem = str(e)
            if count > 1:  # the same verdict everywhere (a file may load on one process and not on another)
                problem = " | ".join(dict.fromkeys(e for e in all_gather_objects(problem) if e)) or None
        if problem is not None:
            damaged.append(problem)
            log(f"difrl: WARNING: {problem}; trying the previous checkpoint")
            continue
        if not verified:
            log(f"difrl: WARNING: checkpoint {path} has no {MANIFEST} and resume_unverified=true: its bytes are "
                "not verified, only that its files load")
        if damaged:
            log(f"difrl: WARNING: resuming from {path.name}, the newest intact checkpoint; the {len(damaged)} newer "
                f"one(s) above are damaged and will be overwritten as the run redoes their iterations")
        return ckpt
    raise CheckpointError(f"every checkpoint in {root} is damaged, so the run cannot resume (it does not start "
                          f"again from scratch on its own; move {root} aside for that): " + " | ".join(damaged))


def _load_checkpoint(path: Path) -> Checkpoint:
    """Load every file of one checkpoint; any problem is a CheckpointError naming the file."""
    try:
        state = json.loads((path / "state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
            raise ValueError(f"no integer 'iteration' in {str(state)[:60]!r}")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint state {path / 'state.json'} is corrupted or missing ({e})") from e
    if state["iteration"] != int(path.name[5:]):
        raise CheckpointError(f"checkpoint {path}: state.json says iteration {state['iteration']}, the directory "
                              f"name {path.name}")
    if is_sharded_checkpoint(path):
        metadata = read_metadata(path)  # the tensors load into the live ones (restore_checkpoint)
        return Checkpoint(path, state["iteration"], None, None, None, _load_rng(path), state, None, metadata)
    try:
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
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        raise CheckpointError(str(e)) from e
    return Checkpoint(path, state["iteration"], trainable, ema, optimizer, _load_rng(path), state, extras)


def _load_rng(path: Path) -> dict[str, torch.Tensor]:
    try:
        rng, _ = load_safetensors_checked(path / "rng.safetensors", "checkpoint RNG state")
        if "torch" not in rng or rng["torch"].dtype != torch.uint8:
            raise ValueError(f"checkpoint RNG state {path / 'rng.safetensors'} holds no uint8 'torch' state")
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e)) from e
    return rng


def _optimizer_state_like(optimizer, saved: dict) -> dict:
    """A saved (full) optimizer state dict with each per-parameter tensor laid out like its parameter (its
    shard under FSDP); state entries are numbered over the param groups' parameters in order."""

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(is_sharded(p) for p in params):
        return saved
    state = {}
    for i, st in saved["state"].items():
        p = params[int(i)]
        state[i] = {k: like(p, v) if torch.is_tensor(v) and v.shape == p.shape else v for k, v in st.items()}
    return {**saved, "state": state}


def restore_checkpoint(ckpt: Checkpoint, module: nn.Module, optimizer, ema: EMA | None,
                       extras: dict[str, EMA] | None = None) -> None:
    """Load `ckpt` into the live network, optimizer, EMA and extras (under FSDP every process calls it, whatever
    the number of processes that wrote a sharded checkpoint) and set the torch RNG state."""
    if ckpt.metadata is not None:  # sharded (DCP): each tensor read in its own layout
        load_sharded(ckpt.path, module, optimizer, ema, extras, ckpt.metadata)
        if ema is not None:
            ema.num_updates = int(ckpt.state.get("ema_num_updates", 0))
        for name, extra in (extras or {}).items():
            extra.num_updates = int(ckpt.state.get("extras_num_updates", {}).get(name, 0))
        torch.set_rng_state(ckpt.rng["torch"])
        return
    reshard(module)  # under FSDP: its parameters are the shards (written below, gathered by the next forward)
    params = trainable_params(module)
    if set(params) != set(ckpt.trainable):
        extra, missing = sorted(set(ckpt.trainable) - set(params)), sorted(set(params) - set(ckpt.trainable))
        raise ValueError(f"checkpoint {ckpt.path} does not match this model: unexpected {extra[:4]}, missing {missing[:4]} "
                         "(was it trained with another model or LoRA setting?)")
    with torch.no_grad():  # under FSDP each process keeps its own shard of the full tensors (full_tensors.like)
        for k, p in params.items():
            p.copy_(like(p, ckpt.trainable[k]))
    # the optimizer's moments and step counts from the checkpoint, its hyperparameters (lr, betas, eps, weight
    # decay) the config's: equal in a plain resume, and a resume_override=true of train.lr must take effect
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(_optimizer_state_like(optimizer, ckpt.optimizer))
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)
    if ema is not None:
        if ckpt.ema is None:
            raise ValueError(f"checkpoint {ckpt.path} has no EMA weights but train.ema_decay > 0")
        ema.shadow = {k: like(ema.params[k], v.clone()) for k, v in ckpt.ema.items()}
        ema.num_updates = ckpt.state.get("ema_num_updates", 0)
    for name, extra in (extras or {}).items():
        if name not in (ckpt.extras or {}):
            raise ValueError(f"checkpoint {ckpt.path} has no {name}.safetensors, which this config needs (was it "
                             f"written with another train.objective or rollout.sync_every?)")
        tensors, num_updates = ckpt.extras[name]
        if set(tensors) != set(extra.shadow):
            raise ValueError(f"checkpoint {ckpt.path}: {name}.safetensors does not match this model's trainable weights")
        extra.shadow = {k: like(extra.params[k], v.clone()) for k, v in tensors.items()}
        extra.num_updates = num_updates
    torch.set_rng_state(ckpt.rng["torch"])
