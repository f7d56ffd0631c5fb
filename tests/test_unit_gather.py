"""Gathering FSDP2 units (difrl/train/dist/unit_gather.py) and the rollout copy's reads of them (issue 46, 9a / 9b).

    HF_HUB_OFFLINE=1 python -m pytest tests/test_unit_gather.py -q

- gather_full on 3 real gloo processes (one torchrun job, as the other multi-process tests launch): uneven row counts (a rank with fewer rows, a rank with none), two dtypes,
  every full tensor equals DTensor.full_tensor() cast to its dtype, exactly, with one all-gather
  per dtype (before: one per parameter, in the shards' dtype).
- the rollout copy of an unsharded bf16 full fine-tune is synced from the loaded-dtype weights, as it was built and
  as the sharded path gathers them: after an update a synced copy equals a copy built afresh (before: the sync
  quantized the fp32 masters, the build the bf16 weights).
- rollout_gather's auto choice.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp import run_driver  # noqa: E402

WORLD = 3


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(3, 1), nn.Linear(4, 10, bias=False)

    def forward(self, x):  # FSDP shards modules with a forward; not called
        return x


# The driver leaves without Python's finalization once the worker returned (results written, group destroyed): gloo's
# worker thread may still be freeing the last collectives' work objects, which hold Python-owned tensors, and a thread
# that needs the GIL while the interpreter finalizes is ended by a forced unwind, std::terminate, SIGABRT (a core dump
# of 1 in ~15 runs of 3 processes on 2 cores: ~AsyncAllgatherWork -> decref_pyobject -> PyThread_exit_thread).
GATHER_DRIVER = """import os, sys
sys.path.insert(0, {tests!r})
from test_unit_gather import gather_worker
gather_worker(sys.argv[1])
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def gather_worker(out_dir: str) -> None:
    """One process of the torchrun job of test_gather_full_equals_full_tensor_with_one_all_gather_per_dtype; rank 0
    writes OUT/out.json."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import difrl.train.dist.unit_gather as ug

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    try:
        torch.manual_seed(0)  # the same module on every rank
        net = Three()
        net.c.weight.data = net.c.weight.data.bfloat16()  # a parameter stored in bf16 (LoRA base weights are)
        fully_shard(net, mesh=init_device_mesh("cpu", (WORLD,)))
        params = list(net.parameters())  # rows 7 (3, 3, 1), 7, 1 (1, 0, 0), 1, 10 (4, 4, 2)
        dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
        calls = []
        real = dist.all_gather_single
        dist.all_gather_single = lambda out, inp, **kw: calls.append((inp.dtype, inp.numel())) or real(out, inp, **kw)
        try:
            fulls = ug.gather_full(params, dtypes)
        finally:
            dist.all_gather_single = real
        want = [p.full_tensor().to(d) for p, d in zip(params, dtypes)]
        ok = [bool(f.dtype == w.dtype and f.shape == w.shape and torch.equal(f, w)) for f, w in zip(fulls, want)]
        if rank == 0:
            with open(Path(out_dir) / "out.json", "w") as f:
                json.dump({"ok": ok, "calls": [[str(d), n] for d, n in calls]}, f)
    finally:
        dist.destroy_process_group()


def test_gather_full_equals_full_tensor_with_one_all_gather_per_dtype(tmp_path):
    run_driver(GATHER_DRIVER, tmp_path, timeout=300, nproc=WORLD)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["ok"] == [True] * 5  # exact: a cast commutes with a gather; padding rows cut
    # one all-gather per dtype: bf16 [a.weight 3x5, b.weight 1x3, c.weight 4x4] padded rows; fp32 [a.bias 3, b.bias 1]
    assert sorted(got["calls"]) == sorted([["torch.bfloat16", 3 * 5 + 1 * 3 + 4 * 4], ["torch.float32", 3 + 1]])


def test_a_synced_copy_of_a_bf16_full_fine_tune_equals_a_copy_built_afresh():
    # one process, no FSDP: fp32 masters of a bf16 model (MasterWeights), an fp8 (per-tensor scale) rollout copy built
    # from the loaded-dtype weights; after an update of the masters by steps bf16 cannot hold, the synced copy must be
    # what building the copy now gives. Before, sync quantized the fp32 masters (another amax, other roundings)
    from difrl.quant import RolloutCopy
    from difrl.train.precision import MasterWeights
    from difrl.train.flow.rollout_copy import loaded_weights

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).bfloat16()
    masters = MasterWeights(torch.bfloat16, {n: torch.bfloat16 for n, _ in net.named_parameters()})
    for p in net.parameters():
        p.data = p.data.float()

    def built():
        with masters.as_loaded(net):
            return RolloutCopy(net, "fp8", min_dim=0, weights=loaded_weights(masters))

    copy = built()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1e-3 * torch.randn_like(p))  # fp32 steps: the masters now hold values no bf16 holds
    assert copy.sync(net)["changed_layers"] == 2
    fresh = built()
    mine, theirs = copy.module.state_dict(), fresh.module.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k  # exact: both quantize the same bf16 weights
    assert all(p.dtype == torch.float32 for p in net.parameters())  # the masters are put back


def test_rollout_gather_auto_gathers_once_when_the_network_fits_half_the_free_memory(monkeypatch):
    import difrl.train.dist.unit_gather as ug

    monkeypatch.setattr(ug, "gathered_bytes", lambda net, fsdp: 100)
    fsdp = object()
    assert ug.rollout_gather("auto", None, fsdp, free_bytes=200) == "once"
    assert ug.rollout_gather("auto", None, fsdp, free_bytes=199) == "per_forward"
    assert ug.rollout_gather("auto", None, fsdp, free_bytes=None) == "once"  # host memory (CPU processes)
    assert ug.rollout_gather("once", None, fsdp, free_bytes=1) == "once"
    assert ug.rollout_gather("per_forward", None, fsdp, free_bytes=10 ** 12) == "per_forward"
    assert ug.rollout_gather("once", None, None, free_bytes=None) == "per_forward"  # no FSDP: nothing to gather
