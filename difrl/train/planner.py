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
FSDP branches taken as on GPUs (difrl.train.sharded_step.take_fsdp_branches). Then the functions `difrl train` calls run
on it, not a replica of them:

- setup: the world around the adapter (difrl.worlds.diffusers.flow_world), difrl.train.flow_plan.plan (the split and
  micro-batching), difrl.train.flow.setup_training (LoRA or masters and reference, FSDP2, optimizer, EMA, copy);
- rollout: difrl.rollout.rollout of one forward batch (sampler.rollout_batch samples, every sampler step, prompts
  encoded); the process's other batches are the same computation, so their stored trajectories are that batch's
  repeated (cat_rollouts) to the process's sample count and their forwards are counted, not run;
- update: difrl.train.flow.policy_update over those samples, with the configured micro-batch and accumulation: its
  first micro-step and the update's last one (which clips, steps AdamW and updates the EMA) run (`MICRO_STEPS`);
  the ones between repeat the first exactly (same shapes, same collectives, gradients already allocated), so their
  collectives are counted, not run. AdamW's moments exist as from the first update on (steady_optimizer_state).

Memory is measured per phase by torch's trackers (torch.distributed._tools: FSDPMemTracker for the sharded network,
which attributes sharded / unsharded parameters and gradients, optimizer state, activations, temporaries and the
all-gather / reduce-scatter buffers; MemTracker for setup and unsharded runs), plus what lives outside the trained
network, measured on the objects themselves: the frozen reference, the EMA / NFT / copy-source shadows, the text
encoders and VAE, the rollout copy. Collectives are counted with their bytes as they are called
(torch.distributed and DTensor's functional collectives). What is not simulated, said in every row's `not_simulated`:
reward models (run on the same GPU: add their size), the evaluation, the checkpoint writes, CUDA's caching allocator
and workspaces (fragmentation: keep headroom, `FIT_MARGIN`), NCCL buffers, and kernels' internal scratch.

The masked trainer (difrl.train.masked; a MaskedConfig, model.kind=hf_masked) is planned the same way by
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

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from difrl.train.simulation import (Collectives, Memory, device_metrics, fake_parameter_swaps, module_bytes,
                                    peak_tracker, plain_tracker, simulated_device, simulated_processes,
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


def plan_config(cfg):
    """The config as the simulation runs it: prompts placeholders when the prompt file is not on this machine (their
    text does not change a shape: the pipelines pad to the text length), and the first-step ratio check off (it reads
    values, which fake tensors do not have)."""
    mc = cfg.model
    if mc.prompts is None and not (mc.prompt_file and Path(mc.prompt_file).is_file()):
        mc = dataclasses.replace(mc, prompts=[f"prompt {i}" for i in range(cfg.rollout.prompts_per_iter)], prompt_file=None)
    return dataclasses.replace(cfg, model=mc, train=dataclasses.replace(cfg.train, ratio_check=False))


def plan_flow(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None,
              micro_steps: int = MICRO_STEPS, config_name: str = "") -> dict:
    """One row: the per-rank peaks of setup, rollout and update, the categories at the overall peak, collectives per
    phase, and whether it fits `gpu_memory_gib` (None: no verdict)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp import FSDPModule

    from difrl.models.adapters import arch_flow_policy
    from difrl.rollout import cat_rollouts, rollout
    from difrl.train.flow import policy_update, setup_training
    from difrl.train.flow_plan import plan, step_masks
    from difrl.train.objectives import nft_sigmas
    from difrl.utils.rng import mix_seed
    from difrl.worlds import world_file
    from difrl.worlds.diffusers import policy_options

    if cfg.rollout.kind != "flat":
        raise ValueError(f"difrl plan simulates flat rollouts; rollout.kind={cfg.rollout.kind} is not simulated yet")
    cfg = plan_config(cfg)
    path, arch_name = resolve_arch(cfg, arch)
    DeviceMetrics = device_metrics()
    t0 = time.perf_counter()
    memory, collectives = Memory(), Collectives()
    with simulated_processes(gpus) as accelerator, collectives, fake_parameter_swaps(), simulated_device():
        # ================================================================ setup
        setup_tracker = plain_tracker()
        with setup_tracker:
            options = {**policy_options(cfg.model.kind, cfg), "device": None}
            policy = arch_flow_policy(cfg.model.kind, path, **options)
            world = world_file(cfg.model.kind).flow_world(cfg.model.kind, None, cfg, policy=policy)
            with tempfile.TemporaryDirectory() as tmp, unset_fake_temporarily():
                n_total, per_proc, T, _, micro = plan(cfg, world, gpus, Path(tmp), lambda *a: None)
                sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
            trainee = setup_training(cfg, policy, accelerator)
        memory.record("setup", setup_tracker, Memory.PLAIN, {})
        steady_optimizer_state(trainee.optimizer, trainee.params)
        frozen = [c for n, c in policy.pipe.components.items() if isinstance(c, nn.Module) and n != "transformer"]
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

        # ================================================================ rollout
        with unset_fake_temporarily():  # the iteration's indices and masks are real: the sampler reads them as numbers
            B = min(cfg.sampler.rollout_batch or per_proc, per_proc)  # one forward batch
            k = torch.arange(B)
            seeds = torch.tensor([mix_seed(cfg.seed, 0, 0, int(i)) for i in k])
            sde_mask, train_mask, _ = step_masks(cfg, 0, n_total)
            prompt_ids, group_ids = k // cfg.rollout.group_size, k // cfg.rollout.group_size
        prompts = [world.prompts[int(i) % len(world.prompts)] for i in prompt_ids]
        with tracker:
            collectives.current = "rollout"
            Memory.restart_peak(tracker)
            trainee.unwrapped.eval()
            part = rollout(policy, prompts, seeds, sigmas, cfg.sampler.kind, cfg.sampler.kernel_kwargs(), sde_mask,
                           train_mask[:B], prompt_ids, group_ids, seeds, cfg.sampler.guidance, batch_size=B)
            batch = cat_rollouts([part] * -(-per_proc // B)) if per_proc > B else part
            memory.record("rollout", tracker, names, resident)
            collectives.scale("rollout", per_proc / B)

            # ============================================================ update
            collectives.current = "update"
            Memory.restart_peak(tracker)
            trainee.unwrapped.train()
            with unset_fake_temporarily():
                advantages, keep = torch.zeros(len(batch)), torch.ones(len(batch), dtype=torch.bool)
            train_sigmas = nft_sigmas(cfg, sigmas) if cfg.train.objective == "nft" else None
            policy_update(cfg, policy, trainee, accelerator, batch, advantages, keep, None, T, micro, 0,
                          DeviceMetrics(cfg.sampler.num_steps), train_sigmas, max_micro_steps=micro_steps)
            memory.record("update", tracker, names, resident)
            ran = min(micro_steps, cfg.train.inner_epochs * -(-len(batch) // micro.records))
            total_micro = cfg.train.inner_epochs * -(-len(batch) // micro.records)
            collectives.scale("update", total_micro / ran)
    seconds = time.perf_counter() - t0
    return plan_row(cfg, config_name, arch_name, gpus, gpu_memory_gib, memory, collectives, micro.transitions, per_proc,
                    seconds)


def plan_row(cfg, config_name: str, arch_name: str, gpus: int, gpu_memory_gib, memory: Memory, collectives: Collectives,
             micro_batch: int, per_proc: int, seconds: float) -> dict:
    """The JSON row: identity of the run, the peak phase's categories at top level, every phase's peak."""
    phases = memory.phases
    worst = max(("rollout", "update"), key=lambda p: phases[p]["peak_gib"])
    row = {"config": config_name, "arch": arch_name, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib,
           "method": "full" if not cfg.train.lora.enabled else f"lora r{cfg.train.lora.rank}",
           "model_dtype": cfg.model.dtype, "grad_accum": cfg.train.grad_accum, "micro_batch": micro_batch,
           "samples_per_gpu": per_proc, "kl_reference": cfg.train.kl_beta > 0,
           "ema": getattr(cfg.train, "ema_decay", 0.0) > 0,
           "peak_phase": worst, "peak_gib": phases[worst]["peak_gib"], "setup_peak_gib": phases["setup"]["peak_gib"],
           "rollout_peak_gib": phases["rollout"]["peak_gib"], "update_peak_gib": phases["update"]["peak_gib"]}
    row.update({k: v for k, v in phases[worst].items() if k != "peak_gib"})
    row["phases"] = phases  # every phase's peak and its categories
    overall = max(row["peak_gib"], row["setup_peak_gib"])
    row["fits"] = None if gpu_memory_gib is None else bool(overall <= FIT_MARGIN * gpu_memory_gib)
    for phase in ("setup", "rollout", "update"):
        s = collectives.summary(phase)
        row[f"{phase}_collectives"], row[f"{phase}_collective_gib"] = s["count"], s["gib"]
    row["collectives_by_kind"] = {p: collectives.summary(p)["by_kind"] for p in ("setup", "rollout", "update")}
    row["not_simulated"] = list(NOT_SIMULATED)
    row["simulation_seconds"] = seconds
    return row


# ---------------------------------------------------------------------------------- the plan of a masked run


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
    """One row of the masked trainer (difrl.train.masked) on `gpus` simulated GPUs, in plan_row's schema.

    setup: the text world around the architecture (difrl.worlds.text_tasks.masked_world), masked_plan.plan, and
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
    from difrl.train.masked import old_log_probs, policy_update, setup_training
    from difrl.train.masked_plan import plan, rollout_forwards
    from difrl.train.sharding import fsdp_settings
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
                split = plan(cfg, gpus, 0)
            trainee = setup_training(cfg, policy, accelerator, fsdp_settings(accelerator))
        memory.record("setup", setup_tracker, Memory.PLAIN, {})
        steady_optimizer_state(trainee.optimizer, trainee.params)
        resident = {"reference": module_bytes(trainee.reference)}
        if isinstance(trainee.net, FSDPModule):
            tracker, names = peak_tracker(trainee.net, trainee.optimizer), Memory.FSDP
        else:
            tracker, names = plain_tracker(trainee.net), Memory.PLAIN
            tracker.track_external(trainee.net, trainee.optimizer)
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


# ---------------------------------------------------------------------------------- the command


def format_rows(rows: list[dict]) -> str:
    """A plain table of the rows for the terminal."""
    cols = ("arch", "method", "gpus", "peak_gib", "setup_peak_gib", "params_gib", "grads_gib", "unsharded_grads_gib",
            "optimizer_gib", "activations_gib", "reference_gib", "ema_gib", "frozen_gib", "fits")
    lines = [" | ".join(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, 0.0)
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plan_run(cfg, gpus: int, gpu_memory_gib: float | None = None, arch: str | None = None, config_name: str = "") -> dict:
    """The row of the trainer the config's model.kind names: plan_masked for a MaskedConfig, plan_flow otherwise."""
    from difrl.train.masked_config import MaskedConfig

    run = plan_masked if isinstance(cfg, MaskedConfig) else plan_flow
    return run(cfg, gpus, gpu_memory_gib, arch, config_name=config_name)


def main(args: argparse.Namespace, load_config) -> int:
    """`difrl plan CONFIG [key=value ...] --gpus N [--gpu-memory GiB] [--arch NAME] [--json PATH]`."""
    cfg = load_config(args.config, args.overrides)
    rows = [plan_run(cfg, n, args.gpu_memory, args.arch, config_name=args.config) for n in args.gpus]
    print(format_rows(rows))
    for r in rows:
        if r["fits"] is not None:
            verdict = "fits" if r["fits"] else "does NOT fit"
            print(f"difrl plan: {r['arch']} {r['method']} on {r['gpus']} GPU(s): peak {max(r['peak_gib'], r['setup_peak_gib']):.1f} "
                  f"GiB per GPU ({r['peak_phase']}; setup {r['setup_peak_gib']:.1f}) {verdict} {args.gpu_memory:g} GiB "
                  f"(at most {FIT_MARGIN:.0%} of it: allocator and NCCL headroom)")
    print(f"simulated, not measured on a GPU; not simulated: {', '.join(NOT_SIMULATED)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"difrl plan: {len(rows)} row(s) written to {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a flow or masked (hf_masked) config (YAML); model.path may be a placeholder: the "
                                  "family's reference architecture is simulated (LLaDA-8B for hf_masked)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for difrl train")
    p.add_argument("--gpus", type=int, nargs="+", default=[1], help="processes (GPUs) to simulate; several: one row each")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU for the verdict (e.g. 80, 141)")
    p.add_argument("--arch", default=None, help="a shipped architecture (difrl/assets/arch/) instead of the family's "
                                                "reference checkpoint (llada-8b for a masked config)")
    p.add_argument("--json", default=None, help="write the rows to this file as a JSON list")


