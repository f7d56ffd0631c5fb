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
(difrl.train.interrupt). Known third-party start-up noise is left out (difrl.utils.quiet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# `key=value`'s value, and `difrl train resume=R [CONFIG] [key=value ...]`'s config: shared with the entry scripts
from difrl.train.entry import given as _given
from difrl.train.entry import load_resume_config


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
    """The typed config of the trainer that model.kind names (a FlowConfig or a MaskedConfig)."""
    from difrl.train.recipes import load_train_config

    return load_train_config(path, overrides)


def _run_dir_config(path: str | None) -> tuple[Path | None, str | None]:
    """A run directory stands for its config.yaml (and its trained policy): (run dir or None, config path)."""
    if path and Path(path).is_dir():
        run = Path(path)
        if not (run / "config.yaml").exists():
            raise FileNotFoundError(f"{run} is not a difrl run directory (no config.yaml)")
        return run, str(run / "config.yaml")
    return None, path


def cmd_train(args) -> int:
    from difrl.train.check import checked_config
    from difrl.train.interrupt import Interrupted, stop_on_signals
    from difrl.train.recipes import train_function

    path, overrides = _split(args.rest)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun / accelerate launch, one process reports
    resume = _given(overrides, "resume")
    if path is None and not resume:
        raise SystemExit("difrl train: give a config file, e.g. difrl train configs/digits.yaml (or resume=RUN_DIR)")
    # SIGINT / SIGTERM: a checkpoint, one line with the command that continues the run as it was launched (the
    # launcher and its options kept, `train resume=RUN_DIR` as the arguments), exit 130 / 143 (difrl.train.interrupt)
    with stop_on_signals(program=("train",), argv=args.argv):
        # resume=: the run's own config.yaml; a change of anything but the safe keys is refused (difrl.train.rundir),
        # and the run directory is the resumed one: --out or out= naming another is refused there too
        # every problem of the config at once, before anything loads (difrl.train.check, as `difrl check` says them)
        cfg = checked_config(path, overrides, load_resume_config(path, overrides) if resume else None)
        out = args.out or (_given(overrides, "out") if resume else None)
        try:
            summary = train_function(cfg)(cfg, out_dir=out, overwrite=args.overwrite)
        except Interrupted as e:
            if main_process:
                print(f"difrl: {e}", file=sys.stderr)
            return e.code
    if not main_process:
        return 0
    before, after = summary["eval_before"], summary["eval_after"]
    run = Path(summary["run_dir"])
    print(f"\ndifrl: {summary['iterations']} iterations" + (f", stopped early: {summary['stopped_early']}" if summary["stopped_early"] else ""))
    # the digits world's accuracy, judge, FD and diversity, or the world's headline metrics, then named rewards
    keys = [k for k in ("accuracy", "judge_accuracy", "motion_accuracy", "judge_motion_accuracy", "fd", "diversity")
            if k in after]
    keys += [k for k in summary["headline"] if k not in keys]
    keys += [k for k, v in after.items() if k.startswith("reward/") and isinstance(v, (int, float))]
    width = max(16, *(len(k) + 2 for k in keys))
    print(f"{'':<{width}}{'before':>10}{'after':>10}")
    for key in keys:
        print(f"{key:<{width}}{before[key]:>10.3f}{after[key]:>10.3f}")
    if "real_diversity" in after:
        print(f"real data diversity {after['real_diversity']:.3f}; FD features: {after['fd_extractor']}")
    from difrl.train.scaffold import run_files

    print(run_files(run))
    return 0


# `difrl eval --preset`: the reward that scores each published protocol's prompt set (its weights via --preset-options)
EVAL_PRESETS = {"ocr": "ocr", "geneval": "geneval", "pickscore": "pickscore", "hpsv2": "hpsv2", "clip_score": "clip_score",
                "aesthetic": "aesthetic"}


def cmd_eval(args) -> int:
    import torch

    from difrl.train.scaffold import cores_available

    path, overrides = _split(args.rest)
    run, path = _run_dir_config(path)
    overrides = list(overrides)
    if args.reference:  # sugar for the config keys, so a finished run can be measured against another reference
        overrides.append(f"eval.fid.reference={args.reference}")
    if args.preset:  # a published protocol's prompt set (a local file) scored by its reward, as the held-out panel
        overrides.append("eval.rewards=" + json.dumps({EVAL_PRESETS[args.preset]: _preset_options(args)}))
    cfg = _load(path, overrides)
    if cfg.trainer == "masked" and cfg.model.kind == "hf_masked":
        # text tasks report pass@k and greedy accuracy in their own evaluation: the flags set its config keys
        flags = {"--pass-k": (args.pass_k, f"eval.pass_k=[{args.pass_k}]"),
                 "--samples": (args.samples, f"eval.samples={args.samples}"),
                 "--temperature": (args.temperature, f"sampler.temperature={args.temperature}"),
                 "--problems": (args.problems, f"eval.count={args.problems}")}
        overrides += [o for v, o in flags.values() if v is not None]
        cfg = _load(path, overrides)
        args.pass_k = args.samples = args.temperature = args.problems = None
    if args.prompts:
        if cfg.trainer == "masked" or not _diffusers(cfg.model.kind):
            raise ValueError("--prompts is for diffusers models (the bundled worlds have their own evaluation sets)")
        cfg.model.eval_prompt_file = args.prompts
    torch.set_num_threads(cfg.threads or cores_available())
    if cfg.trainer == "masked":  # Sudoku, digit tokens, text tasks: the masked world's eval
        world, policy, weights = _masked_policy(cfg, run, args.checkpoint)
        if args.grid and world.save_samples is None:  # refused before the evaluation runs
            raise ValueError(f"--grid: the {cfg.model.kind} world's samples are not pictures (difrl sample prints them)")
        metrics = world.evaluate(policy)
        if args.pass_k:  # pass@k over --samples draws per problem with the training sampler (difrl.eval.passk)
            from difrl.eval.passk import masked_pass_at_k

            if world.verifier is None:  # hf_masked's own evaluation is pass@k (eval.pass_k): it needs no flag
                raise ValueError(f"--pass-k needs a world with a verifier (model.kind=sudoku; hf_masked reports "
                                 f"pass@k in its evaluation), not {cfg.model.kind!r}")
            try:
                ks = [int(k) for k in args.pass_k.split(",") if k.strip()]
            except ValueError:
                raise ValueError(f"--pass-k takes comma-separated integers such as 1,8, got {args.pass_k!r}") from None
            temperature = cfg.sampler.temperature if args.temperature is None else args.temperature
            res = masked_pass_at_k(world, policy, cfg.sampler.kind, cfg.sampler.sampler_kwargs(),
                                   8 if args.samples is None else args.samples, ks,
                                   temperature, cfg.eval.seed, args.problems, per_problem=False)
            metrics["pass_at_k"] = res
        elif args.samples is not None or args.temperature is not None or args.problems is not None:
            raise ValueError("--samples, --temperature and --problems go with --pass-k")
        if cfg.model.kind == "hf_masked":
            metrics |= {"temperature": cfg.sampler.temperature, "seed": cfg.eval.seed}
        if args.grid:
            world.save_samples(policy, Path(args.grid))
            metrics["grid"] = args.grid
        _write_eval(run, args, {**metrics, "policy": str(weights or cfg.model.path or "bundled base")}, cfg, world)
        return 0
    if args.pass_k:
        raise ValueError("--pass-k is for masked worlds with a verifier (model.kind=sudoku or hf_masked)")
    world, trained = _flow_world(cfg, run, args.checkpoint)
    try:
        metrics, images = world.evaluate(world.policy, cfg.eval.per_digit, cfg.eval.num_steps, cfg.eval.seed,
                                         cfg.sampler.shift)
    except ValueError as e:
        if not args.preset:
            raise
        raise ValueError(_preset_hint(args, str(e))) from e
    if args.grid:  # a video world writes a GIF beside the name
        world.save_grid(images, Path(args.grid))
        metrics["grid"] = str(Path(args.grid).with_suffix(".gif") if images.ndim == 5 else Path(args.grid))
    diffusers = _diffusers(cfg.model.kind)
    metrics = {**metrics, "policy": str(trained or cfg.model.path or "bundled base"),
               "eval_prompts": cfg.model.eval_prompt_file or cfg.model.eval_prompts,
               "resolution": [cfg.model.height, cfg.model.width] if diffusers else None}
    _write_eval(run, args, metrics, cfg, world)
    return 0


def _diffusers(kind: str) -> bool:
    """A diffusers model kind (its trained weights are a run's lora/ or transformer/), not a bundled world (whose
    trained policy is one policy.safetensors file)."""
    from difrl.models.adapters import model_kinds

    return kind in model_kinds()  # a registered family's too (an entry point's name: nothing imported)


def _trained_weights(run: Path | None, checkpoint: str | None, kind: str) -> Path | None:
    """What `difrl eval` / `difrl sample` load: --checkpoint, else a run's trained weights, else None (the config's
    model). A bundled world (digits, moving digits, the masked worlds, text dLLMs) is one policy.safetensors file
    (a LoRA run's merged too); a diffusers model is a run's lora/ or, after a full fine-tune, its transformer/
    (a file inside one stands for its directory). A --checkpoint that is a run directory means its weights."""
    diffusers = _diffusers(kind)
    names = ("lora", "transformer") if diffusers else ("policy.safetensors",)
    what = ("a run's lora/ or, after a full fine-tune, its transformer/ directory" if diffusers
            else "a run's policy.safetensors file")
    if checkpoint:
        p = Path(checkpoint)
        if p.is_dir() and (p / "config.yaml").is_file():  # a run directory: its trained weights
            return _trained_weights(p, None, kind)
        if diffusers and p.is_file():  # e.g. lora/pytorch_lora_weights.safetensors: the directory is the checkpoint
            p = p.parent
        if not p.exists():
            raise FileNotFoundError(f"--checkpoint {p}: no trained policy there (model.kind={kind} takes {what})")
        if p.is_dir() != diffusers:
            raise FileNotFoundError(f"--checkpoint {p}: not {'a directory' if diffusers else 'a file'}: model.kind="
                                    f"{kind} takes {what}")
        return p
    if run is None:
        return None
    found = [run / f for f in names if (run / f).exists()]
    if not found:
        raise FileNotFoundError(f"{run} holds no trained weights ({' or '.join(n + '/' if diffusers else n for n in names)}"
                                "): did the run finish? (an interrupted run continues with resume=RUN_DIR)")
    return found[0]


def _flow_world(cfg, run: Path | None, checkpoint: str | None):
    """(the flow world of `cfg` with the trained weights on its policy, the weights' path or None): a bundled world
    loads its policy.safetensors as the model; a diffusers model loads its base (model.path), then the LoRA or the
    full fine-tune's transformer on it."""
    from difrl.worlds import build_world

    trained = _trained_weights(run, checkpoint, cfg.model.kind)
    diffusers = _diffusers(cfg.model.kind)
    world = build_world(cfg.model.kind, cfg.model.path if diffusers or trained is None else str(trained), cfg)
    if trained is not None and diffusers:
        from difrl.models.lora_io import load_lora, load_transformer

        (load_transformer if (trained / "config.json").is_file() else load_lora)(world.policy, trained)
    return world, trained


def _masked_policy(cfg, run: Path | None, checkpoint: str | None):
    """(the masked world of `cfg`, its policy with the trained weights, their path or None)."""
    from difrl.worlds import build_masked_world

    weights = _trained_weights(run, checkpoint, cfg.model.kind)
    world = build_masked_world(cfg)
    return world, world.policy if weights is None else world.load_policy(str(weights)), weights


def _preset_options(args) -> dict:
    """--preset-options as a dict, checked before anything is loaded: a preset that needs weights or a detector
    refuses here, not after sampling."""
    if not args.prompts:
        raise ValueError(f"--preset {args.preset} needs --prompts: the protocol's prompt file (e.g. Flow-GRPO's "
                         "ocr/test.txt, GenEval's evaluation_metadata.jsonl), a local file")
    try:
        options = json.loads(args.preset_options or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--preset-options is not JSON: {e}") from e
    if not isinstance(options, dict):
        raise ValueError(f"--preset-options must be a JSON object of the reward's options, got {args.preset_options!r}")
    if args.preset == "geneval" and "detector" not in options:  # never the test-only default silently
        raise ValueError("--preset geneval needs an object detector: --preset-options '{\"detector\": \"torchvision\", "
                         "\"detector_weights\": \"/w/maskrcnn.pth\"}' or '{\"detector\": \"mymodule:detect\"}' (the "
                         "reward's default, 'synthetic', reads detections from test metadata, not from the images; "
                         "name it to use it)")
    return options


def _preset_hint(args, message: str) -> str:
    """A preset's reward names its options as config keys (reward.options.NAME.OPTION); with --preset the user
    passes them as --preset-options."""
    if not args.preset:
        return message
    import re

    name = EVAL_PRESETS[args.preset]
    return re.sub(rf"(?:reward|eval\.rewards)\.(?:options\.)?{name}\.(\w+)",
                  lambda m: f"--preset-options '{{\"{m.group(1)}\": ...}}'", message)


def _write_eval(run: Path | None, args, metrics: dict, cfg, world) -> None:
    """Print the evaluation (a table, beside the run's own before when it measured the same: difrl.report.text;
    --json: the JSON); write it to --out, or append it to a run directory's eval.json (tag "difrl-eval", every
    call kept). A metric that is not a number (NaN, e.g. a diversity of one sample) is written as null."""
    from difrl.report.text import eval_text
    from difrl.train.rundir import same_settings
    from difrl.utils.io import atomic_write_text, json_safe

    out, metrics = args.out, json_safe(metrics)
    text = json.dumps(metrics, indent=2, default=str, allow_nan=False)
    if out:  # written before printing: a closed pipe (| head) must not lose the evaluation
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text + "\n")
    elif run is not None:
        from difrl.train.scaffold import record_eval

        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        # the parsed text: what default=str made of a value JSON has no type for (a path, a dtype) is what is stored
        record_eval(run, "difrl-eval", int(summary.get("iterations", 0)), json.loads(text), keep_earlier=True)
    print(text if args.json else eval_text(json.loads(text), run, run is not None and same_settings(cfg, run),
                                           world.headline))


def cmd_sample(args) -> int:
    """Samples per prompt of a config's model or a run's trained policy: the base sampler (none), best-of-N, DTS or
    DTS* at an NFE budget (flow worlds); the training sampler (masked worlds)."""
    import torch

    from difrl.rewards import build_reward, reward_key
    from difrl.search import SearchConfig, best_of_n, dts

    from difrl.train.scaffold import cores_available

    for flag, value in (("--budget", args.budget), ("--samples", args.samples), ("--children", args.children),
                        ("--root-children", args.root_children)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not args.lam > 0:
        raise ValueError(f"--lam must be positive (the inverse temperature of p(x) exp(lam r(x))), got {args.lam}")
    path, overrides = _split(args.rest)
    run, path = _run_dir_config(path)
    cfg = _load(path, overrides)
    torch.set_num_threads(cfg.threads or cores_available())
    if cfg.trainer == "masked":
        return _sample_masked(args, cfg, run)
    world, trained = _flow_world(cfg, run, args.checkpoint)
    policy = world.policy
    name = args.reward or next(iter(cfg.reward.weights or {world.default_reward: 1.0}))
    reward = build_reward(name, **cfg.reward.options.get(name, {}))
    key = reward_key(name)
    prompts = args.prompt or world.prompts
    meta = {p: world.metadata(world.prompts.index(p)) if p in world.prompts else {} for p in prompts}

    def score(images, prompt):
        return reward(images, [prompt] * len(images), [meta[prompt]] * len(images))[key]

    sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
    N = cfg.sampler.num_steps
    scfg = SearchConfig(budget=args.budget, lam=args.lam, children=args.children, root_children=args.root_children,
                        kernel=cfg.sampler.kind, kernel_kwargs=cfg.sampler.kernel_kwargs(),
                        guidance=cfg.sampler.guidance)
    results, images = [], []
    for i, prompt in enumerate(prompts):
        seed = args.seed * 1000 + i
        if args.search in ("dts", "dts-star"):
            tree = dts(policy, prompt, score, sigmas, scfg, seed=seed, star=args.search == "dts-star")
            x = tree.best[None] if tree.star else tree.samples(args.samples, torch.Generator().manual_seed(seed))[0]
            res = {"nfe": tree.nfe, "leaves": len(tree.leaves), "best_reward": tree.best_reward}
        else:
            n = max(1, args.budget // N) if args.search == "best-of-n" else args.samples
            bon = best_of_n(policy, prompt, score, sigmas, n, seed, scfg)
            x = bon["best"][None] if args.search == "best-of-n" else bon["samples"]
            res = {"nfe": bon["nfe"], "leaves": n, "best_reward": bon["best_reward"]}
        imgs = policy.decode(x).cpu()
        r = score(imgs, prompt)
        results.append({"prompt": prompt, "search": args.search, **res, "reward_mean": float(r.mean()),
                        "samples": len(imgs)})
        images.append(imgs)
    out = {"reward": name, "policy": str(trained or cfg.model.path or "bundled base"), "results": results}
    if args.grid:
        out["grid"] = str(_save_rows(images, Path(args.grid)))
    print(json.dumps(out, indent=2))
    return 0


def _sample_masked(args, cfg, run: Path | None) -> int:
    """`difrl sample` of a masked world: --samples draws per prompt (--prompt, else four training prompts drawn with
    --seed) with the training sampler, scored by the reward; Sudoku grids and text completions are printed, digit
    images go to --grid."""
    import torch

    from difrl.discrete.samplers import SAMPLERS
    from difrl.rewards import build_reward, reward_key, score_all
    from difrl.utils.rng import mix_seed

    kind = cfg.model.kind
    if args.search != "none":
        raise ValueError(f"--search {args.search} searches a flow model's denoising tree; model.kind={kind} is a masked "
                         "world, sampled with its training sampler (--search none)")
    world, policy, weights = _masked_policy(cfg, run, args.checkpoint)
    if args.grid and world.save_samples is None:
        raise ValueError(f"--grid: the {kind} world's samples are not pictures; they are printed as text")
    if args.prompt and world.parse_prompts is None:
        raise ValueError(f"--prompt: the {kind} world takes no prompt typed by hand (a text task's problem needs its "
                         "answer to be scored); it samples its training problems")
    name = args.reward or next(iter(cfg.reward.weights or {world.default_reward: 1.0}))
    reward = build_reward(name, **cfg.reward.options.get(name, {}))
    prompts = world.parse_prompts(args.prompt) if args.prompt else world.prompts(4, args.seed)
    n, P = args.samples, len(prompts)
    batch = prompts.repeat(n)  # sample k belongs to prompt k // n
    seeds = torch.tensor([mix_seed(args.seed, i) for i in range(len(batch))], dtype=torch.int64)
    ids = prompts.ids if prompts.ids is not None else torch.arange(P)
    net = policy.module
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = SAMPLERS[cfg.sampler.kind](policy, batch.tokens, batch.cond, seeds=seeds, **cfg.sampler.sampler_kwargs())
    finally:
        net.train(was_training)
    samples = world.decode(out.tokens)
    scores = score_all({name: reward}, samples, batch.texts, batch.metadata, seeds, ids.repeat_interleave(n))
    r = scores[reward_key(name)].view(P, n)
    nfe = out.nfe_per_sample.float().view(P, n)
    shown = world.show(samples) if world.show is not None else samples if isinstance(samples, list) else None
    results = [{"prompt": prompts.texts[i], "search": "none", "nfe": float(nfe[i].mean()), "reward_mean": float(r[i].mean()),
                "samples": n, **({"texts": shown[i * n:(i + 1) * n]} if shown is not None else {})} for i in range(P)]
    res = {"reward": name, "policy": str(weights or cfg.model.path or "bundled base"), "results": results}
    if args.grid:
        res["grid"] = str(_save_rows(list(samples.split(n)), Path(args.grid)))
    print(json.dumps(res, indent=2))
    return 0


def _save_rows(rows: list, path: Path) -> Path:
    """One row of samples per prompt (shorter rows padded grey): images [n, C, H, W] in [0, 1] as a PNG, videos
    [n, F, C, H, W] as a looping GIF of frame grids beside the name (path.gif). Returns the path written."""
    import torch
    from PIL import Image

    from difrl.worlds.digits import image_grid

    path.parent.mkdir(parents=True, exist_ok=True)
    width = max(len(x) for x in rows)
    grid = torch.cat([torch.cat([x, x.new_full((width - len(x), *x.shape[1:]), 0.5)]) for x in rows]).float()
    scale = max(1, 32 // grid.shape[-2])  # 8x8 digits at 4x, a tiny model's 32 px as they are
    if grid.ndim == 4:
        Image.fromarray(image_grid(grid, nrow=width, scale=scale)).save(path)
        return path
    path = path.with_suffix(".gif")
    frames = [Image.fromarray(image_grid(grid[:, f], nrow=width, scale=scale)) for f in range(grid.shape[1])]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=150, loop=0)
    return path


def cmd_config(args) -> int:
    from difrl.config import config_to_dict, describe_config
    from difrl.train.config import FlowConfig
    from difrl.train.masked_config import MaskedConfig

    path, overrides = _split(args.rest)
    if path is None and not overrides:
        print(describe_config(MaskedConfig if args.masked else FlowConfig))
    else:
        import yaml

        print(yaml.safe_dump(config_to_dict(_load(path, overrides)), sort_keys=False), end="")
    return 0


def cmd_plan(args) -> int:
    from difrl.train.plan_command import main as plan_main

    return plan_main(args, _load)


def cmd_rewards(args) -> int:
    from difrl.rewards import describe_rewards

    print(describe_rewards())
    return 0


def cmd_report(args) -> int:
    from difrl.report import checked_run_dir, write_report

    print(f"report: {write_report(checked_run_dir(args.run_dir))}")
    return 0


def cmd_export(args) -> int:
    from difrl.train.export import export

    export(args.run_dir, args.iteration, args.out)
    return 0


def cmd_reward_server(args) -> int:
    from difrl.rewards.server import main as serve_main

    return serve_main(args)


def main(argv: list[str] | None = None) -> int:
    from difrl.utils.quiet import quiet_third_party

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # difrl never downloads at run time
    quiet_third_party()  # before anything imports transformers / diffusers

    from difrl.config import ConfigError
    from difrl.rewards import RewardError

    ap = argparse.ArgumentParser(prog="difrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="train a policy with GRPO")
    p.add_argument("--out", help="run directory (default: the config's `out`, else runs/flow); with resume=, the "
                                 "same directory or nothing")
    p.add_argument("--overwrite", action="store_true", help="train into a run directory that holds a run: its files "
                                                             "are removed first (without it such a directory is refused)")
    p.add_argument("rest", nargs="*", help="CONFIG [key=value ...], or resume=RUN_DIR [key=value ...] (the run's "
                                           "config.yaml)")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="evaluate a config's model or a run's trained policy")
    p.add_argument("--grid", help="also write a PNG grid of the samples here")
    p.add_argument("--out", help="write the metrics JSON here (default for a RUN_DIR: append to its eval.json)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON (what --out writes), not the table")
    p.add_argument("--checkpoint", help="trained weights on the config's model: a policy.safetensors (digits, masked "
                                        "worlds, text dLLMs), or a diffusers LoRA / full fine-tune transformer "
                                        "directory (default for a RUN_DIR: its policy.safetensors, lora/ or transformer/)")
    p.add_argument("--prompts", help="diffusers models: evaluation prompts, a text or .jsonl file (model.eval_prompts)")
    p.add_argument("--reference", help="diffusers models: reference images or stats for FD / KID (eval.fid.reference)")
    p.add_argument("--preset", choices=sorted(EVAL_PRESETS), help="diffusers models: score --prompts with this "
                   "protocol's reward as the held-out panel (Flow-GRPO OCR / PickScore sets, GenEval metadata); the "
                   "sampler settings stay the run's eval.*")
    p.add_argument("--preset-options", help="JSON options of the preset's reward, e.g. '{\"model_dir\": \"/w/pick\"}'")
    p.add_argument("--pass-k", help="masked worlds (sudoku, hf_masked text tasks): also report unbiased pass@k for these "
                                    "k, e.g. 1,8 (hf_masked: eval.pass_k)")
    p.add_argument("--samples", type=int, help="--pass-k: samples per problem, n (default 8; hf_masked: eval.samples)")
    p.add_argument("--temperature", type=float, help="--pass-k: sampling temperature (default: the config's "
                                                     "sampler.temperature; 0 with llada/eb = greedy, one sample; "
                                                     "hf_masked: sets sampler.temperature)")
    p.add_argument("--problems", type=int, help="--pass-k: the first N evaluation problems (default: all eval.count; "
                                                "hf_masked: sets eval.count)")
    p.add_argument("rest", nargs="*", help="CONFIG|RUN_DIR [key=value ...]")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("sample", help="sample a config's model or a run's trained policy per prompt: base, best-of-N, "
                                      "DTS or DTS* search")
    p.add_argument("--search", choices=("none", "best-of-n", "dts", "dts-star"), default="none")
    p.add_argument("--budget", type=int, default=160, help="model evaluations per prompt (best-of-n, dts, dts-star)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (none, dts)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: the world's prompts)")
    p.add_argument("--reward", help="the reward searched for (default: the config's first reward)")
    p.add_argument("--lam", type=float, default=1.0, help="DTS inverse temperature: target p(x) exp(lam r(x))")
    p.add_argument("--children", type=int, default=2, help="DTS children per internal node")
    p.add_argument("--root-children", type=int, default=8, help="DTS initial noises")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", help="write a PNG grid (one row per prompt) here; videos: a GIF beside the name")
    p.add_argument("--checkpoint", help="trained weights on the config's model, as for difrl eval: a policy.safetensors, "
                                        "or a diffusers LoRA / full fine-tune transformer directory (default for a "
                                        "RUN_DIR: its policy.safetensors, lora/ or transformer/)")
    p.add_argument("rest", nargs="*", help="CONFIG|RUN_DIR [key=value ...]")
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("config", help="list every config key, or print a resolved config")
    p.add_argument("--masked", action="store_true", help="the masked-diffusion trainer's keys (Sudoku, digit tokens); a "
                                                         "masked CONFIG or model.kind=sudoku selects them too")
    p.add_argument("rest", nargs="*", help="[CONFIG] [key=value ...]")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("check", help="list every problem of a config at once (keys, paths, rewards, the micro-batch "
                                     "plan on --gpus N) without loading a model; exit status 1 if any")
    from difrl.train.check import add_arguments as check_arguments
    from difrl.train.check import main as cmd_check

    check_arguments(p)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("report", help="write RUN_DIR/report.html: config, curves, eval table, samples (self-contained)")
    p.add_argument("run_dir", help="a run directory")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("compare", help="write one HTML page comparing runs: curves overlaid (iterations and seconds), "
                                       "final evaluations with each config's seed spread")
    from difrl.report.compare_page import add_arguments as compare_arguments
    from difrl.report.compare_page import main as cmd_compare

    compare_arguments(p)
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("export", help="write a run's checkpoint (sharded or gathered) as the plain final weights: "
                                      "transformer/, lora/ or policy.safetensors (one process)")
    p.add_argument("run_dir", help="a run directory")
    p.add_argument("--iteration", type=int, help="the checkpoint of this iteration (default: the newest intact one)")
    p.add_argument("--out", help="where to write them (default: RUN_DIR/export/iter-NNNNNN; must be empty)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("plan", help="simulate a flow or masked config at real size on N GPUs (fake tensors, a fake process group, "
                                    "the trainer's own code): memory per GPU by phase and category, collectives, a verdict")
    from difrl.train.plan_command import add_arguments as plan_arguments

    plan_arguments(p)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("rewards", help="list the rewards found by name: built-ins and installed entry points")
    p.set_defaults(fn=cmd_rewards)
    p = sub.add_parser("reward-server", help="serve rewards over HTTP (msgpack) to trainers: reward.weights={remote: 1}")
    p.add_argument("--reward", required=True, help="NAME[,NAME...]: rewards to serve (names as in reward.weights)")
    p.add_argument("--options", help="a YAML file: reward name -> its options (as reward.options)")
    p.add_argument("--options-json", help="the same as a JSON string (merged over --options)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=8765, help="0 = any free port (printed at start)")
    p.add_argument("--token-file", help="bearer token file (else $DIFRL_REWARD_TOKEN; none = no auth, loopback only)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="request body limit (413 beyond)")
    p.add_argument("--max-items", type=int, default=512, help="items per request (413 beyond)")
    p.add_argument("--max-pixels", type=int, default=4096 * 4096, help="pixels per item, frames together (413 beyond)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight (503 + Retry-After beyond)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request, queueing included (504 beyond)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for other requests' items")
    p.add_argument("--threads", type=int, help="torch CPU threads of the inference thread (default: torch's)")
    p.set_defaults(fn=cmd_reward_server)
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


if __name__ == "__main__":
    sys.exit(main())
