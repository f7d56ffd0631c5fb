"""`difrl sample`: samples per prompt of a config's model or a run's trained policy, scored by a reward: the base
sampler, best-of-N, DTS or DTS* at an NFE budget (flow worlds); the training sampler (masked worlds).

    difrl sample configs/digits.yaml --search dts-star --budget 160 [--prompt "a handwritten 3"] [--grid g.png]
    difrl sample runs/digits --grid g.png                          # a finished run's policy (any world)
    difrl sample configs/flux_tiny.yaml --checkpoint runs/flux_tiny/lora   # a LoRA on the config's pipeline
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from difrl.cli.args import load, run_dir_config, split
from difrl.cli.weights import flow_world, masked_policy


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def main(args) -> int:
    """Samples per prompt of a config's model or a run's trained policy: the base sampler (none), best-of-N, DTS or
    DTS* at an NFE budget (flow worlds); the training sampler (masked worlds)."""
    import torch

    from difrl.rewards import build_reward, reward_key
    from difrl.search import SearchConfig, best_of_n, dts

    from difrl.train.scaffold import default_threads

    for flag, value in (("--budget", args.budget), ("--samples", args.samples), ("--children", args.children),
                        ("--root-children", args.root_children)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not args.lam > 0:
        raise ValueError(f"--lam must be positive (the inverse temperature of p(x) exp(lam r(x))), got {args.lam}")
    path, overrides = split(args.rest)
    run, path = run_dir_config(path)
    cfg = load(path, overrides)
    torch.set_num_threads(cfg.threads or default_threads())
    if cfg.trainer == "masked":
        return _sample_masked(args, cfg, run)
    world, trained = flow_world(cfg, run, args.checkpoint)
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
    world, policy, weights = masked_policy(cfg, run, args.checkpoint)
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
