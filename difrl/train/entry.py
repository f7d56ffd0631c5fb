"""The body of the entry scripts (scripts/train_flux.py, train_sd3.py, train_wan.py): `difrl train` for one model kind.

    python scripts/train_flux.py configs/flux_tiny.yaml [key=value ...] [--out DIR] [--overwrite] [key=value ...]
    python scripts/train_flux.py resume=DIR [train.iterations=N ...]        # continue a run with its config.yaml
    accelerate launch --num_processes 8 scripts/train_flux.py configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev

Loads the typed config (dotted overrides; with resume=DIR the run's own DIR/config.yaml, what a resume may
change checked as for `difrl train resume=DIR`: load_resume_config, which `difrl train` uses too), checks it as
`difrl check` does (every problem listed at once, before anything loads: difrl.train.check), checks that
it is for this script's model kind, runs difrl.train.flow.trainer.train (the one trainer), and prints the evaluation
before and after on the main process. Config and input errors end with one line naming the problem and exit
status 2; SIGINT / SIGTERM with a checkpoint and one line naming the command that continues the run as it was
launched (the same launcher and options, `resume=DIR` as the script's arguments), exit status 130 / 143
(difrl.train.run.interrupt).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def given(overrides: list[str], key: str) -> str | None:
    """The value of the last `key=value` override, or None."""
    values = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == key]
    return values[-1] if values else None


def load_resume_config(path: str | None, overrides: list[str]):
    """`difrl train resume=R [CONFIG] [key=value ...]`: the run's own R/config.yaml with the overrides (CONFIG, if
    given, in its place, checked against R/config.yaml key by key like the overrides), refused as
    difrl.train.run.rundir.check_resume says, naming who says each refused value: the command line or CONFIG. A
    change that only CONFIG makes is refused too, a safe one included (a file beside resume= is mostly the one
    the run started from, whose train.iterations or eval.every the start overrode: it must not extend the run
    unsaid), naming the key=value to pass on the command line instead; resume_override=true lets it through."""
    from difrl.config import CLI, ConfigError
    from difrl.train.recipes import load_train_config
    from difrl.train.run.rundir import check_resume, show

    run = Path(given(overrides, "resume"))
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"resume={run}: {run} holds no run to continue (no config.yaml, no checkpoint)")
    cfg = load_train_config(path or str(run / "config.yaml"), overrides)
    keys = [o.partition("=")[0].strip() for o in overrides]

    def on_cli(key: str) -> bool:
        return path is None or any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys)

    def said(key: str) -> str:
        return f"{'the ' + CLI if on_cli(key) else path} says"

    from_file = [c for c in check_resume(cfg, run, said) if not on_cli(c[0])]  # [(key, old, new)], safe ones here
    if from_file and not cfg.resume_override:
        where = run / "config.yaml"
        listed = "; ".join(f"{k}={show(old)} in {where}, {path} says {show(new)}" for k, old, new in from_file)
        wanted = " ".join(f"{k}={show(new)}" for k, _, new in from_file)
        raise ConfigError(f"resume={run}: {listed}. A config file beside resume= does not change the run: to change "
                          f"it, say so on the command line ({wanted}); else leave {path} out (`difrl train "
                          f"resume={run}` needs no config file)", from_file[0][0])
    return cfg


def main(kind: str, argv: list[str] | None = None, description: str | None = None) -> int:
    from difrl.utils.quiet import quiet_third_party

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # difrl never downloads at run time
    quiet_third_party()  # before anything imports transformers / diffusers

    from difrl.config import ConfigError
    from difrl.rewards import RewardError

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rest", nargs="*", metavar="CONFIG [key=value ...] | resume=DIR [key=value ...]",
                    help="a YAML config (configs/*.yaml) and key=value overrides, e.g. model.path=/models/x "
                         "train.lr=1e-5; or resume=DIR: continue the run in DIR with its own config.yaml")
    ap.add_argument("--out", help="run directory (default: the config's `out`); with resume=, the same or nothing")
    ap.add_argument("--overwrite", action="store_true", help="train into a directory that holds a run (its files "
                                                             "are removed first)")
    args = ap.parse_intermixed_args(argv)  # overrides may follow --out / --overwrite too
    name = Path(sys.argv[0]).name
    configs = [a for a in args.rest if "=" not in a]
    overrides = [a for a in args.rest if "=" in a]
    resume = given(overrides, "resume")
    if len(configs) > 1:
        ap.error(f"one config file, then key=value overrides: {configs[1]!r} is neither")
    if not configs and not resume:
        ap.error("give a config file (configs/*.yaml), or resume=DIR to continue a run")
    path = configs[0] if configs else None
    from difrl.train.run.interrupt import Interrupted, stop_on_signals

    try:
        from difrl.train.check import checked_config
        from difrl.train.flow.trainer import train

        def refuse_other_kind(cfg) -> None:  # any world's config loads: a wrong one is named here, first
            if cfg.model.kind != kind:
                script = Path(sys.argv[0]).with_name(f"train_{cfg.model.kind}.py")
                what, head = ((f"resume={resume}", f"resume={resume}: {resume} is a model.kind={cfg.model.kind} run")
                              if path is None else (path, f"{path} is a model.kind={cfg.model.kind} config"))
                other = f"scripts/{script.name} {what} or " if script.is_file() else ""
                raise ValueError(f"{head}; this script trains {kind} (use {other}difrl train {what})")

        # then every problem of the config at once, before anything loads (difrl.train.check: what `difrl check` lists)
        cfg = checked_config(path, overrides, load_resume_config(path, overrides) if resume else None,
                             before=refuse_other_kind)
        out = args.out or (given(overrides, "out") if resume else None)
        # SIGINT / SIGTERM: a checkpoint, one line with the command that continues the run, exit 130 / 143
        with stop_on_signals(program=(), argv=argv):
            summary = train(cfg, out_dir=out, overwrite=args.overwrite)
    except (ConfigError, RewardError, FileNotFoundError, ValueError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{name}: {e}", file=sys.stderr)
        return e.code
    if int(os.environ.get("RANK", "0")) == 0:
        before, after = summary["eval_before"], summary["eval_after"]
        change = summary.get("reward_change")
        noise = (f" ({change['delta']:+.4f}; sampling noise of the difference {change['noise']:.4f}, "
                 f"{after.get('samples', '?')} fixed-seed samples)") if change else ""
        print(f"\n{name}: {summary['iterations']} iterations; eval reward {before['reward']:.4f} -> {after['reward']:.4f}{noise}")
        from difrl.train.scaffold import run_files

        print(run_files(Path(summary["run_dir"])))
    return 0
