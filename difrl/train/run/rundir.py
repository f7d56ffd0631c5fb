"""A run directory is the run: which directory a command trains in, and what a resume may change.

    run_dir = claim_run_dir(cfg, out_dir, overwrite, "runs/flow")   # a recipe's first line: refuse before loading
    changes = check_resume(cfg, run_dir, said)                     # [(key, old, new)]; refuses algorithm changes
    summary = finished(cfg, run_dir)                               # resume= of a finished run: its summary, else None

`said(key)` names who says a new value in a refusal ("the command line says", "configs/x.yaml says"; default
"this config says"): `difrl train resume=R [CONFIG] [key=value ...]` passes it (difrl.train.entry.load_resume_config).

**A directory that holds a run** (config.yaml, metrics.jsonl, summary.json or checkpoints/) is refused unless
the command continues it (``resume=DIR``) or replaces it (``--overwrite``: Run.open removes the earlier run's
files, RUN_FILES, before writing, so no stale sample grid, metric row, checkpoint or report survives; a file
difrl does not write is left where it is and named). Nothing is written before this check. What a start that
failed before its first iteration left (config.yaml, an empty metrics.jsonl, the evaluation before: no
checkpoint, no metric row, no summary.json, no trained weights; ``failed_start``) is not a run: the next start
replaces it (Run.open, saying so), and ``resume=`` of it says to start again. The trackers that ``log_with``
names must be installed (check_trackers): that is checked here too, before anything loads or is written.

**A finished run has nothing left to do**: ``resume=DIR`` of a run whose summary.json covers its newest
checkpoint and whose train.iterations the command does not raise returns that summary (``finished``) after one
line saying so; nothing is loaded, evaluated or written. **A run that stopped early stays stopped**: the stop
(iteration, reason and the stop.* rule that made it) is in the checkpoint it wrote (state.json, ``stopped_early``),
so ``resume=`` of it, with or without more train.iterations, says so and does nothing, or, when the run was
killed before its summary, finishes it (evaluation after, summary, weights) without training (``held_stop``).
Only another stop rule on the command line (stop.fd_rise higher or null, stop.patience, stop.min_accuracy, with
``resume_override=true``: they change the run's recipe) lifts it, and the run continues under that rule.

**Resume is the run's own config.yaml.** ``difrl train resume=R`` loads R/config.yaml; key=value overrides and a
config file given beside it are compared with it key by key. A key in RESUME_SAFE may change (said on the
command line: a change only the config file makes is refused, difrl.train.entry.load_resume_config); any other change
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
TRAINED = ("policy.safetensors", "lora", "transformer", "transformer_2", "export")  # a run's trained weights
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # log_with name -> the package it needs


class RunDirError(ValueError):
    """A run directory the command may not use as asked; the message names it and the ways out."""


def holds_run(run_dir: Path) -> list[str]:
    """The files and directories that mark `run_dir` as holding a run (empty: it holds none, or only what a start
    that failed before its first iteration left, see failed_start)."""
    found = [name for name in RUN_MARKERS if (Path(run_dir) / name).exists()]
    return [] if failed_start(run_dir) else found


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under root (renamed into place, so never half-written), newest first (here, not in
    state.py, so that the run-directory checks before loading need no torch; state.py re-exports it)."""
    found = [(int(p.name[5:]), p) for p in Path(root).glob("iter-*") if p.is_dir() and p.name[5:].isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_iterations(run_dir: Path) -> list[int]:
    """The iterations of the complete checkpoints in run_dir/checkpoints, oldest first."""
    return [int(p.name[5:]) for p in reversed(checkpoint_dirs(Path(run_dir) / "checkpoints"))]


def failed_start(run_dir: Path) -> list[str]:
    """What a start that failed before its first iteration left in `run_dir` (a wrong log_with, a reward failing
    on the evaluation before, an out-of-memory in the first update, a killed process): the RUN_FILES present when
    config.yaml is (Run.open writes it first) but no checkpoint (checkpoints/ empty or absent), no metric row
    (metrics.jsonl empty or absent), no summary.json and no trained weights. Empty when it holds a run or nothing."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        return []
    checkpoints, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    checkpointed = checkpoints.exists() and (not checkpoints.is_dir() or any(checkpoints.iterdir()))  # .tmp-* too
    if (checkpointed or (metrics.exists() and metrics.stat().st_size > 0)
            or any((run_dir / name).exists() for name in ("summary.json", *TRAINED))):
        return []
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def check_trackers(cfg) -> None:
    """Refuse, before anything loads or is written, a log_with tracker whose package is not installed."""
    from importlib.util import find_spec

    for name in cfg.log_with:
        package = TRACKER_PACKAGES.get(name, name)
        if find_spec(package) is None:
            raise ConfigError(f"config key 'log_with': {name} needs the package {package!r}, which is not installed: "
                              f"pip install 'difrl[{name}]', or leave {name} out of log_with", "log_with")


def same_dir(a, b) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def claim_run_dir(cfg, out_dir, overwrite: bool, default: str) -> Path:
    """The run directory of this command, checked before anything loads or is written: resume=DIR (a run, whose
    config.yaml the config must agree with, see check_resume; --out, if given, must be DIR), else --out, the
    config's `out`, or `default`, which must not hold a run unless `overwrite` (what a failed start left is no
    run: Run.open replaces it). The trackers of log_with must be installed (check_trackers)."""
    check_trackers(cfg)
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
        if left := failed_start(run):
            raise FileNotFoundError(f"resume={run}: {run} holds no run to continue, only what a start that failed "
                                    f"before its first iteration left ({', '.join(left)}: no checkpoint, no metric "
                                    f"row): start it again with the command that started it, without resume= (what "
                                    f"it left is replaced)")
        if not checkpoint_iterations(run) and not (run / "checkpoints" / "latest").exists():
            raise FileNotFoundError(f"resume={run}: no checkpoint found in {run / 'checkpoints'} (the run stopped "
                                    "before its first one); start it again with --overwrite")
        check_resume(cfg, run)
        return run
    run = Path(out_dir or cfg.out or default)
    found = holds_run(run)
    if found and not overwrite:
        shown = ", ".join(f + ("/" if (run / f).is_dir() else "") for f in found)
        raise RunDirError(f"{run} already holds a run ({shown}): continue it with resume={run}, or start again in "
                          f"it with --overwrite (its files are removed first), or train into another --out")
    return run


def stop_rule(cfg) -> dict | None:
    """The early-stopping rule in force (the stop section as a dict), None for a trainer without one. A stop
    records it: on resume the stop holds while the rule is the same (held_stop)."""
    stop = getattr(cfg, "stop", None)
    return None if stop is None else dataclasses.asdict(stop)


def held_stop(cfg, state: dict, rule=None) -> dict | None:
    """A resumed run's early stop, state["stopped_early"] = {iteration, reason, rule} (written into the checkpoint
    of the iteration it stopped after), when cfg's stop rule is still the one that made it: the run stays stopped.
    Another rule lifts it: the record is cleared in `state`, the world's stop `rule` (difrl.worlds.contract: FDRise)
    restarts its counters there (they counted against the old rule), and the run continues. None when it continues."""
    stop = state.get("stopped_early")
    if not stop:
        return None
    if stop.get("rule") == stop_rule(cfg):
        return stop
    state["stopped_early"] = None
    if rule is not None:
        rule.lift(state)
    return None


def _newest_state(run_dir: Path) -> dict:
    """The newest checkpoint's state.json ({} when there is none or it does not read: loading it will say why)."""
    import json

    for ckpt in checkpoint_dirs(Path(run_dir) / "checkpoints")[:1]:
        try:
            return json.loads((ckpt / "state.json").read_text())
        except (OSError, ValueError):
            return {}
    return {}


def finished(cfg, run_dir: Path) -> dict | None:
    """`resume=` of a run with nothing left to do: its summary.json (said in one line, by the main process) when
    the run finished at its newest checkpoint and cfg.train.iterations asks for no iteration past it, or stopped
    early there and its stop still holds (held_stop: the same stop rule, whatever train.iterations says); else
    None, and the run continues (a held stop without its summary: the trainer finishes it without training)."""
    import json
    import os

    path = Path(run_dir) / "summary.json"
    if not cfg.resume or not path.is_file():
        return None
    summary = json.loads(path.read_text())
    done, asked = int(summary.get("iterations", -1)), cfg.train.iterations
    if any(it > done for it in checkpoint_iterations(run_dir)):  # resumed past its end since (summary.json is old)
        return None
    further = None  # how to train it further, when not by raising train.iterations
    if (state := _newest_state(run_dir)).get("stopped_early"):  # the stop is in its checkpoint: held_stop
        if (stop := held_stop(cfg, state)) is None:
            return None  # another stop rule: the run continues under it
        limit, what = asked, f"stopped early after iteration {stop['iteration']} ({stop['reason']})"
        further = ("change its stop rule on the command line with resume_override=true (stop.fd_rise higher, or "
                   "null to stop no more; stop.patience; stop.min_accuracy)")
    elif summary.get("stopped_early"):  # stopped before stops were recorded: only raising iterations continues it
        limit = (yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}).get("train", {}).get("iterations", done)
        what = f"stopped early after iteration {done} ({summary['stopped_early']})"
    else:
        limit = done
        what = f"finished its {done} iteration{'s' * (done != 1)}" + (f", past train.iterations={asked}" if asked < done
                                                                       else "")
    if asked > limit:
        return None
    if int(os.environ.get("RANK", "0")) == 0:  # under a launcher, every process returns; one says it
        print(f"difrl: resume={run_dir}: the run {what}; nothing to do (its results: {path}). To train it further, "
              + (further or f"pass train.iterations=N with N above {limit}"))
    return {**summary, "run_dir": str(run_dir)}  # where it is now (the closing line lists its files)


def clear_run(run_dir: Path, names=RUN_FILES) -> tuple[list[str], list[str]]:
    """--overwrite: remove the earlier run's files (RUN_FILES, or `names`) from `run_dir`. Returns (removed,
    kept): the names removed and those of anything else left in the directory (files difrl does not write)."""
    removed = []
    for name in names:
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


def same_settings(cfg, run_dir: Path) -> bool:
    """`cfg` is run_dir/config.yaml's settings, bookkeeping aside (`difrl eval RUN_DIR` measured what the run
    measured: its evaluation before training is comparable)."""
    saved = saved_config(run_dir, type(cfg))
    return saved is not None and not resume_changes(cfg, saved)


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
