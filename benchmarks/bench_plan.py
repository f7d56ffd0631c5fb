"""Real-size runs simulated by `difrl plan`: per-GPU peak memory by phase and category, collectives, verdicts.

    python benchmarks/bench_plan.py [--quick] [--json PATH] [--no-write] [--jobs N] [--families]

Two blocks: without --families, the first families' rows (FLUX.1-dev, SD3.5-Large, Wan 2.1 14B, LLaDA-8B) at 1, 8 and
16 GPUs ("Real size, simulated: difrl plan"); with --families, the families added since (SANA, FLUX.2 [dev] and
[klein], SD3.5-Medium, Z-Image, Qwen-Image and Qwen-Image-Edit, Wan 2.2 TI2V-5B and T2V-A14B: FAMILY_PREFIXES) at 1
and 8 GPUs, the counts issue 47 asks for ("Real size, simulated: the newer families"). Each full run rewrites its own
block only.

Each row is `difrl plan` (difrl/train/planner/flow.py) of a published recipe config at the size of the family's reference
checkpoint (FLUX.1-dev, SD3.5-Large, Wan 2.1 T2V 14B, LLaDA-8B, SANA-1.6B, FLUX.2-dev, FLUX.2-klein-base-9B, Z-Image:
difrl/assets/arch/) or of the case's own architecture (CASE_ARCH: SD3.5-Medium, the size configs/sd3_flow_grpo.yaml
is written for; Wan 2.2 T2V-A14B, which configs/wan22_dance_grpo.yaml also trains), at 1, 8 and 16 GPUs: the trainer's own setup, one rollout forward batch (the masked trainer: the
process's samples, every sampler step) and the update's first and last micro-steps, on fake tensors under a fake
process group (FSDP2 above one GPU, one plain process at one). The flow configs' train.grad_accum is set per GPU
count to keep their published updates per rollout (the configs' headers give the formula); the masked config keeps
them by itself (train.micro_batch=auto). LLaDA-8B
runs the LLaDA-8B command of docs/guides/dllm.md (configs/text_arithmetic.yaml with a 64-token answer in 2 blocks of 32 sampler steps).
Simulated on a CPU, never measured on a GPU; not simulated: reward models, evaluation, checkpoint writes, CUDA
allocator fragmentation and context, NCCL buffers (every row's `not_simulated`). A plan fits when its peak (setup's
or the iteration's) is at most 90% of the GPU (`difrl.train.planner.flow.FIT_MARGIN`). Byte counts, no timings: the numbers do not depend on the machine's load.
--quick: FLUX.1-dev and LLaDA-8B, LoRA and full fine-tuning, on 8 GPUs only (with --families: SANA-1.6B's two).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, standard_args  # noqa: E402

BEGIN, END = "<!-- bench_plan:begin -->", "<!-- bench_plan:end -->"
FAMILY_BEGIN, FAMILY_END = "<!-- bench_plan_families:begin -->", "<!-- bench_plan_families:end -->"
# the cases of --families: a case belongs to them when its name starts with one of these
FAMILY_PREFIXES = ("SANA", "FLUX.2", "SD3.5-Medium", "Z-Image", "Qwen-Image", "Wan 2.2")
FAMILY_GPUS = (1, 8)
ROOT = Path(__file__).resolve().parent.parent
GPUS = (1, 8, 16)
VERDICTS = (80, 141)  # H100 80 GB, H200 141 GB
# the LLaDA-8B command of docs/guides/dllm.md (model.path a placeholder: the planner builds difrl/assets/arch/llada-8b)
GC = "model.gradient_checkpointing=true"  # configs/flux_flow_grpo.yaml sets it; the SD3 / Wan configs (sized for the
# smaller SD3.5-Medium and Wan 1.3B) do not
LLADA = ["model.path=/models/LLaDA-8B-Instruct", "model.gen_length=64", "sampler.block_length=32", "sampler.steps=32"]
# name, config, overrides, the samples-per-update numerator: grad_accum = numerator // gpus (the config header's
# formula); None: the config keeps its updates on any number of GPUs (masked: train.micro_batch=auto); a fifth
# item: the GPU counts of a variant (default GPUS)
CASES = [
    ("FLUX.1-dev full, EMA + KL ref, micro-batch 15, no grad. checkpointing", "configs/flux_flow_grpo.yaml",
     ["train.lora.enabled=false", "train.kl_beta=0.04", "model.gradient_checkpointing=false"], 192),
    ("FLUX.1-dev full, EMA + KL ref, micro-batch 15", "configs/flux_flow_grpo.yaml",
     ["train.lora.enabled=false", "train.kl_beta=0.04"], 192),
    ("FLUX.1-dev full, EMA + KL ref, micro-batch 15, rollouts gathered per forward", "configs/flux_flow_grpo.yaml",
     ["train.lora.enabled=false", "train.kl_beta=0.04", "rollout.fsdp_gather=per_forward"], 192, (8,)),
    ("FLUX.1-dev full, EMA + KL ref, micro-batch 15, fp8 rollout copy", "configs/flux_flow_grpo.yaml",
     ["train.lora.enabled=false", "train.kl_beta=0.04", "rollout.precision=fp8"], 192, (8,)),
    ("FLUX.1-dev LoRA r32, EMA", "configs/flux_flow_grpo.yaml", [], 192),
    ("SD3.5-Large full, EMA + KL ref, micro-batch 9, grad. checkpointing", "configs/sd3_flow_grpo.yaml",
     ["train.lora.enabled=false", GC], 576),
    ("SD3.5-Large LoRA r32, micro-batch 9, grad. checkpointing", "configs/sd3_flow_grpo.yaml", [GC], 576),
    ("SD3.5-Large LoRA r32, micro-batch 27, grad. checkpointing", "configs/sd3_flow_grpo.yaml",
     [GC, "train.micro_batch=27"], 192),
    ("Wan 2.1 14B LoRA r32, micro-batch 9, grad. checkpointing", "configs/wan_dance_grpo.yaml", [GC], 192),
    ("Wan 2.1 14B LoRA r32, micro-batch 3, grad. checkpointing", "configs/wan_dance_grpo.yaml",
     [GC, "train.micro_batch=3"], 576),
    ("Wan 2.1 14B full, grad. checkpointing", "configs/wan_dance_grpo.yaml", ["train.lora.enabled=false", GC], 192),
    ("LLaDA-8B full, 64-token answers, 32 sampler steps", "configs/text_arithmetic.yaml",
     [*LLADA, "train.lora.enabled=false"], None),
    ("LLaDA-8B LoRA r16, 64-token answers, 32 sampler steps", "configs/text_arithmetic.yaml",
     [*LLADA, "train.lora.enabled=true"], None),
    # Sol-RL's candidate stage is not simulated (difrl plan: flat rollouts): the regeneration rollout and NFT's update
    ("SANA-1.6B LoRA r32, Sol-RL's rollout + NFT update, micro-batch 96, grad. checkpointing", "configs/sana_sol_rl.yaml",
     ["rollout.kind=flat"], 72),
    ("SANA-1.6B full, Sol-RL's rollout + NFT update, micro-batch 96, grad. checkpointing", "configs/sana_sol_rl.yaml",
     ["rollout.kind=flat", "train.lora.enabled=false"], 72),
    # FLUX.2 (Flow-Factory's recipes): 768 samples per rollout in 2 updates of 1-transition micro-batches
    ("FLUX.2-dev LoRA r64, EMA + KL ref, grad. checkpointing", "configs/flux2_flow_grpo.yaml", [], 384),
    ("FLUX.2-dev full, EMA + KL ref, grad. checkpointing", "configs/flux2_flow_grpo.yaml",
     ["train.lora.enabled=false"], 384),
    ("FLUX.2-klein-base-9B LoRA r64, EMA, true CFG", "configs/flux2_klein_flow_grpo.yaml", [], 384),
    ("FLUX.2-klein-base-9B full, EMA, true CFG", "configs/flux2_klein_flow_grpo.yaml", ["train.lora.enabled=false"], 384),
    # SD3.5-Medium is configs/sd3_flow_grpo.yaml's own size; micro-batch 81 (9 samples x 9 steps) is what it set before
    ("SD3.5-Medium LoRA r32, micro-batch 9", "configs/sd3_flow_grpo.yaml", [], 576),
    ("SD3.5-Medium LoRA r32, micro-batch 81", "configs/sd3_flow_grpo.yaml", ["train.micro_batch=81"], 64),
    ("SD3.5-Medium LoRA r32, micro-batch 81, grad. checkpointing", "configs/sd3_flow_grpo.yaml",
     [GC, "train.micro_batch=81"], 64),
    ("SD3.5-Medium full, EMA + KL ref, micro-batch 9, grad. checkpointing", "configs/sd3_flow_grpo.yaml",
     ["train.lora.enabled=false", GC], 576),
    ("Z-Image full, EMA, micro-batch 1", "configs/zimage_flow_grpo.yaml", [], 384),
    ("Z-Image LoRA r32, micro-batch 1", "configs/zimage_flow_grpo.yaml",
     ["train.lora.enabled=true", "train.lora.rank=32", "train.lora.alpha=64"], 384),
    ("Qwen-Image LoRA r64, micro-batch 4, grad. checkpointing", "configs/qwenimage_flow_grpo.yaml", [], 128),
    ("Qwen-Image full, micro-batch 4, grad. checkpointing", "configs/qwenimage_flow_grpo.yaml",
     ["train.lora.enabled=false"], 128),
    ("Wan 2.2 TI2V-5B LoRA r32, micro-batch 9, grad. checkpointing", "configs/wan22_dance_grpo.yaml", [GC], 192),
    ("Wan 2.2 TI2V-5B full, grad. checkpointing", "configs/wan22_dance_grpo.yaml", ["train.lora.enabled=false", GC],
     192),
    # Qwen-Image-Edit (Flow-Factory's recipe): 768 samples per rollout in 2 updates of 1-transition micro-batches;
    # its placeholder prompts carry source images (difrl.train.planner.flow.plan_config), resized to model.source_size 384
    ("Qwen-Image-Edit LoRA r64, micro-batch 1, grad. checkpointing", "configs/qwenimage_edit_flow_grpo.yaml", [], 384),
    ("Qwen-Image-Edit full, micro-batch 1, grad. checkpointing", "configs/qwenimage_edit_flow_grpo.yaml",
     ["train.lora.enabled=false"], 384),
    # Wan 2.2 T2V-A14B (CASE_ARCH): configs/wan22_dance_grpo.yaml on both experts, each step on its own expert
    ("Wan 2.2 T2V-A14B LoRA r32, micro-batch 9, grad. checkpointing", "configs/wan22_dance_grpo.yaml", [GC], 192),
    ("Wan 2.2 T2V-A14B LoRA r32, micro-batch 3, grad. checkpointing", "configs/wan22_dance_grpo.yaml",
     [GC, "train.micro_batch=3"], 576),
    ("Wan 2.2 T2V-A14B full, grad. checkpointing", "configs/wan22_dance_grpo.yaml", ["train.lora.enabled=false", GC],
     192),
]
# the architecture a case simulates when it is not its model kind's reference (difrl.models.arch.REFERENCE_ARCH)
CASE_ARCH = {name: arch for name, *_ in CASES for prefix, arch in (("SD3.5-Medium", "sd3.5-medium"),
                                                                    ("Wan 2.2 T2V-A14B", "wan2.2-t2v-a14b"))
             if name.startswith(prefix)}


def run_case(name: str, config: str, overrides: list[str], numerator: int, gpus: int) -> dict:
    from difrl.train.planner.command import plan_run
    from difrl.train.recipes import load_train_config

    over = [*overrides, *([f"train.grad_accum={numerator // gpus}"] if numerator is not None else [])]
    cfg = load_train_config(ROOT / config, over)
    row = plan_run(cfg, gpus, VERDICTS[0], arch=CASE_ARCH.get(name), config_name=config)  # rollout.fsdp_gather=auto decides for an 80 GiB GPU
    from difrl.train.planner.flow import FIT_MARGIN

    row.update({"case": name, "overrides": over, "verdicts_gib": list(VERDICTS), "fit_margin_percent": 100 * FIT_MARGIN})
    for v in VERDICTS:
        row[f"fits_{v}"] = max(row["peak_gib"], row["setup_peak_gib"]) <= FIT_MARGIN * v
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | GPUs | peak GiB (phase) | setup peak | params | grads | optimizer | activations | reference | "
             f"EMA | text enc. + VAE | fits {VERDICTS[0]} GiB | fits {VERDICTS[1]} GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = lambda k: f"{r.get(k, 0.0):.1f}"  # noqa: E731
        gathered = r.get("unsharded_params_gib", 0.0)  # the masked rollout holds the whole network gathered
        params = g("params_gib") + (f" + {gathered:.1f} gathered" if gathered >= 0.05 else "")
        lines.append(f"| {r['case']} | {r['gpus']} | {g('peak_gib')} ({r['peak_phase']}) | {g('setup_peak_gib')} | "
                     f"{params} | {r.get('grads_gib', 0.0) + r.get('unsharded_grads_gib', 0.0):.1f} | "
                     f"{g('optimizer_gib')} | {g('activations_gib')} | {g('reference_gib')} | {g('ema_gib')} | "
                     f"{g('frozen_gib')} | {'yes' if r['fits_80'] else 'no'} | {'yes' if r['fits_141'] else 'no'} |")
    return lines


def collectives_table(rows: list[dict]) -> list[str]:
    lines = ["| run | GPUs | rollout gathers | copy sync (GiB) | rollout (GiB) | update (GiB) | iteration (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["gpus"] > 1:
            c = lambda p: (f"{r[p + '_collectives']:,} ({r[p + '_collective_gib']:,.1f})"  # noqa: E731
                           if p + "_collectives" in r else "-")
            lines.append(f"| {r['case']} | {r['gpus']} | {r.get('rollout_gather', 'once')} | {c('sync')} | {c('rollout')} "
                         f"| {c('update')} | {c('iteration')} |")
    return lines


def sentences(rows: list[dict]) -> list[str]:
    """What the rows show, each sentence computed from them."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        counts = [r["gpus"] for r in rows if r["case"] == case]
        fits = [r["gpus"] for r in rows if r["case"] == case and r["fits_80"]]
        of = ", ".join(map(str, counts))
        out.append(f"- {case}: " + (f"fits 80 GiB per GPU from {min(fits)} GPU(s) on (of {of} simulated)"
                                    if fits else f"fits 80 GiB per GPU at none of the simulated GPU counts ({of})") + ".")
    by = {(r["case"], r["gpus"]): r for r in rows}
    for n in sorted({r["gpus"] for r in rows if r["gpus"] > 1}):
        once, per = (by.get((f"FLUX.1-dev full, EMA + KL ref, micro-batch 15{tail}", n))
                     for tail in ("", ", rollouts gathered per forward"))
        if once and per and once.get("rollout_gather") == "once":
            out.append(f"- FLUX.1-dev full fine-tuning on {n} GPUs: gathering every block once per rollout makes "
                       f"{once['rollout_collectives']:,} rollout all-gathers ({once['rollout_collective_gib']:,.0f} GiB) "
                       f"where gathering before each forward makes {per['rollout_collectives']:,} "
                       f"({per['rollout_collective_gib']:,.0f} GiB); rollout peak {once['rollout_peak_gib']:.1f} GiB "
                       f"against {per['rollout_peak_gib']:.1f}.")
    setup_above = [f"{r['case']} on {r['gpus']}" for r in rows if r["setup_peak_gib"] > r["peak_gib"]]
    out.append("- Setup's peak is above the iteration's in: " + (", ".join(setup_above) if setup_above else "no row") + ".")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "FLUX.1-dev and LLaDA-8B, LoRA and full fine-tuning, on 8 GPUs only")
    ap.add_argument("--jobs", type=int, default=1, help="plans run at once, each in its own process")
    ap.add_argument("--families", action="store_true", help="the families added since the first four (FAMILY_PREFIXES), "
                    "at 1 and 8 GPUs, into their own block; --quick with it: SANA-1.6B's two cases on 8 GPUs")
    args = ap.parse_args(argv)
    mine = [c for c in CASES if c[0].startswith(FAMILY_PREFIXES) == args.families]
    quick = ({"FLUX.1-dev full, EMA + KL ref, micro-batch 15", "FLUX.1-dev LoRA r32, EMA"}, "LLaDA")
    quick = (set(), "SANA") if args.families else quick  # (these cases, and those starting with this)
    cases = [c for c in mine if c[0] in quick[0] or c[0].startswith(quick[1])] if args.quick else mine
    gpus = (8,) if args.quick else FAMILY_GPUS if args.families else GPUS
    runs = [(name, config, overrides, numerator, n) for name, config, overrides, numerator, *own in cases
            for n in (gpus if args.quick else (own[0] if own else gpus))]
    # each plan in a process of its own (a fresh simulated cluster), --jobs at a time: byte counts, no timings
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_case, *r) for r in runs]
        rows = []
        for r, f in zip(runs, futures):
            rows.append(f.result())
            print(f"bench_plan: {r[0]} on {r[4]} GPU(s): peak {rows[-1]['peak_gib']:.1f} GiB", flush=True)
    lines = ["Simulated on this CPU by `difrl plan` (fake tensors, a fake process group of N ranks, the trainer's own "
             "setup and iteration phases), never measured on a GPU. Per GPU, GiB; the categories are those of the "
             "peak phase (params: this GPU's shards, + those gathered at the peak: FSDP units in a forward or backward, "
             "the whole network while the masked trainer samples). Not simulated: reward models, evaluation, checkpoint writes, CUDA allocator and context, "
             f"NCCL buffers; a plan fits when its peak is at most {rows[0]['fit_margin_percent']:.0f}% of the GPU.", "", *table(rows), "",
             "Collectives per iteration on the simulated rank, count (GiB of their largest buffers: an all-gather's "
             "output, a reduce-scatter's input). FSDP2 gathers every unit at every forward and backward of the update; "
             "the rollout gathers every unit once or before each forward (`rollout.fsdp_gather`, auto: once when the "
             "gathered network fits half of an 80 GiB GPU's free memory); a rollout copy is synced with one all-gather "
             "per unit; the rollout's forward batches and the update's micro-steps beyond the simulated ones are "
             "counted as repeats of them:", "", *collectives_table(rows), "", *sentences(rows)]
    if args.families:
        publish(args, FAMILY_BEGIN, FAMILY_END, "Real size, simulated: the newer families", "bench_plan.py", argv,
                lines, rows)
    else:
        publish(args, BEGIN, END, "Real size, simulated: difrl plan", "bench_plan.py", argv, lines, rows)


if __name__ == "__main__":
    main()
