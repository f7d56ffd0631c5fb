"""Sharded checkpoints: each process writes its own shards with torch.distributed.checkpoint (DCP).

    fmt = checkpoint_format(cfg, run_dir, sharded)        # train.checkpoint_format resolved: "sharded" | "gathered"
    write_shards(tmp, net, optimizer, ema, extras)       # every process (state.save_sharded: the whole save)
    load_sharded(path, net, optimizer, ema, extras)       # every process; any process count (DCP reshards)
    tensors = read_sharded(path)                          # one process, no process group: every tensor in full

Why (docs/reference/specs/scale.md §1): a gathered checkpoint passes the whole model, its EMA and AdamW's two moments
through one host (about 190 GB in fp32 for a 12B FLUX) at every save; with DCP each process writes the rows it holds
(its DTensor shards) and nothing is gathered. The directory is a checkpoint like a gathered one (difrl.train.run.state):
``checkpoints/iter-NNNNNN/`` holding DCP's ``__R_0.distcp`` (one per process) and ``.metadata`` (which rows of
which tensor lie where), plus ``rng.safetensors`` and ``state.json`` from the main process and ``manifest.json``
(size and SHA-256 of every other file, the DCP files included): each process hashes the files it wrote, the records
are gathered and the main process writes them (on resume each process verifies a share: difrl/train/run/manifest.py).
Every process must see every file: on several nodes the run directory must be shared (a save that finds otherwise,
and a restore missing a shard file, stop on every process with an error that says so). It is written under
``.tmp-iter-NNNNNN`` and renamed into place last (state.save_sharded, state.publish), so a run killed mid-save
leaves no ``iter-*`` directory that resume would pick.

The tensors, one flat dict keyed by name (DCP saves each key's global shape and every process's chunk of it):
``trainable/NAME`` (the trained parameters), ``ema/NAME``, ``extra/EXTRA/NAME`` (DiffusionNFT's old policy, the
rollout copy's source), ``optim/NAME/KEY`` (AdamW's exp_avg, exp_avg_sq, step: keyed by the parameter's name, not
its index). Loading reads, for each tensor laid out like the live one (a shard under FSDP, whole in one plain
process), the overlap with the saved chunks: a checkpoint of 2 processes resumes on 1 or 3, one process's on 2
(tests/test_dcp.py). What is per process: nothing. A replicated tensor (AdamW's step) is saved once (DCP
deduplicates equal keys across processes); the torch RNG state is the main process's, restored on every process
(as a gathered checkpoint does); every random draw of a run is derived from (seed, iteration, sample index) and
the samples are cut by their global index, so no RNG stream or data order belongs to a process.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from difrl.train.dist.full_tensors import reshard
from difrl.utils.modules import trainable_params

class CheckpointError(ValueError):
    """A checkpoint that fails its manifest or does not load; names the checkpoint and the file (difrl.train.run.state
    re-exports it: the gathered and the sharded format raise the same error)."""


FORMATS = ("auto", "sharded", "gathered")
METADATA = ".metadata"
# one plain process (no process group) saves and loads with no_dist: DCP says so in a warning each time
QUIET = "torch.distributed is disabled, unavailable or uninitialized"


def checkpoint_format(cfg, run_dir: Path, sharded: bool) -> str:
    """train.checkpoint_format resolved for this run: a named format as given; "auto" is the run's own (its
    config.yaml's, on resume: a run never switches format because it resumed on another launch), else "sharded"
    when the network is sharded (FSDP) and "gathered" otherwise."""
    fmt = cfg.train.checkpoint_format
    if fmt == "auto" and cfg.resume:
        from difrl.train.run.rundir import saved_config

        saved = saved_config(run_dir, type(cfg))
        fmt = saved.train.checkpoint_format if saved is not None else "auto"
    if fmt == "auto":
        fmt = "sharded" if sharded else "gathered"
    return fmt


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / METADATA).exists()


def state_tensors(module, optimizer, ema, extras: dict | None) -> dict[str, torch.Tensor]:
    """The flat dict DCP saves: live tensors (DTensor shards under FSDP), no copies."""
    params = trainable_params(module)
    out = {f"trainable/{k}": p.detach() for k, p in params.items()}
    if ema is not None:
        out |= {f"ema/{k}": v for k, v in ema.shadow.items()}
    for name, extra in (extras or {}).items():
        out |= {f"extra/{name}/{k}": v for k, v in extra.shadow.items()}
    names = {id(p): k for k, p in params.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim/{names[id(p)]}/{key}"] = v
    return out


def write_shards(tmp: Path, module, optimizer, ema, extras: dict | None) -> list[str]:
    """Every process writes its shards into the directory `tmp` with DCP (collective; difrl.train.run.state.save_sharded
    wraps it into a complete checkpoint). Returns the names of the files this process wrote (its ``__R_n.distcp``;
    the main process's .metadata aside), which it hashes for the manifest."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):  # notes the file-name prefix DCP's global plan gives this process (__R_)
        prefix = None

        def write_data(self, plan, planner):
            self.prefix = plan.storage_data.prefix
            return super().write_data(plan, planner)

    reshard(module)  # the registered parameters are the shards, not what a forward left gathered
    writer = Writer(str(tmp))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUIET)
        dcp.save(state_tensors(module, optimizer, ema, extras), storage_writer=writer)
    return sorted(f.name for f in Path(tmp).iterdir() if f.name.startswith(writer.prefix) and f.suffix == ".distcp")


def check_shard_files(path: Path, metadata) -> None:
    """Before dcp.load (collective: every process calls it): every file DCP's .metadata names exists where this
    process looks (under resharding a process may read any of them). A CheckpointError naming the missing files,
    the processes that miss them and the shared run directory this needs, the same on every process, instead of a
    dcp.load that fails or waits on some processes only (node-local run directories)."""
    from difrl.train.run.manifest import SHARED, all_gather_objects

    needed = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    everyone = all_gather_objects([name for name in needed if not (Path(path) / name).is_file()])
    if any(everyone):
        said = (f"{', '.join(everyone[0])} missing for every process" if all(m == everyone[0] for m in everyone) else
                "; ".join(f"process {i} does not find {', '.join(names)}" for i, names in enumerate(everyone) if names))
        raise CheckpointError(f"checkpoint {path}: its shard files are incomplete ({said}): {SHARED}")


def read_metadata(path: Path):
    """DCP's .metadata of checkpoint `path` (what each key's global shape and dtype are); a CheckpointError naming
    the file when it is missing or unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001  (a pickle of garbage raises anything)
        raise CheckpointError(f"checkpoint {path}: {path / METADATA} is missing or corrupted, so its sharded files "
                              f"cannot be read ({type(e).__name__}: {e})") from e


def _load(path: Path, tensors: dict[str, torch.Tensor], no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=QUIET)
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(path)), no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP wraps each process's failure in a
        # CheckpointException, a BaseException)
        raise CheckpointError(f"checkpoint {path}: its sharded files (__*.distcp, {METADATA}) do not load "
                              f"({type(e).__name__}: {str(e)[:400]})") from e


def load_sharded(path: Path, module, optimizer, ema, extras: dict | None, metadata=None) -> None:
    """Restore checkpoint `path` into the live objects, each tensor read in its own layout (this process's shard,
    or the whole tensor): every process calls it (collective). A checkpoint of another model, LoRA setting, EMA or
    objective is a ValueError naming what differs; unreadable files a CheckpointError."""
    metadata = metadata or read_metadata(path)
    meta = metadata.state_dict_metadata
    params = trainable_params(module)
    saved = {k.split("/", 1)[1] for k in meta if k.startswith("trainable/")}
    if saved != set(params):
        extra, missing = sorted(saved - set(params)), sorted(set(params) - saved)
        raise ValueError(f"checkpoint {path} does not match this model: unexpected {extra[:4]}, missing {missing[:4]} "
                         "(was it trained with another model or LoRA setting?)")
    shapes = [f"{k} is {list(meta[f'trainable/{k}'].size)} in the checkpoint, {list(p.shape)} here"
              for k, p in params.items() if tuple(meta[f"trainable/{k}"].size) != tuple(p.shape)]
    if shapes:
        raise ValueError(f"checkpoint {path} does not match this model: {'; '.join(shapes[:4])}")
    if ema is not None and not any(k.startswith("ema/") for k in meta):
        raise ValueError(f"checkpoint {path} has no EMA weights but train.ema_decay > 0")
    for name in extras or {}:
        if not any(k.startswith(f"extra/{name}/") for k in meta):
            raise ValueError(f"checkpoint {path} has no {name} weights, which this config needs (was it written with "
                             "another train.objective or rollout.sync_every?)")
    reshard(module)  # its parameters are the shards (loaded in place, gathered by the next forward)
    want: dict[str, torch.Tensor] = {f"trainable/{k}": p.detach() for k, p in params.items()}
    if ema is not None:
        want |= {f"ema/{k}": torch.zeros_like(p.detach()) for k, p in params.items()}
    for name in extras or {}:
        want |= {f"extra/{name}/{k}": torch.zeros_like(p.detach()) for k, p in params.items()}
    # AdamW's state from the checkpoint's keys (before a first step the optimizer has none): a moment laid out like
    # its parameter, anything else (the step count) whole
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, m in meta.items():
        if key.startswith("optim/"):
            name, what = key[len("optim/"):].rsplit("/", 1)
            p = params[name].detach()
            same = tuple(m.size) == tuple(p.shape)
            t = torch.zeros_like(p) if same else torch.zeros(m.size, dtype=m.properties.dtype)
            moments.setdefault(name, {})[what] = want[key] = t
    check_shard_files(path, metadata)  # a missing file is named on every process, not a dcp.load that waits
    with torch.no_grad():
        _load(path, want)
    if ema is not None:
        ema.shadow = {k: want[f"ema/{k}"] for k in params}
    for name, extra in (extras or {}).items():
        extra.shadow = {k: want[f"extra/{name}/{k}"] for k in params}
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    by_id = {id(p): k for k, p in params.items()}
    opt = optimizer.state_dict()
    opt["state"] = {index[i]: moments[name] for i, name in by_id.items() if name in moments and i in index}
    # the moments and step counts from the checkpoint, the hyperparameters (lr, betas, ...) the config's
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(opt)
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)


def read_sharded(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of sharded checkpoint `path` whose key starts with `prefix`, in full, in this one process (no
    process group: `difrl export`, tests), by key (trainable/NAME, ema/NAME, extra/X/NAME, optim/NAME/KEY). A
    CheckpointError names a file that does not load."""
    meta = read_metadata(path).state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if hasattr(m, "size") and k.startswith(prefix)}
    _load(path, out, no_dist=True)
    return out

