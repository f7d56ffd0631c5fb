"""A run directory is the run: which directory a command trains in, and what a resume may change.

    run_dir = claim_run_dir(cfg, out_dir, overwrite, "runs/flow")   # a recipe's first line: refuse before loading
    changes = check_resume(cfg, run_dir, said)                     # [(key, old, new)]; refuses algorithm changes

`said(key)` names who says a new value in a refusal ("the command line says", "configs/x.yaml says"; default
"this config says"): `difrl train resume=R [CONFIG] [key=value ...]` passes it (difrl.cli.load_resume_config).

**A directory that holds a run** (config.yaml, metrics.jsonl, summary.json or checkpoints/) is refused unless
the command continues it (``resume=DIR``) or replaces it (``--overwrite``: Run.open removes the earlier run's
files, RUN_FILES, before writing, so no stale sample grid, metric row, checkpoint or report survives; a file
difrl does not write is left where it is and named). Nothing is written before this check.

**Resume is the run's own config.yaml.** ``difrl train resume=R`` loads R/config.yaml; key=value overrides and a
config file given beside it are compared with it key by key. A key in RESUME_SAFE may change; any other change
is refused with one line naming each key, its value in R/config.yaml and what the command says, unless
``resume_override=true``. Every change that goes through (a safe one too) is printed and appended to the
``history`` of R/config.yaml as {iteration, key, old, new}, so the run's settings are never lost. The
bookkeeping keys (``resume``, ``resume_override``, ``resume_unverified``, ``out``, ``history``) belong to the
command, not the run: they are not compared, and ``--out`` (or ``out=`` on the command line) must name the
resumed directory itself.

Why each RESUME_SAFE key leaves the algorithm alone:

- ``train.iterations``: where the run ends. Every random draw is a function of (seed, iteration, index) and
  no iteration depends on the total (there is no schedule over the run's length), so iteration k is the same
  whatever total is set: a longer run continues the same run (tests: 3 + resume + 3 == 6).
- ``checkpoint_every``: when checkpoints are written; resuming from any of them is exact.
- ``eval.every``: when the held-out evaluation runs. It samples the current weights with its own fixed seeds,
  and training draws its random numbers from generators seeded by (seed, iteration), which an evaluation does
  not advance (tests/test_run_dir.py: a masked run's training rows with and without evaluations). The other ``eval.*`` keys stay refused: they change what is
  measured, so the "before" and "after" of summary.json would stop being comparable. With ``stop.fd_rise``
  set, early stopping reads these evaluations, so eval.every changes *when* such a run may stop.
- ``threads``: torch's CPU threads, i.e. speed (another count may round float sums differently, as another
  machine does).
- ``log_with``: trackers beside metrics.jsonl.
- ``reward.timeout``: how long a reward may take before the run stops; a score is the same whenever it comes.

``train.checkpoint_format: auto`` is not a change against the format the run resolved it to (config.yaml records
the resolved one: sharded under FSDP, else gathered), so a command that leaves it at auto keeps the run's format
whatever the launch; naming the other format is refused as any algorithm key is (both formats load either way).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import yaml

from difrl.config import ConfigError, config_to_dict

RESUME_SAFE = ("train.iterations", "checkpoint_every", "eval.every", "threads", "log_with", "reward.timeout")
BOOKKEEPING = ("resume", "resume_override", "resume_unverified", "out", "history")
# what marks a directory as holding a run, and every file or directory a run (or `difrl eval`) writes in it
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints")
RUN_FILES = (*RUN_MARKERS, "eval.json", "samples", "reward_curve.png", "report.html", "policy.safetensors", "lora",
             "transformer", "transformer_2", "tensorboard", "wandb", "export")


class RunDirError(ValueError):
    """A run directory the command may not use as asked; the message names it and the ways out."""


def holds_run(run_dir: Path) -> list[str]:
    """The files and directories that mark `run_dir` as holding a run (empty: it holds none)."""
    return [name for name in RUN_MARKERS if (Path(run_dir) / name).exists()]


def same_dir(a, b) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def claim_run_dir(cfg, out_dir, overwrite: bool, default: str) -> Path:
    """The run directory of this command, checked before anything loads or is written: resume=DIR (a run, whose
    config.yaml the config must agree with, see check_resume; --out, if given, must be DIR), else --out, the
    config's `out`, or `default`, which must not hold a run unless `overwrite`."""
    if cfg.resume:
        run = Path(cfg.resume)
        if overwrite:
            raise RunDirError(f"resume={run} continues the run in {run} and --overwrite would start it again: give "
                              "one of them")
        if out_dir is not None and not same_dir(out_dir, run):
            raise RunDirError(f"resume={run} continues the run in {run}, but --out (or out=) {out_dir} names another "
                              f"directory: drop it (a resumed run stays in its directory), or start a new run in "
                              f"{out_dir} without resume=")
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"resume={run}: {run} holds no run to continue (no config.yaml, no checkpoint)")
        check_resume(cfg, run)
        return run
    run = Path(out_dir or cfg.out or default)
    found = holds_run(run)
    if found and not overwrite:
        shown = ", ".join(f + ("/" if (run / f).is_dir() else "") for f in found)
        raise RunDirError(f"{run} already holds a run ({shown}): continue it with resume={run}, or start again in "
                          f"it with --overwrite (its files are removed first), or train into another --out")
    return run


def clear_run(run_dir: Path) -> tuple[list[str], list[str]]:
    """--overwrite: remove the earlier run's files (RUN_FILES) from `run_dir`. Returns (removed, kept): the names
    removed and those of anything else left in the directory (files difrl does not write)."""
    removed = []
    for name in RUN_FILES:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    kept = sorted(p.name for p in Path(run_dir).iterdir()) if Path(run_dir).is_dir() else []
    return removed, kept


def _leaves(cfg, prefix: str = ""):
    """(dotted key, plain value) of every setting of a typed config; a dict-valued key is one value."""
    for f in dataclasses.fields(cfg):
        if not f.init:
            continue
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _leaves(value, key + ".")
        else:
            yield key, config_to_dict(value)


def saved_config(run_dir: Path, cls: type):
    """The typed config in run_dir/config.yaml read as `cls` (the resuming config's class), or None if absent."""
    from difrl.config import load_config

    path = Path(run_dir) / "config.yaml"
    return load_config(cls, path) if path.is_file() else None


def saved_trainer(run_dir: Path) -> tuple[str, str]:
    """(model.kind, trainer) of the run in run_dir/config.yaml, read before it is typed (another trainer's config
    would not load as this one's)."""
    from difrl.worlds import MASKED_KINDS

    raw = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    kind = str((raw.get("model") or {}).get("kind", "digits"))
    return kind, "masked" if kind in MASKED_KINDS else "flow"


def resume_changes(cfg, saved) -> list[tuple[str, object, object]]:
    """(key, value in the saved config, value in `cfg`) for every setting that differs, bookkeeping aside."""
    old = dict(_leaves(saved))
    return [(k, old[k], v) for k, v in _leaves(cfg) if k not in BOOKKEEPING and old[k] != v
            and not (k == "train.checkpoint_format" and "auto" in (old[k], v))]


def show(value) -> str:
    """A config value as a user types it on the command line (YAML flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def check_resume(cfg, run_dir: Path, said=None) -> list[tuple[str, object, object]]:
    """`cfg` against run_dir/config.yaml: the changed settings [(key, old, new)], or a ConfigError naming every
    change outside RESUME_SAFE (on one line) unless cfg.resume_override; another trainer is refused either way.
    `said(key)`: who says the new value, for the message ("the command line", a config file)."""
    where = Path(run_dir) / "config.yaml"
    if not where.is_file():
        return []
    said = said or (lambda key: "this config says")
    kind, trainer = saved_trainer(run_dir)
    if trainer != cfg.trainer:
        raise ConfigError(f"resume={run_dir}: model.kind={kind} in {where}, {said('model.kind')} {cfg.model.kind}. A "
                          f"run cannot change trainer ({trainer} -> {cfg.trainer}): start a new run with --out",
                          "model.kind")
    changes = resume_changes(cfg, saved_config(run_dir, type(cfg)))
    refused = [c for c in changes if c[0] not in RESUME_SAFE]
    if refused and not cfg.resume_override:
        listed = "; ".join(f"{k}={show(old)} in {where}, {said(k)} {show(new)}" for k, old, new in refused)
        raise ConfigError(f"resume={run_dir}: {listed}. A resumed run keeps its own settings: leave these out "
                          f"(`difrl train resume={run_dir}` needs no config file), start a new run with --out, or pass "
                          f"resume_override=true to change them (recorded in the history of {where}); a resume may "
                          f"change {', '.join(RESUME_SAFE)}", refused[0][0])
    return changes
