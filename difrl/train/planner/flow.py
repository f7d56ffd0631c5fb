"""Real scale, simulated: `difrl plan` runs the trainer's own setup and one iteration at real size on this machine.

    difrl plan configs/flux_flow_grpo.yaml train.lora.enabled=false train.grad_accum=24 train.kl_beta=0.04 \\
        --gpus 8 --gpu-memory 80 --json plan.json          # FLUX.1-dev full fine-tune on 8 x 80 GiB: does it fit?
    difrl plan configs/wan_dance_grpo.yaml --gpus 1 --arch wan2.1-t2v-14b
    difrl plan configs/text_arithmetic.yaml model.path=/models/LLaDA-8B-Instruct model.gen_length=64 \
        sampler.block_length=32 sampler.steps=32 --gpus 1 8 16 --gpu-memory 80 --json plan.json   # LLaDA-8B full

How. One process plays rank 0 of N: a fake process group (torch.testing._internal.distributed.fake_pg: collectives
return at once with correctly shaped outputs) and FakeTensorMode (tensors carry shape, dtype and device, no storage),
so a 12-billion-parameter pipeline is built from its architecture configs (difrl.models.arch: the shipped reference
checkpoint of the family when model.path is not a local directory, or `--arch`) in seconds and no memory. An
Accelerator is made as `accelerate launch --config_file configs/accelerate/fsdp.yaml` would make it, with accelerate's
FSDP branches taken as on GPUs (difrl.train.dist.sharded_step.take_fsdp_branches). Then the functions `difrl train` calls run
on it, not a replica of them:

- setup: the world around the adapter (difrl.worlds.diffusers.flow_world), difrl.train.flow.plan.plan_flow_iteration (the split and
  micro-batching), difrl.train.flow.trainer.setup_training (LoRA or masters and reference, FSDP2, optimizer, EMA, copy);
- sync (with a rollout copy): difrl.train.flow.rollout_copy.sync_rollout_copy, the copy's refresh before a rollout (one
  all-gather per FSDP unit; its checks' flags read as zeros);
- rollout: difrl.rollout.rollout of one forward batch (sampler.rollout_batch samples, every sampler step, prompts
  encoded), on the copy if there is one, else with the units gathered as rollout.fsdp_gather chooses for
  `--gpu-memory` (difrl.train.dist.unit_gather); the process's other batches are the same computation, so their stored trajectories are that batch's
  repeated (cat_rollouts) to the process's sample count and their forwards are counted, not run;
- update: difrl.train.flow.trainer.training_records (samples, or transitions when the micro-batch splits them), then
  difrl.train.flow.trainer.policy_update over them, with the configured micro-batch and accumulation: its
  first micro-step and the update's last one (which clips, steps AdamW and updates the EMA) run (`MICRO_STEPS`);
  the ones between repeat the first exactly (same shapes, same collectives, gradients already allocated), so their
  collectives are counted, not run. AdamW's moments exist as from the first update on (steady_optimizer_state).

Memory is measured per phase by torch's trackers (torch.distributed._tools: FSDPMemTracker for the sharded network,
which attributes sharded / unsharded parameters and gradients, optimizer state, activations, temporaries and the
all-gather / reduce-scatter buffers; MemTracker for setup and unsharded runs), plus what lives outside the trained
network, measured on the objects themselves: the frozen reference, the EMA / NFT / copy-source shadows, the text
encoders and VAE, the rollout copy. Text encoders offloaded (model.offload_text_encoders) live on "meta", the simulated
host: not resident; the adapter's own moves put them on the simulated device while it embeds (rollout, or setup for
a negative prompt), where the trackers count them on top of what is resident then. Collectives are counted with their bytes as they are called
(torch.distributed and DTensor's functional collectives). What is not simulated, said in every row's `not_simulated`:
reward models (run on the same GPU: add their size), the evaluation, the checkpoint writes, CUDA's caching allocator
and workspaces (fragmentation: keep headroom, `FIT_MARGIN`), NCCL buffers, and kernels' internal scratch.

The masked trainer (difrl.train.masked.trainer; a MaskedConfig, model.kind=hf_masked) is planned the same way by
`plan_masked`: LLaDA-8B's shapes (difrl/assets/arch/llada-8b) when model.path is a placeholder, and its own setup
(masked.setup_training), rollout (the configured sampler over the process's samples, every step's forward, inside
masked_plan.rollout_forwards) and update (masked.old_log_probs, masked.policy_update with its first and last
micro-steps). The sampler's and the update's host bookkeeping runs on the host (simulation's mode.host()); the values
a sampler draws are zeros there (not simulated: LLaDA's and MDLM's forward counts do not depend on them; EB-Sampler's
do, and is refused).

The simulated device is the CPU (fake tensors need no driver; FSDP2 on a fake CUDA device would), so everything the
trainer puts on `accelerator.device` counts as device memory; nothing is on the host in a simulated run, except the
masked trainer's host bookkeeping ([B, L] masks, tokens, confidences: kilobytes, counted all the same).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import difrl
from difrl.train.planner.simulation import (GIB, Collectives, Memory, device_metrics, fake_parameter_swaps, module_bytes,
                                    peak_tracker, plain_tracker, resident_tensors, simulated_device, simulated_processes,
                                    steady_optimizer_state, tensor_bytes)

MICRO_STEPS = 2  # micro-steps of the update that run: the first (accumulating) and the update's last (optimizer step)
FIT_MARGIN = 0.9  # a plan fits when its peak is at most this fraction of the GPU (allocator fragmentation, NCCL, CUDA context)
NOT_SIMULATED = ("reward models", "evaluation", "checkpoint writes", "CUDA allocator fragmentation and context",
                 "NCCL buffers")


# ---------------------------------------------------------------------------------- the plan of a flow run


def resolve_arch(cfg, arch: str | None) -> tuple[Path, str]:
    """The architecture simulated: `--arch`, else model.path when it is a local pipeline directory (its configs,
    no weights read), else the shipped reference checkpoint of model.kind (difrl.models.arch.REFERENCE_ARCH)."""
    from difrl.models.arch import REFERENCE_ARCH, arch_dir

    if arch is not None:
        return arch_dir(arch), arch
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is not None and (path / "model_index.json").is_file():
        return path, str(path)
    if cfg.model.kind not in REFERENCE_ARCH:
        raise ValueError(f"difrl plan simulates the diffusers families ({', '.join(REFERENCE_ARCH)}); model.kind="
                         f"{cfg.model.kind} has no architecture to build (give a local pipeline directory as model.path)")
    return arch_dir(REFERENCE_ARCH[cfg.model.kind]), REFERENCE_ARCH[cfg.model.kind]


# the placeholder prompts of an editing family (its adapter's `source_images`): the shipped edit set, 32x32 square
# sources that the adapter resizes to model.source_size as it resizes a real one (difrl/assets/edit_tiny)
PLACEHOLDER_EDITS = Path(difrl.__file__).resolve().parent / "assets" / "edit_tiny" / "prompts.jsonl"


def plan_config(cfg):
    """The config as the simulation runs it: prompts placeholders when the prompt file is not on this machine (their
    text does not change a shape: the pipelines pad to the text length), and the first-step ratio check off (it reads
    values, which fake tensors do not have). A family whose prompts carry a source image (its adapter's
    `source_images`: Qwen-Image-Edit) gets the shipped edit set as its placeholders (PLACEHOLDER_EDITS), so the
    vision encoder and the source latents run at the size model.source_size gives a square source; an eval prompt
    file not on this machine is dropped (the evaluation is not simulated; its prompts default to the training ones)."""
    from difrl.models.adapters import adapter_class

    mc = cfg.model
    if mc.prompts is None and not (mc.prompt_file and Path(mc.prompt_file).is_file()):
        if adapter_class(mc.kind).source_images:
            mc = dataclasses.replace(mc, prompt_file=str(PLACEHOLDER_EDITS))
        else:
            mc = dataclasses.replace(mc, prompts=[f"prompt {i}" for i in range(cfg.rollout.prompts_per_iter)],
                                     prompt_file=None)
    if getattr(mc, "eval_prompt_file", None) and not Path(mc.eval_prompt_file).is_file():
        mc = dataclasses.replace(mc, eval_prompt_file=None)
    return dataclasses.replace(cfg, model=mc, train=dataclasses.replace(cfg.train, ratio_check=False))


def plan_flow(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None,
              micro_steps: int = MICRO_STEPS, config_name: str = "") -> dict:
    """One row: the per-rank peaks of setup, rollout and update, the categories at the overall peak, collectives per
    phase, and whether it fits `gpu_memory_gib` (None: no verdict)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp import FSDPModule

    from difrl.models.adapters import arch_flow_policy
    from difrl.rollout import cat_rollouts, rollout
    from difrl.train.dist.unit_gather import rollout_gather, units_gathered
    from difrl.train.flow.matching_objectives import trained_sigmas
    from difrl.train.flow.plan import plan_flow_iteration, step_masks
    from difrl.train.flow.rollout_copy import sync_rollout_copy
    from difrl.train.flow.trainer import policy_update, setup_training, training_records
    from difrl.utils.rng import mix_seed
    from difrl.worlds import world_file
    from difrl.worlds.diffusers import policy_options

    if cfg.rollout.kind != "flat":
        raise ValueError(f"difrl plan simulates flat rollouts; rollout.kind={cfg.rollout.kind} is not simulated yet")
    if cfg.train.objective in ("draft", "refl") or cfg.gardo.enabled:
        raise ValueError("difrl plan simulates the rollout -> update iteration; train.objective=draft / refl (reward "
                         "backpropagation's own phase) and gardo.enabled (its reference copy) are not simulated yet")
    path, arch_name = resolve_arch(cfg, arch)  # first: a kind with no architecture is refused by name
    cfg = plan_config(cfg)
    DeviceMetrics = device_metrics()
    t0 = time.perf_counter()
    memory, collectives = Memory(), Collectives()
    with simulated_processes(gpus) as accelerator, collectives, fake_parameter_swaps(), simulated_device() as fake:
        # ================================================================ setup
        setup_tracker = plain_tracker()
        with setup_tracker:
            # offloaded text encoders live on the simulated host, "meta" (Memory skips it), and are moved to the
            # simulated device around each embedding by the adapter's own code, which the trackers then count
            options = {**policy_options(cfg.model.kind, cfg), "device": None, "text_encoders_home": "meta"}
            policy = arch_flow_policy(cfg.model.kind, path, **options)
            world = world_file(cfg.model.kind).flow_world(cfg.model.kind, None, cfg, policy=policy)
            with tempfile.TemporaryDirectory() as tmp, unset_fake_temporarily():
                n_total, per_proc, T, _, micro = plan_flow_iteration(cfg, world, gpus, Path(tmp), lambda *a: None)
                sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
            with fake.zero_reads():  # the rollout copy's first sync reads its flags
                trainee = setup_training(cfg, policy, accelerator)
        memory.record("setup", setup_tracker, Memory.PLAIN, {})
        steady_optimizer_state(trainee.optimizer, trainee.params)
        inside = {id(m) for m in trainee.net.modules()}  # Wan 2.2 A14B: both transformers are in the trained module
        offloaded = {id(c) for c in policy.text_encoders().values()} if policy.text_encoders_home is not None else set()
        frozen = [c for c in policy.pipe.components.values()  # resident on the GPU: not trained, not offloaded
                  if isinstance(c, nn.Module) and id(c) not in inside and id(c) not in offloaded]
        shadows = [e for e in (trainee.ema, trainee.old) if e is not None]
        resident = {"reference": module_bytes(trainee.reference), "frozen": module_bytes(*frozen),
                    "ema": sum(tensor_bytes(e.shadow.values()) for e in shadows)}
        if trainee.rollout_copy is not None:
            resident["rollout_copy"] = module_bytes(getattr(trainee.rollout_copy, "module", None))
        if isinstance(trainee.net, FSDPModule):
            tracker, names = peak_tracker(trainee.net, trainee.optimizer), Memory.FSDP
        else:
            tracker, names = plain_tracker(trainee.net), Memory.PLAIN
            tracker.track_external(trainee.net, trainee.optimizer)
        copy = getattr(trainee.rollout_copy, "module", None)
        tracker.ignore_resident(resident_tensors(*frozen, trainee.reference, copy, shadows=shadows))  # once: `resident`

        # the iteration's host numbers
        with unset_fake_temporarily():  # the iteration's indices and masks are real: the sampler reads them as numbers
            B = min(cfg.sampler.rollout_batch or per_proc, per_proc)  # one forward batch
            k = torch.arange(B)
            seeds = torch.tensor([mix_seed(cfg.seed, 0, 0, int(i)) for i in k])
            sde_mask, train_mask, _ = step_masks(cfg, 0, n_total)
            prompt_ids, group_ids = k // cfg.rollout.group_size, k // cfg.rollout.group_size
        prompts = [world.prompts[int(i) % len(world.prompts)] for i in prompt_ids]
        on_copy = trainee.rollout_copy is not None and cfg.rollout.kind != "solrl"
        with tracker:
            # ============================================================ sync
            # the rollout copy refreshed from the trained weights, as before every rollout (rollout_copy.py); its
            # checks read flags from the device, which read as zeros here (none fires)
            if trainee.rollout_copy is not None:
                collectives.current = "sync"
                Memory.restart_peak(tracker)
                with fake.zero_reads():
                    sync_rollout_copy(trainee.rollout_copy, trainee.copy_source, trainee.unwrapped, 1, 0, 1)
                memory.record("sync", tracker, names, resident)

            # ============================================================ rollout
            collectives.current = "rollout"
            Memory.restart_peak(tracker)
            trainee.unwrapped.eval()
            # FSDP: gather once per rollout or per forward, chosen as the trainer chooses with the GPU's free memory
            held = sum(tracker._peak_mem.values()) + sum(resident.values())  # restart_peak: the current total
            free = None if gpu_memory_gib is None else int(gpu_memory_gib * GIB) - held
            gather = rollout_gather(cfg.rollout.fsdp_gather, trainee.unwrapped, trainee.fsdp, free)
            with trainee.rollout_copy.active(policy) if on_copy else units_gathered(trainee.unwrapped, trainee.fsdp,
                                                                                   gather == "once"):
                part = rollout(policy, prompts, seeds, sigmas, cfg.sampler.kind, cfg.sampler.kernel_kwargs(), sde_mask,
                               train_mask[:B], prompt_ids, group_ids, seeds, cfg.sampler.guidance, batch_size=B)
            batch = cat_rollouts([part] * -(-per_proc // B)) if per_proc > B else part
            memory.record("rollout", tracker, names, resident)
            collectives.scale("rollout", per_proc / B)  # gathered once: once per batch, as the trainer's chunks

            # ============================================================ update
            collectives.current = "update"
            Memory.restart_peak(tracker)
            trainee.unwrapped.train()
            with unset_fake_temporarily():
                advantages, keep = torch.zeros(len(batch)), torch.ones(len(batch), dtype=torch.bool)
            train_sigmas = trained_sigmas(cfg, sigmas)  # NFT's / AWM's / DPO's / DGPO's re-noising sigmas
            batch, advantages, keep, _, T_rec = training_records(batch, advantages, keep, None, micro, T)
            policy_update(cfg, policy, trainee, accelerator, batch, advantages, keep, None, T_rec, micro, 0,
                          DeviceMetrics(cfg.sampler.num_steps), train_sigmas, max_micro_steps=micro_steps)
            memory.record("update", tracker, names, resident)
            ran = min(micro_steps, cfg.train.inner_epochs * -(-len(batch) // micro.records))
            total_micro = cfg.train.inner_epochs * -(-len(batch) // micro.records)
            collectives.scale("update", total_micro / ran)
    seconds = time.perf_counter() - t0
    row = plan_row(cfg, config_name, arch_name, gpus, gpu_memory_gib, memory, collectives, micro.transitions, per_proc,
                   seconds)
    row["rollout_gather"] = "copy" if on_copy else gather
    if on_copy:
        row["not_simulated"].append("the proximal recompute of copy rollouts (no-grad forwards of the trained network)")
    return row


def plan_row(cfg, config_name: str, arch_name: str, gpus: int, gpu_memory_gib, memory: Memory, collectives: Collectives,
             micro_batch: int, per_proc: int, seconds: float) -> dict:
    """The JSON row: identity of the run, the peak phase's categories at top level, every phase's peak."""
    phases = memory.phases
    loop = [p for p in ("sync", "rollout", "update") if p in phases]  # the iteration's phases (sync: a rollout copy)
    worst = max(loop, key=lambda p: phases[p]["peak_gib"])
    row = {"config": config_name, "arch": arch_name, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib,
           "method": "full" if not cfg.train.lora.enabled else f"lora r{cfg.train.lora.rank}",
           "model_dtype": cfg.model.dtype, "grad_accum": cfg.train.grad_accum, "micro_batch": micro_batch,
           "samples_per_gpu": per_proc, "kl_reference": cfg.train.kl_beta > 0,
           "ema": getattr(cfg.train, "ema_decay", 0.0) > 0,
           "rollout_precision": getattr(cfg.rollout, "precision", "fp32"),
           "peak_phase": worst, "peak_gib": phases[worst]["peak_gib"], "setup_peak_gib": phases["setup"]["peak_gib"],
           **{f"{p}_peak_gib": phases[p]["peak_gib"] for p in loop}}
    row.update({k: v for k, v in phases[worst].items() if k != "peak_gib"})
    row["phases"] = phases  # every phase's peak and its categories
    overall = max(row["peak_gib"], row["setup_peak_gib"])
    row["fits"] = None if gpu_memory_gib is None else bool(overall <= FIT_MARGIN * gpu_memory_gib)
    for phase in ("setup", *loop):
        s = collectives.summary(phase)
        row[f"{phase}_collectives"], row[f"{phase}_collective_gib"] = s["count"], s["gib"]
    row["iteration_collectives"] = sum(row[f"{p}_collectives"] for p in loop)  # sync + rollout + update
    row["iteration_collective_gib"] = sum(row[f"{p}_collective_gib"] for p in loop)
    row["collectives_by_kind"] = {p: collectives.summary(p)["by_kind"] for p in ("setup", *loop)}
    row["not_simulated"] = list(NOT_SIMULATED)
    row["simulation_seconds"] = seconds
    return row
