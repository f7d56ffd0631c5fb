"""The ``difrl`` command.

    difrl train configs/digits.yaml [key=value ...] [--out DIR]   # resume: add resume=DIR
    difrl eval configs/digits.yaml [key=value ...]                # the config's model
    difrl eval runs/digits                                         # a finished run's policy
    difrl config [configs/digits.yaml] [key=value ...]            # every key (or the resolved config)

Config errors (unknown key, wrong type, out of range) and bad input (a missing checkpoint, a
failing reward) end the command with one clear line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _split(argv: list[str]) -> tuple[str | None, list[str]]:
    path = None
    overrides = []
    for a in argv:
        if "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise SystemExit(f"difrl: unexpected argument {a!r} (overrides are key=value)")
    return path, overrides


def _load(path: str | None, overrides: list[str]):
    from difrl.train.config import FlowConfig, load_flow_config

    return load_flow_config(path, overrides) if path else load_flow_config(None, overrides) if overrides else FlowConfig()


def cmd_train(args) -> int:
    from difrl.train.flow import train

    path, overrides = _split(args.rest)
    if path is None:
        raise SystemExit("difrl train: give a config file, e.g. difrl train configs/digits.yaml")
    cfg = _load(path, overrides)
    summary = train(cfg, out_dir=args.out)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun / accelerate launch, one process reports
        return 0
    before, after = summary["eval_before"], summary["eval_after"]
    run = Path(summary["run_dir"])
    print(f"\ndifrl: {summary['iterations']} iterations" + (f", stopped early: {summary['stopped_early']}" if summary["stopped_early"] else ""))
    print(f"{'':<16}{'before':>10}{'after':>10}")
    for key in ("accuracy", "judge_accuracy", "fd", "diversity"):
        print(f"{key:<16}{before[key]:>10.3f}{after[key]:>10.3f}")
    print(f"real data diversity {after['real_diversity']:.3f}; FD features: {after['fd_extractor']}")
    print(f"results: {run / 'summary.json'}, samples: {run / 'samples'}, curve: {run / 'reward_curve.png'}")
    return 0


def cmd_eval(args) -> int:
    import torch

    from difrl.worlds import build_world

    path, overrides = _split(args.rest)
    model_path = None
    if path and Path(path).is_dir():  # a run directory: its config and its trained policy
        run = Path(path)
        if not (run / "config.yaml").exists():
            raise FileNotFoundError(f"{run} is not a difrl run directory (no config.yaml)")
        cfg = _load(str(run / "config.yaml"), overrides)
        model_path = str(run / "policy.safetensors")
    else:
        cfg = _load(path, overrides)
        model_path = cfg.model.path
    torch.set_num_threads(cfg.threads or len(os.sched_getaffinity(0)))
    world = build_world(cfg.model.kind, model_path)
    metrics, images = world.evaluate(world.policy, cfg.eval.per_digit, cfg.eval.num_steps, cfg.eval.seed, cfg.sampler.shift)
    if args.grid:
        world.save_grid(images, Path(args.grid))
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_config(args) -> int:
    from difrl.config import config_to_dict, describe_config
    from difrl.train.config import FlowConfig

    path, overrides = _split(args.rest)
    if path is None and not overrides:
        print(describe_config(FlowConfig))
    else:
        import yaml

        print(yaml.safe_dump(config_to_dict(_load(path, overrides)), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    from difrl.config import ConfigError
    from difrl.rewards import RewardError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # difrl never downloads at run time
    ap = argparse.ArgumentParser(prog="difrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="train a policy with GRPO")
    p.add_argument("--out", help="run directory (default: the config's `out`, else runs/flow)")
    p.add_argument("rest", nargs="*", help="CONFIG [key=value ...]")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="evaluate a config's model or a run's trained policy")
    p.add_argument("--grid", help="also write a PNG grid of the samples here")
    p.add_argument("rest", nargs="*", help="CONFIG|RUN_DIR [key=value ...]")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("config", help="list every config key, or print a resolved config")
    p.add_argument("rest", nargs="*", help="[CONFIG] [key=value ...]")
    p.set_defaults(fn=cmd_config)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, RewardError, FileNotFoundError, ValueError) as e:  # ValueError: bad checkpoints/settings
        print(f"difrl {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
