"""`difrl export RUN_DIR`: a run's checkpoint as the plain files a finished run writes, on one process.

    difrl export runs/flux [--iteration N] [--out DIR]    # default DIR: RUN_DIR/export/iter-NNNNNN

A run that died (or is still running) has checkpoints but no final weights; a sharded checkpoint
(train.checkpoint_format: sharded, the default under FSDP: difrl.train.run.sharded_state) is DCP's shard files,
which nothing outside torch reads. This rebuilds the trained network as the trainer did (the run's config.yaml:
model, LoRA, fp32 masters), loads the checkpoint's weights into it in full (the EMA's when the run keeps one, as
the trainer's final save does) and writes what the trainer writes at the end, in the dtypes the model was loaded
in: a diffusers model's `transformer/` (full fine-tuning: FluxTransformer2DModel.from_pretrained) or `lora/`
(pipe.load_lora_weights), a bundled world's `policy.safetensors` (LoRA merged; the masked trainer's LoRA also as
peft's `lora/`): the trainers' own final save, difrl/train/final_save.py. Gathered checkpoints export the same
way. Memory: the model and one copy of its weights.
"""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_weights(ckpt, ema: bool) -> dict[str, torch.Tensor]:
    """The full trained weights of a checkpoint (difrl.train.run.state.Checkpoint), the EMA's when `ema`."""
    from difrl.train.run.sharded_state import read_sharded

    if ckpt.metadata is None:  # gathered
        weights = ckpt.ema if ema else ckpt.trainable
        if weights is None:
            raise ValueError(f"checkpoint {ckpt.path} has no EMA weights but the run's train.ema_decay > 0")
        return weights
    prefix = "ema/" if ema else "trainable/"
    weights = {k[len(prefix):]: v for k, v in read_sharded(ckpt.path, prefix).items()}
    if not weights:
        raise ValueError(f"checkpoint {ckpt.path} holds no {prefix[:-1]} weights")
    return weights


def export(run_dir, iteration: int | None = None, out=None, log=print) -> Path:
    """Write checkpoint `iteration` (default: the newest intact one) of `run_dir` as final weights into `out`;
    returns `out`. Every file is checked against the checkpoint's manifest first."""
    from difrl.train.final_save import save_final
    from difrl.train.precision import upcast_masters
    from difrl.train.recipes import load_train_config
    from difrl.train.run.rundir import checkpoint_iterations
    from difrl.train.run.state import (CheckpointError, _load_checkpoint, load_latest_checkpoint, trainable_params,
                                   verify_manifest)
    from difrl.train.scaffold import wrap_policy

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a difrl run directory (no config.yaml)")
    cfg = load_train_config(run_dir / "config.yaml")
    if iteration is None:
        ckpt = load_latest_checkpoint(run_dir, log)
        if ckpt is None:
            raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no checkpoint (the run stopped before its first)")
    else:
        path = run_dir / "checkpoints" / f"iter-{iteration:06d}"
        if not path.is_dir():  # say which it kept (a run keeps its two newest: difrl.train.run.state.publish)
            kept = checkpoint_iterations(run_dir)
            raise FileNotFoundError(
                f"no checkpoint {path}: "
                + (f"{run_dir} kept the checkpoints of iteration{'s' * (len(kept) > 1)} {', '.join(map(str, kept))} "
                   f"(give one of them to --iteration, or leave --iteration out for the newest intact one)" if kept
                   else f"{run_dir / 'checkpoints'} holds no checkpoint (the run stopped before its first)"))
        verify_manifest(path)
        ckpt = _load_checkpoint(path)
    out = Path(out) if out else run_dir / "export" / ckpt.path.name
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty: export into a new directory")

    # the trained network as the trainer builds it (difrl.train.flow.trainer / masked: wrap_policy, upcast_masters)
    if cfg.trainer == "masked":
        from difrl.worlds import build_masked_world

        world = build_masked_world(cfg)
    else:
        from difrl.worlds import build_world

        world = build_world(cfg.model.kind, cfg.model.path, cfg)
    policy = world.policy
    net, _ = wrap_policy(policy, cfg.train.lora, cfg.seed, need_reference=False)
    masters = upcast_masters(policy, net)
    policy.module = net
    params = trainable_params(net)
    ema = getattr(cfg.train, "ema_decay", 0.0) > 0
    weights = checkpoint_weights(ckpt, ema)
    if set(weights) != set(params):
        extra, missing = sorted(set(weights) - set(params)), sorted(set(params) - set(weights))
        raise CheckpointError(f"checkpoint {ckpt.path} does not match the run's model ({cfg.model.kind}, "
                              f"{cfg.model.path}): unexpected {extra[:4]}, missing {missing[:4]}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k])
    out.mkdir(parents=True, exist_ok=True)
    save_final(world, policy, net, cfg.train.lora.enabled, out, masters)  # the files the trainers' finish writes
    log(f"difrl export: {ckpt.path} (iteration {ckpt.iteration}, {'EMA' if ema else 'trained'} weights) -> "
        f"{', '.join(str(p) for p in sorted(out.iterdir()))}")
    return out
