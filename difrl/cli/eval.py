"""`difrl eval`: evaluate a config's model or a run's trained policy (a table, or --json), appended to the run's
eval.json or written to --out.

    difrl eval configs/digits.yaml [key=value ...]                # the config's model
    difrl eval runs/digits [--json]                                # a run's policy: a before/after table (eval.json)
    difrl eval configs/text_arithmetic.yaml --checkpoint runs/text_arithmetic/policy.safetensors
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from difrl.cli.args import load, run_dir_config, split
from difrl.cli.weights import flow_world, is_diffusers, masked_policy

# `difrl eval --preset`: the reward that scores each published protocol's prompt set (its weights via --preset-options)
EVAL_PRESETS = {"ocr": "ocr", "geneval": "geneval", "pickscore": "pickscore", "hpsv2": "hpsv2", "clip_score": "clip_score",
                "aesthetic": "aesthetic"}


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def main(args) -> int:
    import torch

    from difrl.train.scaffold import default_threads

    path, overrides = split(args.rest)
    run, path = run_dir_config(path)
    overrides = list(overrides)
    if args.reference:  # sugar for the config keys, so a finished run can be measured against another reference
        overrides.append(f"eval.fid.reference={args.reference}")
    if args.preset:  # a published protocol's prompt set (a local file) scored by its reward, as the held-out panel
        overrides.append("eval.rewards=" + json.dumps({EVAL_PRESETS[args.preset]: _preset_options(args)}))
    cfg = load(path, overrides)
    if cfg.trainer == "masked" and cfg.model.kind == "hf_masked":
        # text tasks report pass@k and greedy accuracy in their own evaluation: the flags set its config keys
        flags = {"--pass-k": (args.pass_k, f"eval.pass_k=[{args.pass_k}]"),
                 "--samples": (args.samples, f"eval.samples={args.samples}"),
                 "--temperature": (args.temperature, f"sampler.temperature={args.temperature}"),
                 "--problems": (args.problems, f"eval.count={args.problems}")}
        overrides += [o for v, o in flags.values() if v is not None]
        cfg = load(path, overrides)
        args.pass_k = args.samples = args.temperature = args.problems = None
    if args.prompts:
        if cfg.trainer == "masked" or not is_diffusers(cfg.model.kind):
            raise ValueError("--prompts is for diffusers models (the bundled worlds have their own evaluation sets)")
        cfg.model.eval_prompt_file = args.prompts
    torch.set_num_threads(cfg.threads or default_threads())
    if cfg.trainer == "masked":  # Sudoku, digit tokens, text tasks: the masked world's eval
        world, policy, weights = masked_policy(cfg, run, args.checkpoint)
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
    world, trained = flow_world(cfg, run, args.checkpoint)
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
    diffusers = is_diffusers(cfg.model.kind)
    metrics = {**metrics, "policy": str(trained or cfg.model.path or "bundled base"),
               "eval_prompts": cfg.model.eval_prompt_file or cfg.model.eval_prompts,
               "resolution": [cfg.model.height, cfg.model.width] if diffusers else None}
    _write_eval(run, args, metrics, cfg, world)
    return 0


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
    from difrl.train.run.rundir import same_settings
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
