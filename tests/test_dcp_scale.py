"""Checkpoints at scale: no process hashes, gathers or waits for the others' share (difrl/train/run/state.py,
difrl/train/run/sharded_state.py, difrl/train/run/manifest.py, difrl/train/dist/full_tensors.py `gathered`).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m pytest tests/test_dcp_scale.py -q

a. Fast, in this process: the EMA's update and swap are one `torch._foreach_*` call over every tensor (not a
   Python loop of ops) and give exactly the numbers of the per-tensor loop (the same lerp / copy kernels: tolerance
   0), on plain tensors and on DTensor shards (a one-process gloo group), and on CUDA where there is one (never run
   here: no GPU), the swap also in several buckets.
   `gathered(net, keep=False)` and `snapshot(..., keep=False)` hold no full tensor (meta placeholders / None),
   while keep=True is what one plain process holds.
b. One torchrun job of 2 CPU processes (gloo), a network sharded per block (tests/test_fsdp.py's Net):
   - a sharded save: each process hashes only the DCP files it wrote (its `__R_0.distcp`; the main process also its
     .metadata, rng, state); the manifest lists every process's files;
   - resume: each process hashes its own share of the files (disjoint, together all of them); a corrupted shard of
     process 1 makes both fall back to the previous checkpoint, naming the file on both; with the previous one's
     shard of process 1 removed as well, both stop with the same CheckpointError ("every checkpoint ... damaged")
     naming both files and the shared run directory a sharded checkpoint needs;
   - node-local run directories (each process its own): the save stops on both processes with an error naming the
     files the main process cannot see and the shared-directory requirement (instead of a manifest that misses
     them); a checkpoint whose manifest misses a removed shard (as such a save used to write) stops at restore,
     before dcp.load, on both processes with the same error, instead of hanging in dcp.load; a checkpoint
     directory only the main process sees stops the resume on both, saying so;
   - a gathered snapshot and `gathered(net, keep=main)` (the final save) hold full tensors on the main process only.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from test_fsdp import ROOT, Net, env, run_driver  # noqa: F401


def loop_update(shadow: dict, params: dict, d: float) -> None:
    """The per-tensor EMA update difrl had before foreach (the reference)."""
    with torch.no_grad():
        for k, p in params.items():
            shadow[k].lerp_(p.detach(), 1.0 - d)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("kind", ["plain", "sharded", "cuda"])
def test_foreach_ema_equals_the_per_tensor_loop(kind, request, monkeypatch):
    # cuda (where there is one): the fused foreach kernel against the per-tensor one, the same lerp formula
    from difrl.train import ema as ema_mod
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA

    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sharded = kind == "sharded"
    if sharded:
        request.getfixturevalue("one_process_group")
    torch.manual_seed(0)
    net = Net().to("cuda" if kind == "cuda" else "cpu")
    if sharded:
        net = shard(net, ["Block"], FSDPSettings())
    params = {k: p for k, p in net.named_parameters()}
    assert len(params) >= 4 and (not sharded or all(hasattr(p, "to_local") for p in params.values()))
    ema = EMA(params, 0.9, net)
    reference = {k: v.detach().clone() for k, v in ema.shadow.items()}
    calls = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    for step in range(3):  # the weights move, then the warmed-up decay and an explicit one
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p) * 0.1)
        d = min(0.9, (1 + step) / (10 + step)) if step < 2 else 0.3
        ema.update(None if step < 2 else 0.3)
        loop_update(reference, params, d)
        for k in params:  # the same lerp kernel on the same numbers: bit-exact, tolerance 0
            assert torch.equal(local(ema.shadow[k]), local(reference[k])), k
    assert calls == [len(params)] * 3  # one foreach call per update over every tensor, not one op per tensor
    # the swap exchanges live and EMA weights exactly, also when cut into several buckets (bounded temporary memory)
    for bucket in (ema_mod.SWAP_BUCKET_BYTES, 64):
        monkeypatch.setattr(ema_mod, "SWAP_BUCKET_BYTES", bucket)
        live = {k: local(p).clone() for k, p in params.items()}
        shadow = {k: local(v).clone() for k, v in ema.shadow.items()}
        ema.swap()
        for k, p in params.items():  # exact: a swap copies
            assert torch.equal(local(p), shadow[k]) and torch.equal(local(ema.shadow[k]), live[k]), k
        ema.swap()
        for k, p in params.items():
            assert torch.equal(local(p), live[k]) and torch.equal(local(ema.shadow[k]), shadow[k]), k


def test_gathered_and_snapshot_keep_full_tensors_only_where_asked(one_process_group):
    from difrl.train.dist.full_tensors import gathered, is_sharded
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import EMA, snapshot, trainable_params

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)  # the same seed: the same weights, then sharded
    net = shard(Net(), ["Block"], FSDPSettings())
    params = trainable_params(net)
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    ema = EMA(params, 0.5, net)
    with gathered(net, keep=False):  # a process that only takes part in the gathers: nothing materialised
        assert all(p.is_meta and not is_sharded(p) for p in net.parameters())
        assert {k: tuple(p.shape) for k, p in net.named_parameters()} == {
            k: tuple(p.shape) for k, p in plain.named_parameters()}
    assert all(is_sharded(p) for p in net.parameters())  # the shards are back
    with gathered(net):  # keep=True (the default): the full weights, as before
        for k, p in net.named_parameters():
            assert not p.is_meta and torch.equal(p, plain.state_dict()[k]), k  # exact: shards gathered back
    assert snapshot(net, opt, ema, keep=False) is None
    snap = snapshot(net, opt, ema)  # rank 0 of the group: the main process keeps
    assert {k: tuple(v.shape) for k, v in snap.trainable.items()} == {k: tuple(v.shape) for k, v in plain.state_dict().items()}


def test_gather_to_host_is_a_host_copy_of_a_shard_and_a_plain_tensor_as_is(one_process_group):
    # the name says what happens: DTensor's full_tensor() stays on the shard's device; this one comes to the host
    from difrl.train.dist.full_tensors import gather_to_host, is_sharded
    from difrl.train.dist.sharding import FSDPSettings, shard

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    net = shard(Net(), ["Block"], FSDPSettings())
    for (k, p), ref in zip(net.named_parameters(), plain.parameters()):
        assert is_sharded(p), k
        full = gather_to_host(p)
        assert not is_sharded(full) and full.device.type == "cpu" and torch.equal(full, ref.detach()), k  # exact: a copy
        assert gather_to_host(p, keep=False) is None  # took part in the all-gather, kept nothing
    t = torch.ones(3)
    assert gather_to_host(t) is t and gather_to_host(t, keep=False) is None  # a plain tensor: as is, nothing copied


# ---------------------------------------------------------------------------------- 2 processes

DRIVER = """import sys
sys.path.insert(0, {tests!r})
from test_dcp_scale import two_process_worker
two_process_worker(sys.argv[1])
"""


def two_process_worker(out: str) -> None:
    """One process of test_two_processes_hash_verify_and_gather_only_their_share (its docstring: the module's b.);
    writes what it saw to OUT/rank{r}.json."""
    import shutil
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    import difrl.utils.io as io
    from difrl.train.dist.full_tensors import gathered
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import (EMA, CheckpointError, latest_checkpoint, restore_checkpoint, save_sharded, snapshot,
                                   trainable_params)

    torch.set_num_threads(1)
    # a short timeout: a process left waiting in a collective fails the test in 90 s instead of hanging it
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=90))])
    rank, out = acc.process_index, Path(out)
    seen: dict = {}
    hashed: list[str] = []
    real = io.sha256_file

    def recording(path):
        hashed.append(Path(path).name)
        return real(path)

    for name, mod in list(sys.modules.items()):  # every difrl module that imported sha256_file by name
        if name.startswith("difrl") and getattr(mod, "sha256_file", None) is real:
            mod.sha256_file = recording

    def barrier():
        dist.barrier()

    torch.manual_seed(0)
    net = shard(Net(), ["Block"], FSDPSettings())
    params = trainable_params(net)
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    ema = EMA(params, 0.5, net)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def update():
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()

    def error_of(fn):
        try:
            fn()
        except CheckpointError as e:
            return str(e)
        return None

    run = out / "run"
    for it in (1, 2):
        update()
        hashed.clear()
        path = save_sharded(run, it, net, opt, ema, None, {}, rank == 0, barrier)
    barrier()  # as Run.checkpoint: every process past the save before any reads the checkpoint
    seen["save_hashed"] = sorted(hashed)
    seen["manifest"] = sorted(json.loads((path / "manifest.json").read_text())["files"])
    hashed.clear()
    ckpt = latest_checkpoint(run, print, False, acc)
    seen["resume_iteration"], seen["resume_hashed"] = ckpt.iteration, sorted(hashed)
    restore_checkpoint(ckpt, net, opt, ema)

    # a corrupted shard of process 1 in the newest checkpoint: both processes fall back, naming it
    if rank == 0:
        shard_file = run / "checkpoints" / "iter-000002" / "__1_0.distcp"
        data = bytearray(shard_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard_file.write_bytes(bytes(data))
    barrier()
    said: list[str] = []
    seen["fallback_iteration"] = latest_checkpoint(run, said.append, False, acc).iteration
    seen["fallback_said"] = said
    # process 1's shard of the previous one removed as well: every checkpoint damaged, the same error everywhere
    if rank == 0:
        (run / "checkpoints" / "iter-000001" / "__1_0.distcp").unlink()
    barrier()
    seen["all_damaged"] = error_of(lambda: latest_checkpoint(run, said.append, False, acc))

    # node-local run directories: each process writes into its own
    barrier()
    seen["node_local_save"] = error_of(lambda: save_sharded(out / f"node{rank}", 1, net, opt, ema, None, {},
                                                            rank == 0, barrier))
    # a checkpoint whose manifest misses process 1's removed shard (what a save into node-local directories wrote):
    # its manifest verifies, and restore stops before dcp.load on both processes
    old = out / "old"
    save_sharded(old, 1, net, opt, ema, None, {}, rank == 0, barrier)
    barrier()
    if rank == 0:  # and a node-local copy of it, which only the main process sees
        shutil.copytree(old / "checkpoints", out / "local0" / "checkpoints")
        d = old / "checkpoints" / "iter-000001"
        (d / "__1_0.distcp").unlink()
        manifest = json.loads((d / "manifest.json").read_text())
        del manifest["files"]["__1_0.distcp"]
        (d / "manifest.json").write_text(json.dumps(manifest))
    barrier()
    ckpt = latest_checkpoint(old, print, False, acc)
    seen["restore_missing"] = error_of(lambda: restore_checkpoint(ckpt, net, opt, ema))
    seen["node_local_resume"] = error_of(lambda: latest_checkpoint(out / f"local{rank}", print, False, acc))

    # the gathered format's snapshot and the final save's gathered(): full tensors on the main process only
    snap = snapshot(net, opt, ema)
    seen["snapshot"] = None if snap is None else {k: list(v.shape) for k, v in snap.trainable.items()}
    with gathered(net, keep=acc.is_main_process):
        seen["gathered"] = {k: [list(p.shape), p.is_meta, type(p).__name__] for k, p in net.named_parameters()}
    shutil.rmtree(out / f"node{rank}", ignore_errors=True)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    barrier()
    dist.destroy_process_group()


def test_two_processes_hash_verify_and_gather_only_their_share(tmp_path):
    run_driver(DRIVER, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))

    # save: each process hashed what it wrote, the manifest lists everything
    assert r0["manifest"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng.safetensors", "state.json"]
    assert r0["save_hashed"] == [".metadata", "__0_0.distcp", "rng.safetensors", "state.json"]
    assert r1["save_hashed"] == ["__1_0.distcp"]
    # resume: disjoint shares that together are every file, each hashed once
    assert r0["resume_iteration"] == r1["resume_iteration"] == 2
    assert r0["resume_hashed"] and r1["resume_hashed"] and not set(r0["resume_hashed"]) & set(r1["resume_hashed"])
    assert sorted(r0["resume_hashed"] + r1["resume_hashed"]) == r0["manifest"]
    assert "__0_0.distcp" in r0["resume_hashed"] and "__1_0.distcp" in r1["resume_hashed"]  # what each one wrote

    # a corrupted shard of process 1: both fall back to iteration 1 and say which file, with the existing message
    for r in (r0, r1):
        assert r["fallback_iteration"] == 1
        assert any("iter-000002" in s and "__1_0.distcp does not match its SHA-256 in the manifest" in s
                   and "trying the previous checkpoint" in s for s in r["fallback_said"]), r["fallback_said"]
    # every checkpoint damaged: the same error on both processes, naming both files and the requirement
    assert r0["all_damaged"] is not None and r0["all_damaged"] == r1["all_damaged"]
    msg = r0["all_damaged"]
    assert "every checkpoint in" in msg and "is damaged" in msg
    assert "iter-000002: __1_0.distcp does not match its SHA-256" in msg
    assert "iter-000001: __1_0.distcp is missing" in msg and "shared" in msg

    # node-local directories: the save stops on both, naming the files the main process does not see
    # (the same message but for each process's own directory, which on real nodes is one path)
    assert r0["node_local_save"] is not None
    assert r0["node_local_save"].replace("/node0/", "/N/") == r1["node_local_save"].replace("/node1/", "/N/")
    assert "process 0 does not see __1_0.distcp" in r0["node_local_save"]
    assert "__1_0.distcp" in r0["node_local_save"] and "shared" in r0["node_local_save"]
    # a manifest that misses a removed shard: restore stops before dcp.load, the same error on both
    assert r0["restore_missing"] is not None and r0["restore_missing"] == r1["restore_missing"]
    assert "__1_0.distcp" in r0["restore_missing"] and "shared" in r0["restore_missing"]
    assert "do not load" not in r0["restore_missing"]  # not DCP's own failure
    # a node-local checkpoint directory that only the main process sees: both stop, saying so
    assert r0["node_local_resume"] is not None
    assert r0["node_local_resume"].replace("/local0/", "/N/") == r1["node_local_resume"].replace("/local1/", "/N/")
    assert "its directory is missing on process(es) 1, though the others see it" in r0["node_local_resume"]
    assert "shared run directory" in r0["node_local_resume"]

    # gathered: rank 0 holds the full tensors, rank 1 none (meta placeholders of the full shape)
    assert r1["snapshot"] is None
    full = {k: v for k, v in r0["snapshot"].items()}
    assert full and all(not meta and kind == "Parameter" for _, meta, kind in r0["gathered"].values())
    assert all(meta for _, meta, _ in r1["gathered"].values())
    assert {k: v[0] for k, v in r0["gathered"].items()} == {k: v[0] for k, v in r1["gathered"].items()} == full
