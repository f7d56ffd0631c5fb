"""Per-process bytes of parameters + gradients + optimizer state: FSDP2 vs DDP on 2 CPU processes (gloo).

    python benchmarks/bench_fsdp_memory.py [--quick] [--json PATH] [--no-write]

Full fine-tuning of a FLUX transformer (the tiny pipeline's family, built in code by difrl.models.tiny; the full
run widens it to --layers double + single blocks of --dim so that the per-block FSDP units dominate the
root's). One torchrun job of 2 processes (gloo) trains the same model twice: replicated by DDP, then sharded by
FSDP2 the way the trainer shards (difrl.train.sharding.shard, one unit per FluxTransformerBlock /
FluxSingleTransformerBlock). Each time every process runs one forward, backward and AdamW step of the velocity
on random latents, then counts the bytes of what it holds (difrl.train.sharding.state_bytes): its parameters, their
gradients and AdamW's two moments (local shards under FSDP). Not counted: DDP's gradient buckets (another
gradient-sized buffer per process), FSDP's transient all-gathered block during its forward / backward,
activations and libraries. A DDP process holds what a single process holds. Byte counts, no timings: the
numbers do not depend on the machine's load.

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

    from difrl.train.sharding import FSDPSettings, shard, state_bytes

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
        del model, net, params, optimizer
    dist.barrier()
    dist.destroy_process_group()


def vm_kib(field: str) -> int:
    """VmRSS / VmHWM (the resident set's high-water mark) of this process, from /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def checkpoint_worker(layers: int, dim: int, out: Path) -> None:
    """One process of the checkpoint-save job: the FLUX transformer sharded by FSDP2 with an EMA and AdamW's state
    after one update, saved twice as the trainer saves it (difrl.train.scaffold.Run.checkpoint): sharded (each
    process writes its shards with DCP, difrl.train.sharded_state.save_sharded), then gathered (every process
    gathers the full tensors, rank 0 writes them: state.snapshot + write_checkpoint). Around each save: the peak
    resident memory above the resident memory before it, i.e. VmHWM after the save minus VmRSS before it, with
    the high-water mark reset first (writing 5 to /proc/self/clear_refs). The launch sets MALLOC_MMAP_THRESHOLD_ so
    that every large tensor is its own mapping, returned to the system when freed (the first save's memory is not
    reused by the second)."""
    import gc

    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel

    from difrl.train.sharding import FSDPSettings, shard
    from difrl.train.state import EMA, save_sharded, snapshot, trainable_params, write_checkpoint

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
        found = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]
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
    # --quick: a checkpoint of the 1 + 1 blocks of 32 (1 MiB) would be lost in DCP's own few MiB; 1 + 1 blocks of 256
    ck_layers, ck_dim = (1, 256) if args.quick else (layers, dim)
    saves = checkpoint_rows(ck_layers, ck_dim)
    rows += saves
    full = saves[0]["state_full_bytes"]
    lines += ["", f"Peak host memory of one checkpoint save of a FLUX transformer of {saves[0]['numel']:,} parameters "
              f"({ck_layers} double + {ck_layers} single blocks, dim {ck_dim}) with an EMA, after one AdamW update (its "
              f"weights, EMA and AdamW moments: {mib(full)} in full, fp32), as the trainer saves it: the peak resident "
              "memory during the save above the resident memory before it (VmHWM after minus VmRSS before, high-water "
              "mark reset through /proc/self/clear_refs), of rank 0 and of the process with the largest increase.", "",
              "| save | rank 0 | largest process | vs the full state |", "|---|---:|---:|---:|"]
    lines += [f"| {r['setting']} | {mib(r['peak_rss_increase_rank0'])} | {mib(r['peak_rss_increase_max'])} | "
              f"{r['peak_rss_increase_max'] / full:.2f} |" for r in saves]
    publish(args, BEGIN, END, "FSDP2 vs DDP: per-process model memory (2 CPU processes)", "bench_fsdp_memory.py",
            argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()
