"""The trained policy `difrl eval` and `difrl sample` load: --checkpoint, else a run directory's trained weights, else
the config's model, on the world the config builds.

    world, trained = flow_world(cfg, run, args.checkpoint)              # flow worlds: trained weights on world.policy
    world, policy, weights = masked_policy(cfg, run, args.checkpoint)   # masked worlds
"""

from __future__ import annotations

from pathlib import Path


def is_diffusers(kind: str) -> bool:
    """A diffusers model kind (its trained weights are a run's lora/ or transformer/), not a bundled world (whose
    trained policy is one policy.safetensors file)."""
    from difrl.models.adapters import model_kinds

    return kind in model_kinds()  # a registered family's too (an entry point's name: nothing imported)


def trained_weights(run: Path | None, checkpoint: str | None, kind: str) -> Path | None:
    """What `difrl eval` / `difrl sample` load: --checkpoint, else a run's trained weights, else None (the config's
    model). A bundled world (digits, moving digits, the masked worlds, text dLLMs) is one policy.safetensors file
    (a LoRA run's merged too); a diffusers model is a run's lora/ or, after a full fine-tune, its transformer/
    (a file inside one stands for its directory). A --checkpoint that is a run directory means its weights."""
    diffusers = is_diffusers(kind)
    names = ("lora", "transformer") if diffusers else ("policy.safetensors",)
    what = ("a run's lora/ or, after a full fine-tune, its transformer/ directory" if diffusers
            else "a run's policy.safetensors file")
    if checkpoint:
        p = Path(checkpoint)
        if p.is_dir() and (p / "config.yaml").is_file():  # a run directory: its trained weights
            return trained_weights(p, None, kind)
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


def flow_world(cfg, run: Path | None, checkpoint: str | None):
    """(the flow world of `cfg` with the trained weights on its policy, the weights' path or None): a bundled world
    loads its policy.safetensors as the model; a diffusers model loads its base (model.path), then the LoRA or the
    full fine-tune's transformer on it."""
    from difrl.worlds import build_world

    trained = trained_weights(run, checkpoint, cfg.model.kind)
    diffusers = is_diffusers(cfg.model.kind)
    world = build_world(cfg.model.kind, cfg.model.path if diffusers or trained is None else str(trained), cfg)
    if trained is not None and diffusers:
        from difrl.models.lora_io import load_lora, load_transformer

        (load_transformer if (trained / "config.json").is_file() else load_lora)(world.policy, trained)
    return world, trained


def masked_policy(cfg, run: Path | None, checkpoint: str | None):
    """(the masked world of `cfg`, its policy with the trained weights, their path or None)."""
    from difrl.worlds import build_masked_world

    weights = trained_weights(run, checkpoint, cfg.model.kind)
    world = build_masked_world(cfg)
    return world, world.policy if weights is None else world.load_policy(str(weights)), weights
