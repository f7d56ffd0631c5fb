"""The ``difrl`` command.

    difrl train configs/digits.yaml [key=value ...] [--out DIR] [--overwrite]
    difrl train resume=DIR [train.iterations=N ...]               # continue a run with its config.yaml
    difrl eval configs/digits.yaml [key=value ...]                # the config's model
    difrl eval runs/digits [--json]                                # a run's policy: a before/after table (eval.json)
    difrl eval configs/text_arithmetic.yaml --checkpoint runs/text_arithmetic/policy.safetensors
    difrl config [configs/digits.yaml] [key=value ...]            # every key (or the resolved config)
    difrl check configs/flux_flow_grpo.yaml [key=value ...] [--gpus 8]   # every problem at once, nothing loaded
    difrl compare runs/a runs/b [...] [--out compare.html]        # runs' curves overlaid, final evals + seed spread
    difrl export runs/flux [--iteration N] [--out DIR]            # a (sharded) checkpoint as transformer/, lora/, ...
    difrl sample configs/digits.yaml --search dts-star --budget 160 [--prompt "a handwritten 3"] [--grid g.png]
    difrl sample runs/digits --grid g.png                          # a finished run's policy (any world)
    difrl sample configs/flux_tiny.yaml --checkpoint runs/flux_tiny/lora   # a LoRA on the config's pipeline

Config errors (unknown key, wrong type, out of range, a resume that changes the run's settings, a run
directory that already holds a run) and bad input (a missing checkpoint, a failing reward, a reward server
that is down at start-up) end the command with one clear line and exit status 2; `difrl train` first checks the whole
config as `difrl check` does and lists every problem it finds (difrl.train.check). Ctrl-C or SIGTERM during
training saves a checkpoint and ends with one line naming the command that continues the run as it was launched
(the launcher and its options kept, `train resume=RUN_DIR` as the arguments), exit status 130 / 143
(difrl.train.run.interrupt). Known third-party start-up noise is left out (difrl.utils.quiet).
"""

from __future__ import annotations

import argparse
import os
import sys

# The parser and main; the docstring above is `difrl -h`'s text. One module per command: difrl/cli/train.py, eval.py,
# sample.py, config.py, runs.py (report and export), rewards.py (rewards and reward-server), each with
# add_arguments(parser) and the function that runs it; `difrl check`, `compare` and `plan` live beside what they
# check, compare and simulate (difrl.train.check, difrl.report.compare_page, difrl.train.planner.command). What the
# commands share: difrl.cli.args (a config path among key=value overrides, a run directory standing for its config)
# and difrl.cli.weights (the trained policy eval and sample load).


def commands() -> list[tuple[str, str, object, object]]:
    """(name, help, add_arguments(parser), run(args) -> exit status) of every command, in `difrl -h` order. Imported
    when called: main quiets third-party start-up noise first."""
    from difrl.cli import config, rewards, runs, sample, train
    from difrl.cli import eval as evaluate
    from difrl.cli.args import load
    from difrl.report import compare_page
    from difrl.train import check
    from difrl.train.planner import command as plan_command

    return [
        ("train", "train a policy with GRPO", train.add_arguments, train.main),
        ("eval", "evaluate a config's model or a run's trained policy", evaluate.add_arguments, evaluate.main),
        ("sample", "sample a config's model or a run's trained policy per prompt: base, best-of-N, DTS or DTS* search",
         sample.add_arguments, sample.main),
        ("config", "list every config key, or print a resolved config", config.add_arguments, config.main),
        ("check", "list every problem of a config at once (keys, paths, rewards, the micro-batch plan on --gpus N) "
                  "without loading a model; exit status 1 if any", check.add_arguments, check.main),
        ("report", "write RUN_DIR/report.html: config, curves, eval table, samples (self-contained)",
         runs.add_report_arguments, runs.write_run_report),
        ("compare", "write one HTML page comparing runs: curves overlaid (iterations and seconds), final evaluations "
                    "with each config's seed spread", compare_page.add_arguments, compare_page.main),
        ("export", "write a run's checkpoint (sharded or gathered) as the plain final weights: transformer/, lora/ or "
                   "policy.safetensors (one process)", runs.add_export_arguments, runs.export_run),
        ("plan", "simulate a flow or masked config at real size on N GPUs (fake tensors, a fake process group, the "
                 "trainer's own code): memory per GPU by phase and category, collectives, a verdict",
         plan_command.add_arguments, lambda args: plan_command.main(args, load)),
        ("rewards", "list the rewards found by name: built-ins and installed entry points", rewards.add_list_arguments,
         rewards.list_rewards),
        ("reward-server", "serve rewards over HTTP (msgpack) to trainers: reward.weights={remote: 1}",
         rewards.add_server_arguments, rewards.serve),
    ]


def main(argv: list[str] | None = None) -> int:
    from difrl.utils.quiet import quiet_third_party

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # difrl never downloads at run time
    quiet_third_party()  # before anything imports transformers / diffusers

    from difrl.config import ConfigError
    from difrl.rewards import RewardError

    ap = argparse.ArgumentParser(prog="difrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, summary, add_arguments, run in commands():
        p = sub.add_parser(name, help=summary)
        add_arguments(p)
        p.set_defaults(fn=run)
    args, extra = ap.parse_known_args(argv)
    # key=value overrides may follow the options (difrl eval RUN --prompts p.txt eval.per_digit=2)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "rest")]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.rest = [*args.rest, *extra]
    args.argv = argv  # None: sys.argv[1:], this process's own command line (the resume command is built from it)
    try:
        return args.fn(args)
    except (ConfigError, RewardError, FileNotFoundError, ValueError) as e:  # ValueError: bad checkpoints/settings
        print(f"difrl {args.cmd}: error: {e}", file=sys.stderr)
        return 2

