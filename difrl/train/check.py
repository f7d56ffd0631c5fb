"""`difrl check CONFIG [key=value ...] [--gpus N]`: every problem of a config at once, before anything loads.

    difrl check configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev --gpus 8
    report = check_config("configs/digits.yaml", ["train.lr=1e-4"], gpus=1)   # report.problems: [] or messages
    print(report.text())                     # a numbered list of the problems, or one line: OK and the plan
    cfg = checked_config(path, overrides)    # difrl train, scripts/train_*.py: the config, or ConfigError listing all

Adapting a published config used to take one run per problem, each error arriving after the previous fix. Here
no model, weights file or reward model is loaded and no run directory is made; what is checked:
1. the config as the trainers read it (difrl.config with `problems=[]`): unknown keys, wrong types and values out of
   range, each section's own checks; a key that fails is reported and left at its default, so the rest is
   checked too. A file that does not read, or a model.kind that names no trainer, stops the check there;
2. the local paths it names: model.path, model.prompt_file, model.eval_prompt_file, eval.fid.weights / reference /
   reference_clips, external.path (a path left unset is the world's default and not checked; eval.fid.weights must
   be set when eval.fid.reference asks for FD);
3. every reward of reward.weights (options at reward.options.NAME) and of the held-out panel eval.rewards: the
   name is known and imports, its options are ones it takes, the options it needs are set, the local files and
   directories they name exist, its optional packages are installed (difrl.rewards.preflight: the messages the
   reward gives when it is built);
4. the micro-batch plan on N processes (--gpus; default: WORLD_SIZE under a launcher, else 1): the trainers' own
   solver, difrl.train.flow.plan.plan_flow_iteration / masked_plan.plan_masked_iteration, whose errors name the
   values that work. It is not checked while a key it reads was refused in step 1.
`difrl train` and the entry scripts run the same checks first (checked_config) and stop with the same list, exit
status 2; one problem reads as the single error it always was. What only loading can tell (a directory that holds
another model, a reward server that is down) is still found at start-up.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from difrl.config import CLI, ConfigError

# the sections whose keys the micro-batch plan reads: a refused value there (left at its default) would plan nonsense
PLAN_SECTIONS = ("train.", "rollout.", "sampler.", "steps.", "tree.", "solrl.", "nft.", "matching.")


@dataclass
class Report:
    """What `difrl check` found: `problems` (one message each, in the order found) and the plan's summary."""
    source: str  # the config file (or "the run's config.yaml")
    gpus: int
    problems: list[str] = field(default_factory=list)
    plan: str | None = None  # the micro-batch plan in one line (None: not computed)
    cfg: object | None = None  # the config as read (refused values at their defaults); None: it did not load

    def text(self) -> str:
        """The numbered list of the problems (and the plan, if it was computed), or one line saying OK."""
        procs = f"{self.gpus} process{'es' if self.gpus > 1 else ''}"
        if not self.problems:
            what = f"model.kind={self.cfg.model.kind}, {self.cfg.trainer} trainer"
            return f"difrl check: {self.source}: OK ({what}; on {procs}: {self.plan})"
        n = len(self.problems)
        lines = [f"difrl check: {self.source}: {n} problem{'s' if n > 1 else ''}"]
        lines += [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
        if self.plan is not None:
            lines.append(f"micro-batch plan on {procs}: {self.plan}")
        return "\n".join(lines)


def launched_processes() -> int:
    """The processes of this launch (accelerate launch / torchrun set WORLD_SIZE), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_config(path: str | None, overrides=(), gpus: int | None = None, cfg=None) -> Report:
    """Every problem of the config at `path` with `overrides` (module docstring). `cfg`: a config already loaded
    (a resumed run's, difrl.train.entry.load_resume_config): step 1 is skipped."""
    from difrl.train.recipes import load_train_config

    overrides, gpus = list(overrides), gpus or launched_processes()
    report = Report(str(path) if path is not None else "the run's config.yaml", gpus, cfg=cfg)
    refused: set[str] = set()
    if cfg is None:
        collected: list[ConfigError] = []
        try:
            report.cfg = load_train_config(path, overrides, collected)
        except ConfigError as e:  # the file does not read, or model.kind names no trainer: nothing more to check
            report.problems = [str(x) for x in (*collected, e)]
            return report
        report.problems = [str(e) for e in collected]
        refused = {e.key for e in collected if e.key}
    cfg = report.cfg

    def source(key: str) -> str:
        keys = [o.partition("=")[0].strip() for o in overrides]
        if any(key == k or key.startswith(k + ".") for k in keys):
            return CLI
        return f"in {path}" if path is not None else report.source

    report.problems += path_problems(cfg, source)
    report.problems += reward_problems(cfg, refused)
    if not any(k.startswith(PLAN_SECTIONS) for k in refused):
        try:
            report.plan = plan_summary(cfg, gpus)
        except ValueError as e:  # ConfigError too: the solver's refusal names the values that work
            report.problems.append(f"the micro-batch plan on {gpus} process{'es' if gpus > 1 else ''}: {e}")
    return report


def checked_config(path: str | None, overrides=(), cfg=None, before=None):
    """The config, checked as `difrl check` checks it on this launch's processes; else a ConfigError: one problem's
    own message, or all of them numbered. `before(cfg)`: the caller's own refusal of the loaded config, which comes
    first (an entry script given another model kind's config)."""
    report = check_config(path, overrides, None, cfg)
    if before is not None and report.cfg is not None:
        before(report.cfg)
    if len(report.problems) == 1:
        raise ConfigError(report.problems[0])
    if report.problems:
        raise ConfigError(f"{len(report.problems)} problems in {report.source} (nothing was loaded):\n"
                          + "\n".join(f"  {i}. {p}" for i, p in enumerate(report.problems, 1)))
    return report.cfg


def path_problems(cfg, source) -> list[str]:
    """The local paths the config names that do not exist (or are not what the key takes). `source(key)` says who
    set a key (the command line, or the file)."""
    from difrl.models.adapters import model_kinds
    from difrl.worlds import FLOW_FILES

    kind = cfg.model.kind
    if kind in model_kinds():
        model = ("any", "a local diffusers pipeline directory (difrl never downloads weights)")
    elif kind == "hf_masked":
        model = ("dir", "a local transformers masked-LM directory (null: the bundled tiny MLM)")
    else:  # a bundled world's trained policy (its own file format), null for the shipped base
        model = ("file", f"a {kind.replace('_', '-')} {'generator' if kind in FLOW_FILES else 'policy'} checkpoint "
                         "(null: the bundled base)")
    wanted = {"model.path": model,
              "model.prompt_file": ("file", "training prompts, one per line, or a .jsonl file of records"),
              "model.eval_prompt_file": ("file", "held-out evaluation prompts (text or .jsonl)"),
              "eval.fid.weights": ("any", "the FD extractor's local weights (a file, or a save_pretrained directory)"),
              "eval.fid.reference": ("any", "reference images (a directory) or a .npz of their statistics"),
              "eval.fid.reference_clips": ("dir", "a directory of reference clips"),
              "external.path": ("file", "the external policy's checkpoint (external.source=checkpoint)")}
    out = []
    for key, (want, what) in wanted.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part, None)
        if value in (None, ""):
            continue
        p = Path(str(value)).expanduser()
        if not p.exists():
            out.append(f"{key} = {str(value)!r} ({source(key)}) does not exist: it takes {what}")
        elif (want == "dir" and not p.is_dir()) or (want == "file" and not p.is_file()):
            out.append(f"{key} = {str(value)!r} ({source(key)}) is not a {'directory' if want == 'dir' else 'file'}: "
                       f"it takes {what}")
    fid = getattr(cfg.eval, "fid", None)  # FD / KID against eval.fid.reference: the extractor's weights are local too
    if fid is not None and fid.reference is not None and fid.weights in (None, ""):
        out.append(f"eval.fid.reference is set, so the {fid.extractor} feature extractor needs its weights: set "
                   "eval.fid.weights to a local file or save_pretrained directory (difrl never downloads weights)")
    return out


def reward_problems(cfg, refused: set[str] = frozenset()) -> list[str]:
    """difrl.rewards.preflight for every trained reward and every reward of the held-out panel; a name the config
    loader already refused (`refused` keys) is not reported twice."""
    from difrl.rewards.preflight import preflight_reward

    rewards = [(name, cfg.reward.options.get(name, {}), f"reward.weights.{name}", f"reward.options.{name}")
               for name in cfg.reward.weights or {}]
    rewards += [(name, options or {}, f"eval.rewards.{name}", f"eval.rewards.{name}")
                for name, options in (getattr(cfg.eval, "rewards", None) or {}).items()]
    out = []
    for name, options, key, prefix in rewards:
        if key not in refused:
            out += preflight_reward(name, options, f"reward {name!r}", prefix)
    return out


def plan_summary(cfg, gpus: int) -> str:
    """The trainer's own micro-batch plan on `gpus` processes in one line; ValueError / ConfigError when the
    iteration does not split (the solver's message)."""
    if cfg.trainer == "masked":
        from difrl.train.masked.plan import plan_masked_iteration

        p = plan_masked_iteration(cfg, gpus, 0)
        return (f"{p.n_total} samples/iteration ({cfg.rollout.prompts_per_iter} prompts x {cfg.rollout.group_size}), "
                f"{p.per_proc} per process; {p.updates} optimizer update(s) per pass of {cfg.train.grad_accum} "
                f"micro-batch(es) of {p.micro} sequence(s)")
    from types import SimpleNamespace

    from difrl.samplers.schedules import sigma_schedule
    from difrl.train.flow.plan import plan_flow_iteration

    said: list[str] = []
    # the world only gives the sigmas, and only their number counts here (NFT's and the matching objectives' trained
    # sigmas are a prefix of the schedule): difrl's own schedule stands in for the pipeline's, nothing is loaded
    plan_flow_iteration(cfg, SimpleNamespace(sigmas=sigma_schedule), gpus, Path(cfg.out or "runs"), said.append)
    banner = said[0].removeprefix("difrl: ")
    return re.sub(r"; run dir .*$", "", re.sub(r"^\d+ process\(es\) x \d+ thread\(s\); ", "", banner))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, help="processes to plan the micro-batches for (default: WORLD_SIZE under a "
                                            "launcher, else 1)")
    p.add_argument("rest", nargs="*", help="CONFIG [key=value ...]")


def main(args: argparse.Namespace) -> int:
    """`difrl check`: the report on stdout; exit status 1 when there is a problem, else 0."""
    configs = [a for a in args.rest if "=" not in a]
    if len(configs) != 1:
        raise SystemExit("difrl check: give one config file, then key=value overrides, e.g. difrl check "
                         "configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev --gpus 8")
    if args.gpus is not None and args.gpus < 1:
        raise SystemExit(f"difrl check: --gpus must be >= 1, got {args.gpus}")
    report = check_config(configs[0], [a for a in args.rest if "=" in a], args.gpus)
    print(report.text())
    return 1 if report.problems else 0
