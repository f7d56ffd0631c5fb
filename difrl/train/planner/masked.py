"""difrl plan for the masked trainer (difrl/train/masked/trainer.py): LLaDA-8B and the text world at real size.

    difrl plan configs/text_arithmetic.yaml model.path=/models/LLaDA-8B-Instruct --gpus 1 8 16 --gpu-memory 80

The same simulated cluster and row schema as the flow plan (difrl/train/planner/flow.py, which dispatches a MaskedConfig
here); what differs is the trainer's phases and the host code of the masked samplers (simulation.simulated_device's
`host()` / `device()`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from difrl.train.planner.flow import MICRO_STEPS, NOT_SIMULATED, plan_row  # noqa: F401
from difrl.train.planner.simulation import (Collectives, Memory, device_metrics, fake_parameter_swaps, module_bytes,
                                    peak_tracker, plain_tracker, resident_tensors, simulated_device, simulated_processes,
                                    steady_optimizer_state)


def resolve_masked_arch(cfg, arch: str | None) -> tuple[Path, str]:
    """The masked LM simulated: `--arch`, else model.path when it is a local transformers directory (its config.json
    and tokenizer, no weights read), the bundled tiny MLM when model.path is null (the text world's own base), else
    LLaDA-8B's shapes (difrl/assets/arch/llada-8b)."""
    from difrl.discrete.tiny_mlm import BUNDLED_DIR
    from difrl.models.arch import REFERENCE_ARCH, arch_dir

    if cfg.model.kind != "hf_masked":
        raise ValueError(f"difrl plan simulates the masked trainer on transformers masked LMs (model.kind=hf_masked); "
                         f"model.kind={cfg.model.kind} is a tiny bundled world with nothing to plan")
    if arch is not None:
        return arch_dir(arch), arch
    if cfg.model.path is None:
        return BUNDLED_DIR, "text_mlm_base"
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return path, str(path)
    return arch_dir(REFERENCE_ARCH["hf_masked"]), REFERENCE_ARCH["hf_masked"]


def arch_masked_policy(path: Path, dtype: str, gradient_checkpointing: bool):
    """An HFMaskedLM of the directory's config.json on fake tensors (difrl.models.arch.build_arch_lm), in model.dtype
    (auto: bf16, what a GPU with bf16 loads), with the directory's tokenizer, else the code-built character tokenizer
    of the bundled MLM (difrl.discrete.tiny_mlm: the prompts' token count is not LLaDA's, the answer's is); mask id
    and vocabulary from the config."""
    import transformers

    from difrl.discrete.policy import HFMaskedLM
    from difrl.discrete.tiny_mlm import build_char_tokenizer
    from difrl.models.arch import build_arch_lm
    from difrl.models.diffusers_base import as_dtype

    model, config = build_arch_lm(path, as_dtype("bf16" if dtype == "auto" else dtype))
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        tokenizer = build_char_tokenizer()
    if gradient_checkpointing:  # as the text world enables it (difrl.worlds.text_tasks.load_text_policy)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mask_id = config.get("mask_token_id", tokenizer.mask_token_id)
    return HFMaskedLM(model, mask_id, model.get_output_embeddings().weight.shape[0], tokenizer)


def device_code(mode, policy, accelerator, optimizer) -> None:
    """Mark the device code of a masked iteration for the simulated device (simulation.simulated_device): the policy's
    forwards, the backward and the optimizer step, called from host code (the sampler, the re-masks, the update's
    bookkeeping), which plan_masked runs under mode.host()."""
    for obj, name in ((policy, "logits"), (accelerator, "backward"), (optimizer, "step")):
        fn = getattr(obj, name)

        def on_device(*args, fn=fn, **kwargs):
            with mode.device():
                return fn(*args, **kwargs)

        setattr(obj, name, on_device)


def label_unsharded(tracker, net) -> None:
    """FSDPMemTracker labels a unit's unsharded parameters in the unit's pre-forward hook; rollout_forwards gathers
    every unit before any forward, outside those hooks, where the tracker counts them as activations. Relabelled here,
    in the tracker's current snapshot and in its peak so far (the gathering's, where they were all held already)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    act, unsharded = _FSDPRefType.ACT, _FSDPRefType.UNSHARDED_PARAM
    before = {dev: snap[unsharded] for dev, snap in tracker.get_tracker_snapshot().items()}
    for m in net.modules():
        group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
        for p in group.fsdp_params if group is not None else ():
            tracker._update_and_maybe_create_winfos(p.unsharded_param, unsharded, update_existing=True)
    for dev, snap in tracker.get_tracker_snapshot().items():
        peak = tracker._peak_mem_snap.get(dev)  # torch 2.14.1's MemTracker (Memory.restart_peak reads it too)
        if peak is not None:
            moved = min(snap[unsharded] - before[dev], peak[act])
            peak[act], peak[unsharded] = peak[act] - moved, peak[unsharded] + moved


def plan_masked(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None,
                micro_steps: int = MICRO_STEPS, config_name: str = "") -> dict:
    """One row of the masked trainer (difrl.train.masked.trainer) on `gpus` simulated GPUs, in plan_row's schema.

    setup: the text world around the architecture (difrl.worlds.text_tasks.masked_world), masked_plan.plan_masked_iteration, and
    masked.setup_training (LoRA or fp32 masters and the KL reference, FSDP2, AdamW). rollout: the configured sampler
    over the process's samples (the trainer samples them in one batch), inside masked_plan.rollout_forwards as the
    trainer runs it. update: masked.old_log_probs (the old policy's and the reference's log-probs of every inner
    update) and masked.policy_update with its first micro-step and its last (`micro_steps`); the others are counted.
    A sampler decides what to commit from the values it draws, which the simulation does not have: the drawn tokens
    and confidences are zeros (simulated_device), so LLaDA's and MDLM's samplers run their configured forwards (their
    counts do not depend on the values) over the same shapes; EB-Sampler's count does, and is refused."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp import FSDPModule

    from difrl.discrete.samplers import SAMPLERS
    from difrl.train.dist.sharding import fsdp_settings
    from difrl.train.masked.plan import plan_masked_iteration, rollout_forwards
    from difrl.train.masked.trainer import old_log_probs, policy_update, setup_training
    from difrl.utils.rng import mix_seed
    from difrl.worlds.text_tasks import masked_world

    path, arch_name = resolve_masked_arch(cfg, arch)
    if cfg.sampler.kind == "eb" or cfg.external.source != "none":
        raise ValueError("difrl plan simulates the llada and emerge samplers without external rollouts: EB-Sampler's "
                         "forwards depend on the values it draws (sampler.kind=eb), and so do the external ones")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, ratio_check=False))
    DeviceMetrics = device_metrics()
    t0 = time.perf_counter()
    memory, collectives, mode = Memory(), Collectives(), simulated_device()
    with simulated_processes(gpus) as accelerator, collectives, fake_parameter_swaps(), mode:
        # ================================================================ setup
        setup_tracker = plain_tracker()
        with setup_tracker:
            policy = arch_masked_policy(path, cfg.model.dtype, cfg.model.gradient_checkpointing)
            with unset_fake_temporarily():  # the prompts and the split are the host's
                world = masked_world(cfg, policy=policy)
                split = plan_masked_iteration(cfg, gpus, 0)
            trainee = setup_training(cfg, policy, accelerator, fsdp_settings(accelerator))
        memory.record("setup", setup_tracker, Memory.PLAIN, {})
        steady_optimizer_state(trainee.optimizer, trainee.params)
        resident = {"reference": module_bytes(trainee.reference)}
        if isinstance(trainee.net, FSDPModule):
            tracker, names = peak_tracker(trainee.net, trainee.optimizer), Memory.FSDP
        else:
            tracker, names = plain_tracker(trainee.net), Memory.PLAIN
            tracker.track_external(trainee.net, trainee.optimizer)
        tracker.ignore_resident(resident_tensors(trainee.reference))  # counted once, in `resident`
        device_code(mode, policy, accelerator, trainee.optimizer)
        with unset_fake_temporarily():  # iteration 0's prompts and seeds, as the trainer draws them
            P, G = cfg.rollout.prompts_per_iter, cfg.rollout.group_size
            batch = world.prompts(P, mix_seed(cfg.seed, 0, 1)).repeat(G).select(split.rows)
            seeds = torch.tensor([mix_seed(cfg.seed, 0, 0, int(i)) for i in split.rows], dtype=torch.int64)

        with tracker:
            # ============================================================ rollout
            collectives.current = "rollout"
            Memory.restart_peak(tracker)
            trainee.net.eval()
            with rollout_forwards(trainee.net, trainee.fsdp), mode.host():
                if trainee.fsdp is not None:
                    label_unsharded(tracker, trainee.net)
                out = SAMPLERS[cfg.sampler.kind](policy, batch.tokens, batch.cond, seeds=seeds,
                                                 **cfg.sampler.sampler_kwargs())
            memory.record("rollout", tracker, names, resident)

            # ============================================================ update
            collectives.current = "update"
            Memory.restart_peak(tracker)
            with mode.host():
                collectives.current = "old_log_probs"  # once per iteration: not scaled with the micro-steps below
                r = old_log_probs(cfg, policy, trainee, 0, batch, out.tokens, out.gen_mask, seeds)
                collectives.current = "update"
                trainee.net.train()
                S = split.per_proc
                advantages, keep = torch.zeros(S), torch.ones(S, dtype=torch.bool)
                is_weight, is_keep = torch.ones(out.tokens.shape), torch.ones(out.tokens.shape, dtype=torch.bool)
                policy_update(cfg, policy, trainee, accelerator, split, r, advantages, keep, is_weight, is_keep, 0,
                              DeviceMetrics(), max_micro_steps=micro_steps)
            memory.record("update", tracker, names, resident)
            total_micro = cfg.train.inner_updates * split.updates * cfg.train.grad_accum
            collectives.scale("update", total_micro / min(micro_steps, total_micro))
            for kind, (count, nbytes) in collectives.by_phase.pop("old_log_probs", {}).items():
                counted = collectives.by_phase.setdefault("update", {}).setdefault(kind, [0, 0])
                counted[0], counted[1] = counted[0] + count, counted[1] + nbytes
    seconds = time.perf_counter() - t0
    row = plan_row(cfg, config_name, arch_name, gpus, gpu_memory_gib, memory, collectives, split.micro, S, seconds)
    row.update({"trainer": "masked", "seq_len": int(out.tokens.shape[1]), "rollout_forwards": out.nfe,
                "micro_steps": total_micro})
    row["not_simulated"] = [*NOT_SIMULATED, ("the sampler's drawn values (zeros: LLaDA / MDLM forward counts do not "
                                             "depend on them)")]
    return row


