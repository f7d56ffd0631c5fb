"""Per-process bytes of parameters + gradients + optimizer state: FSDP2 vs DDP on 2 CPU processes (gloo).

    python benchmarks/bench_fsdp_memory.py [--quick] [--json PATH] [--no-write]

Full fine-tuning of a FLUX transformer (the tiny pipeline's family, built in code by difrl.models.tiny; the full
run widens it to --layers double + single blocks of --dim so that the per-block FSDP units dominate the
root's). One torchrun job of 2 processes (gloo) trains the same model twice: replicated by DDP, then sharded by
FSDP2 the way the trainer shards (difrl.train.dist.sharding.shard, one unit per FluxTransformerBlock /
FluxSingleTransformerBlock). Each time every process runs one forward, backward and AdamW step of the velocity
on random latents, then counts the bytes of what it holds (difrl.train.dist.sharding.state_bytes): its parameters, their
gradients and AdamW's two moments (local shards under FSDP). Not counted: DDP's gradient buckets (another
gradient-sized buffer per process), FSDP's transient all-gathered block during its forward / backward,
activations and libraries. A DDP process holds what a single process holds. Byte counts, no timings: the
numbers do not depend on the machine's load.

The rollout copy (`rollout_copy_bytes`, rows "rollout copy ..."): the same job then builds the fp8_row rollout copy
(rollout.precision=fp8_row, FLUX's skip list, every other linear quantized) of the DDP model (a deep copy, as one
process builds it) and of the FSDP2-sharded one (difrl/train/flow/rollout_copy.py: a full copy per process, filled one
gathered FSDP unit at a time), and counts per process the copy's bytes (its parameters and buffers: fp8 codes,
scales, the layers kept in high precision) and, under FSDP, the most fp32 bytes gathered at once while it is built
(the largest unit) against the whole fp32 model. The FSDP copy must equal the DDP copy tensor for tensor.

Checkpoint saves (checkpoint_rows, a second torchrun job of 2 processes): the same model sharded, with an EMA and
AdamW's state, saved as the trainer saves it in each train.checkpoint_format, sharded (DCP: each process writes
its shards) and gathered (every process gathers the full tensors, rank 0 writes them). Measured: the peak resident
memory of each process during the save above its resident memory just before (Linux VmHWM after the save minus
VmRSS before it, the high-water mark reset by writing 5 to /proc/self/clear_refs; not tracemalloc, which does not
see torch's tensor allocations). Host memory in bytes, no timings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, standard_args  # noqa: E402

BEGIN, END = "<!-- bench_fsdp_memory:begin -->", "<!-- bench_fsdp_memory:end -->"
ROOT = Path(__file__).resolve().parent.parent


def worker(layers: int, dim: int, out: Path) -> None:
    """One process of the torchrun job: the model under DDP, then under FSDP2; one update each; this rank's bytes."""
    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel

    from difrl.train.dist.sharding import FSDPSettings, shard, state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in ("ddp", "fsdp"):
        torch.manual_seed(0)
        net = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=layers,
                                     attention_head_dim=16, num_attention_heads=max(1, dim // 16),
                                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
        numel = sum(p.numel() for p in net.parameters())
        if mode == "fsdp":
            model = shard(net, ("FluxTransformerBlock", "FluxSingleTransformerBlock"), FSDPSettings())
        else:
            model = torch.nn.parallel.DistributedDataParallel(net)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        b, seq, txt = 2, 16, 8
        v = model(hidden_states=torch.randn(b, seq, 4, generator=g),
                  encoder_hidden_states=torch.randn(b, txt, 32, generator=g),
                  pooled_projections=torch.randn(b, 32, generator=g), timestep=torch.rand(b, generator=g),
                  img_ids=torch.zeros(seq, 3), txt_ids=torch.zeros(txt, 3), guidance=None, return_dict=False)[0]
        v.float().pow(2).mean().backward()
        optimizer.step()  # AdamW's moments exist after the first step; the gradients are still held
        counts = state_bytes(params, optimizer)
        (out / f"{mode}-rank{rank}.json").write_text(json.dumps({"mode": mode, "rank": rank, "numel": numel, **counts}))
        if mode == "fsdp":
            rollout_copy_bytes(model, ddp_model, out, rank, numel)
        else:
            ddp_model = model.module
        del model, net, params, optimizer
    dist.barrier()
    dist.destroy_process_group()


def rollout_copy_bytes(sharded, plain, out: Path, rank: int, numel: int) -> None:
    """This rank's bytes of the fp8_row rollout copy of `plain` (DDP's model: a deep copy) and of `sharded` (FSDP2:
    built one gathered unit at a time), and the most fp32 bytes gathered at once for the latter, which must equal
    the deep copy of the sharded model's gathered weights (written to OUT/copy-rank{r}.json)."""
    import torch

    from difrl.quant import QUANT_PRESETS, RolloutCopy
    from difrl.quant.linear import storage_bytes
    from difrl.train.flow.rollout_copy import sharded_skeleton, sharded_weights
    from difrl.train.dist.full_tensors import gathered, plain_copy

    skip = QUANT_PRESETS["flux"]["skip"]
    ddp_copy = RolloutCopy(plain, "fp8_row", skip, 0, "emulate")
    peak = [0]

    def measured(source):  # sharded_weights, noting the largest part (one unit's fp32 tensors, gathered)
        for part in sharded_weights()(source):
            peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in part.values()))
            yield part

    fsdp_copy = RolloutCopy(sharded, "fp8_row", skip, 0, "emulate", weights=measured,
                            skeleton=sharded_skeleton(sharded, {}))
    with gathered(sharded):  # the reference: what one process would build from these weights
        reference = RolloutCopy(plain_copy(sharded), "fp8_row", skip, 0, "emulate")
    a, b = reference.module.state_dict(), fsdp_copy.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the FSDP copy differs from a deep copy"
    (out / f"copy-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "ddp_copy": storage_bytes(ddp_copy.module), "fsdp_copy": storage_bytes(fsdp_copy.module),
        "peak_gathered": peak[0], "model_fp32": 4 * numel, "quantized": len(fsdp_copy.report.quantized)}))


def copy_rows(found: list[dict], state: dict[str, int]) -> tuple[list[dict], list[str]]:
    """The rollout-copy rows (the largest process's) and their table lines; `state`: the training state per process
    of the table above ({"ddp": bytes, "fsdp": bytes})."""
    worst = max(found, key=lambda r: r["fsdp_copy"])
    rows = [{"setting": "rollout copy fp8_row, DDP (a deep copy per process)", "processes": len(found),
             "copy_bytes": worst["ddp_copy"], "peak_gathered_bytes": None, "model_fp32_bytes": worst["model_fp32"],
             "with_state_bytes": worst["ddp_copy"] + state["ddp"]},
            {"setting": "rollout copy fp8_row, FSDP2 (a full copy per process, built one unit at a time)",
             "processes": len(found), "copy_bytes": worst["fsdp_copy"], "peak_gathered_bytes": worst["peak_gathered"],
             "model_fp32_bytes": worst["model_fp32"], "with_state_bytes": worst["fsdp_copy"] + state["fsdp"]}]
    for r in rows:
        r["copy_vs_ddp"] = r["copy_bytes"] / worst["ddp_copy"]
        r["with_state_vs_ddp"] = r["with_state_bytes"] / rows[0]["with_state_bytes"]
        r["linear_layers_quantized"] = worst["quantized"]
    rows[1]["peak_gathered_vs_model"] = rows[1]["peak_gathered_bytes"] / rows[1]["model_fp32_bytes"]
    fsdp = rows[1]
    lines = ["", f"The fp8_row rollout copy ({worst['quantized']} linear layers quantized, FLUX's skip list kept in fp32) "
             f"per process: under FSDP2 {fsdp['copy_vs_ddp']:.3f} x DDP's copy (equal, tensor for tensor, to the deep "
             "copy of the gathered weights), built one gathered unit at a time: the most fp32 bytes gathered at once "
             f"were {fsdp['peak_gathered_vs_model']:.2f} x the whole model's. With the training "
             f"state above, an FSDP2 process holds {fsdp['with_state_vs_ddp']:.3f} x a DDP process.", "",
             "| setting | copy per process | vs DDP's copy | most gathered at once (fp32) | whole model (fp32) | "
             "copy + training state | vs DDP |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['setting']} | {mib(r['copy_bytes'])} | {r['copy_vs_ddp']:.3f} | "
              f"{'-' if r['peak_gathered_bytes'] is None else mib(r['peak_gathered_bytes'])} | "
              f"{mib(r['model_fp32_bytes'])} | {mib(r['with_state_bytes'])} | {r['with_state_vs_ddp']:.3f} |" for r in rows]
    return rows, lines


def vm_kib(field: str) -> int:
    """VmRSS / VmHWM (the resident set's high-water mark) of this process, from /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def checkpoint_worker(layers: int, dim: int, out: Path) -> None:
    """One process of the checkpoint-save job: the FLUX transformer sharded by FSDP2 with an EMA and AdamW's state
    after one update, saved twice as the trainer saves it (difrl.train.scaffold.Run.checkpoint): sharded (each
    process writes its shards with DCP, difrl.train.run.sharded_state.save_sharded), then gathered (every process
    gathers the full tensors, rank 0 writes them: state.snapshot + write_checkpoint). Around each save: the peak
    resident memory above the resident memory before it, i.e. VmHWM after the save minus VmRSS before it, with
    the high-water mark reset first (writing 5 to /proc/self/clear_refs). The launch sets MALLOC_MMAP_THRESHOLD_ so
    that every large tensor is its own mapping, returned to the system when freed (the first save's memory is not
    reused by the second)."""
    import gc

    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel

    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA, save_sharded, snapshot, trainable_params, write_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=layers,
                                 attention_head_dim=16, num_attention_heads=max(1, dim // 16), joint_attention_dim=32,
                                 pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    numel = sum(p.numel() for p in net.parameters())
    net = shard(net, ("FluxTransformerBlock", "FluxSingleTransformerBlock"), FSDPSettings())
    params = trainable_params(net)
    optimizer = torch.optim.AdamW(params.values(), lr=1e-4)
    for p in params.values():  # AdamW's state as after an update, without a forward (the save is what is measured)
        p.grad = torch.ones_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ema = EMA(params, 0.9, net)
    full_bytes = 4 * numel * 4  # fp32 weights, EMA, exp_avg, exp_avg_sq (AdamW's step counts aside)
    found = {}
    for fmt in ("sharded", "gathered"):
        gc.collect()
        dist.barrier()
        before = vm_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        run_dir = out / f"run-{fmt}"
        if fmt == "sharded":
            save_sharded(run_dir, 1, net, optimizer, ema, None, {}, rank == 0, dist.barrier)
        else:
            snap = snapshot(net, optimizer, ema)
            if rank == 0:
                write_checkpoint(run_dir, 1, snap, {})
            del snap
        dist.barrier()
        found[fmt] = (vm_kib("VmHWM") - before) * 1024
    (out / f"checkpoint-rank{rank}.json").write_text(json.dumps({"rank": rank, "numel": numel, "full_bytes": full_bytes,
                                                                 **found}))
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_rows(layers: int, dim: int) -> list[dict]:
    """The peak host memory of one checkpoint save, sharded vs gathered (one torchrun job of 2 CPU processes, gloo;
    checkpoint_worker says how it is measured): one row per format, the largest process's increase and rank 0's."""
    with tempfile.TemporaryDirectory() as tmp:
        launch(layers, dim, Path(tmp), "--worker-checkpoint", {"MALLOC_MMAP_THRESHOLD_": "65536"})
        found = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("checkpoint-rank*.json"))]
    rows = []
    for fmt, label in (("sharded", "checkpoint save, sharded (DCP, each process its shards)"),
                       ("gathered", "checkpoint save, gathered (full tensors, rank 0 writes)")):
        rows.append({"setting": label, "processes": len(found), "numel": found[0]["numel"],
                     "state_full_bytes": found[0]["full_bytes"], "peak_rss_increase_max": max(r[fmt] for r in found),
                     "peak_rss_increase_rank0": next(r[fmt] for r in found if r["rank"] == 0)})
    return rows


def launch(layers: int, dim: int, out: Path, mode: str = "--worker", extra_env: dict | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), mode, "--layers", str(layers), "--dim", str(dim), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the torchrun job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# FLUX.1-dev's transformer (diffusers' FluxTransformer2DModel with its published config: 19 double + 38 single
# blocks, 24 heads of 128, joint_attention_dim 4096, pooled 768, guidance embedding), counted on the meta device
# when this script runs: 11,901,408,320 parameters, the largest block 339,831,296.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=[16, 56, 56])
# Bytes per trained parameter measured by tests/test_precision.py::test_memory_per_trained_parameter (docs/guides/real-models.md,
# "Precision"): full fine-tuning from bf16 keeps fp32 masters, and autocast's bf16 copy of each weight lives from
# the forward to its backward (2 bytes); the KL's frozen reference stays in bf16 (2 bytes); an EMA is fp32 (4).
BF16_COPY, REFERENCE, EMA_BYTES = 2, 2, 4


def flux_dev_counts() -> tuple[int, int]:
    """(parameters, parameters of the largest FSDP unit) of FLUX.1-dev's transformer, built on the meta device."""
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        net = FluxTransformer2DModel(**FLUX_DEV)
    blocks = [m for m in net.modules() if type(m).__name__ in ("FluxTransformerBlock", "FluxSingleTransformerBlock")]
    return sum(p.numel() for p in net.parameters()), max(sum(p.numel() for p in b.parameters()) for b in blocks)


def flux12b_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Memory per GPU of a FLUX.1-dev full fine-tune (AdamW, fp32 masters, bf16 compute), computed from this run's
    measured bytes per parameter: DDP's per-process state / parameters (a replica holds it all), FSDP2's state summed
    over its 2 processes / parameters, split over N processes (FSDP2 shards every tensor on dim 0, so each holds 1/N
    up to rounding: measured for N = 2 only). Plus BF16_COPY / REFERENCE per parameter (replicated under DDP,
    the reference sharded under FSDP2, the bf16 copy one unit at a time: the running unit and the prefetched next)."""
    numel, unit = flux_dev_counts()
    ddp, fsdp = rows[0], rows[1]
    ddp_bpp = ddp["total"] / ddp["numel"]
    fsdp_bpp = fsdp["total"] * fsdp["processes"] / fsdp["numel"]  # the largest shard x 2: an upper bound
    out = []
    for label, n, sharded in (("1 GPU", 1, False), ("DDP, 8 GPUs", 8, False), ("FSDP2, 8 GPUs", 8, True),
                              ("FSDP2, 16 GPUs (2 nodes)", 16, True)):
        state = numel * (fsdp_bpp / n if sharded else ddp_bpp)
        copy = 2 * unit * BF16_COPY if sharded else numel * BF16_COPY
        reference = numel * REFERENCE / (n if sharded else 1)
        ema = numel * EMA_BYTES / (n if sharded else 1)
        out.append({"setting": f"FLUX.1-dev full fine-tune, {label}", "gpus": n, "numel": numel, "largest_unit": unit,
                    "state_bytes": state, "bf16_copy_bytes": copy, "reference_bytes": reference,
                    "total_bytes": state + copy + reference, "ema_bytes": ema})
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    lines = ["", f"Projected to FLUX.1-dev's transformer ({numel:,} parameters, counted on the meta device; largest block "
             f"{unit:,}): per GPU, from this run's measured state per parameter ({ddp_bpp:.2f} bytes under DDP, "
             f"{fsdp_bpp:.2f} under FSDP2 summed over its processes), the bf16 compute copy ({BF16_COPY} bytes per weight; "
             f"under FSDP2 two gathered blocks) and the KL's bf16 reference ({REFERENCE} bytes, sharded under FSDP2), both "
             "measured by tests/test_precision.py. FSDP2's 1/N split is measured at N = 2 only. Not counted: activations, "
             "the text encoders and VAE, DDP's gradient buckets, the rollout copy (its full size on every process, as in "
             "the rollout-copy table), CUDA's own memory. Never run on a GPU.", "",
             "| launch | weights + gradients + AdamW | bf16 compute copy | KL reference | total per GPU | + EMA |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['setting'].split(', ', 1)[1]} | {gib(r['state_bytes'])} | {gib(r['bf16_copy_bytes'])} | "
              f"{gib(r['reference_bytes'])} | {gib(r['total_bytes'])} | {gib(r['ema_bytes'])} |" for r in out]
    return out, lines


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="double and single FLUX blocks each")
    ap.add_argument("--dim", type=int, default=256, help="hidden size (heads of 16)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-checkpoint", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    standard_args(ap, "the tiny size (1 + 1 blocks of 32)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.layers, args.dim, args.out)
        return []
    if args.worker_checkpoint:
        checkpoint_worker(args.layers, args.dim, args.out)
        return []
    layers, dim = (1, 32) if args.quick else (args.layers, args.dim)
    with tempfile.TemporaryDirectory() as tmp:
        launch(layers, dim, Path(tmp))
        found = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json")) if not p.name.startswith("copy-")]
        copies = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("copy-rank*.json"))]
    rows = []
    for mode, label in (("ddp", "DDP, 2 processes (= 1 process)"), ("fsdp", "FSDP2, 2 processes")):
        mine = [r for r in found if r["mode"] == mode]
        worst = max(mine, key=lambda r: r["total"])  # the process holding the most (FSDP: the larger shards)
        terms = {k: worst[k] for k in ("params", "grads", "optimizer", "total")}
        rows.append({"setting": label, "processes": len(mine), **terms, "numel": worst["numel"]})
    ddp_total = rows[0]["total"]
    for r in rows:
        r["vs_ddp"] = r["total"] / ddp_total
    lines = [f"Full fine-tuning of a FLUX transformer of {rows[0]['numel']:,} parameters ({layers} double + {layers} "
             f"single blocks, dim {dim}), fp32, AdamW, after one update. Per process (the largest process's): its "
             "parameters, gradients and AdamW state; under FSDP2 its shards. Not counted: DDP's gradient buckets, "
             "FSDP's transient gathered block, activations, libraries.", "",
             "| setting | parameters | gradients | optimizer state | total per process | vs DDP |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['setting']} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])} | "
              f"{mib(r['total'])} | {r['vs_ddp']:.3f} |" for r in rows]
    more, copy_lines = copy_rows(copies, {"ddp": rows[0]["total"], "fsdp": rows[1]["total"]})
    projected, flux_lines = flux12b_rows(rows)
    rows, lines = rows + more + projected, lines + copy_lines + flux_lines
    # --quick: a checkpoint of the 1 + 1 blocks of 32 (1 MiB) would be lost in DCP's own few MiB; 1 + 1 blocks of 256
    ck_layers, ck_dim = (1, 256) if args.quick else (layers, dim)
    saves = checkpoint_rows(ck_layers, ck_dim)
    full = saves[0]["state_full_bytes"]
    for r in saves:
        r["peak_vs_full_state"] = r["peak_rss_increase_max"] / full
    rows += saves
    lines += ["", f"Peak host memory of one checkpoint save of a FLUX transformer of {saves[0]['numel']:,} parameters "
              f"({ck_layers} double + {ck_layers} single blocks, dim {ck_dim}) with an EMA, after one AdamW update (its "
              f"weights, EMA and AdamW moments: {mib(full)} in full, fp32), as the trainer saves it: the peak resident "
              "memory during the save above the resident memory before it (VmHWM after minus VmRSS before, high-water "
              "mark reset through /proc/self/clear_refs), of rank 0 and of the process with the largest increase.", "",
              "| save | rank 0 | largest process | vs the full state |", "|---|---:|---:|---:|"]
    lines += [f"| {r['setting']} | {mib(r['peak_rss_increase_rank0'])} | {mib(r['peak_rss_increase_max'])} | "
              f"{r['peak_vs_full_state']:.2f} |" for r in saves]
    publish(args, BEGIN, END, "FSDP2 vs DDP: per-process model memory (2 CPU processes)", "bench_fsdp_memory.py",
            argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()
