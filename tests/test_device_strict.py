"""Whole training iterations with the policy on a device where a stray host tensor fails, as on GPUs (issue 38).

The CPU tests run several processes over gloo, which takes host tensors in every collective; NCCL refuses them
("Tensors must be CUDA and dense"), so every multi-GPU run of the flow trainer used to crash in its first
iteration while the suite stayed green. Here the policy lives on tests/device_strict.py's emulated device (the
`meta` device, given data by a dispatch mode, refusing what CUDA refuses) and accelerate's Accelerator is replaced
by StrictAccelerator, whose collectives raise on a host tensor. Each trainer runs whole iterations (rollout,
reward, advantages, update, metrics, checkpoint, evaluation, the final save) and its logged rows must equal the
same run on the CPU: the emulation changes where tensors are, not their values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from device_strict import (DEVICE, HostTensorInCollective, OnDevice, StrictAccelerator, emulated_device, host_only,
                           move_to_device)

pytest.importorskip("diffusers")

from difrl.models.adapters import make_tiny_pipeline  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.scaffold import TIMING_KEYS  # noqa: E402
from difrl.utils.collectives import gather, gather_max, reduce  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ the harness itself


def test_the_emulated_device_keeps_values_and_refuses_what_cuda_refuses():
    host = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with emulated_device() as mode:
        x = host.to(DEVICE)
        assert isinstance(x, OnDevice) and x.device == DEVICE
        lin = torch.nn.Linear(4, 2).to(DEVICE)
        y = lin(x).square().sum()
        y.backward()
        assert isinstance(lin.weight.grad, OnDevice)
        # nn.Linear's fused addmm against matmul + add written out: fp32 may round apart (another kernel)
        torch.testing.assert_close(lin.weight.grad.cpu(), 2 * ((x @ lin.weight.T + lin.bias).T @ x).cpu(), rtol=1e-5,
                                   atol=1e-6)
        assert x[torch.tensor([0, 2])].shape == (2, 4)  # host index tensors: allowed, as on CUDA
        with pytest.raises(RuntimeError, match="indices should be"):
            host[torch.tensor([0, 2]).to(DEVICE)]  # a host tensor indexed on the device: refused, as on CUDA
        assert torch.equal((x + torch.tensor(1.0)).cpu(), host + 1)  # a 0-dim host tensor: allowed
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3, 4)
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        reads = mode.host_reads
        float(y), x[:, 0].tolist()
        assert mode.host_reads == reads + 2


def test_a_host_tensor_in_a_collective_fails_and_the_helper_moves_it():
    acc = StrictAccelerator()
    with emulated_device():
        with pytest.raises(HostTensorInCollective, match="accelerator.gather received a tensor on cpu"):
            acc.gather(torch.arange(3))
        out = gather(acc, torch.arange(3))
        assert out.device.type == "cpu" and out.tolist() == [0, 1, 2]  # back where it came from
        on_dev = reduce(acc, torch.ones(2).to(DEVICE))
        assert isinstance(on_dev, OnDevice)
    assert acc.calls == {"gather": 1, "reduce": 1}


def test_gather_max_and_gather_busiest_are_collectives_through_the_device():
    # a host float: every process calls it and gets the largest (NaN if any is NaN), the gather on the device;
    # gather_busiest: the rollout forwards of the busiest process (masked trainer's nfe_rollout), an int
    from difrl.train.masked.plan import gather_busiest

    acc = StrictAccelerator()
    with emulated_device():
        assert gather_max(acc, 2.5) == 2.5 and math.isnan(gather_max(acc, float("nan")))  # one process: its own, exactly
        busiest = gather_busiest(acc, 7)
        assert busiest == 7 and isinstance(busiest, int)
    assert acc.calls == {"gather": 3}


# ------------------------------------------------------------------------------------------ host reads (GPU syncs)


@pytest.mark.parametrize("fmt", ["fp8_row", "nvfp4"])
def test_a_rollout_copy_sync_reads_the_host_a_fixed_number_of_times(fmt):
    # the sync and its verification compare every layer: one host read each was over 1,000 syncs per sync on FLUX
    from difrl.quant import RolloutCopy

    def net(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)], torch.nn.LayerNorm(64))

    reads = {}
    for layers in (2, 8):
        with emulated_device() as mode:
            m = move_to_device(net(layers))
            copy = RolloutCopy(m, fmt)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.5)
            before = mode.host_reads
            copy.sync(m)
            reads[layers] = mode.host_reads - before
    assert reads[2] == reads[8] <= 3, reads


def test_metrics_result_reads_the_host_once_per_table():
    from difrl.train.metrics import Metrics

    acc = StrictAccelerator()
    with emulated_device() as mode:
        m = Metrics(3)
        for name in ("policy_loss", "kl", "clip_high", "clip_low", "approx_kl"):
            m.add(name, torch.rand(4, 3).to(DEVICE), (torch.rand(4, 3) > 0.3).to(DEVICE))
        m.add_ratio(torch.rand(4, 3).to(DEVICE), torch.randint(0, 3, (4, 3)).to(DEVICE), torch.ones(4, 3, dtype=torch.bool).to(DEVICE))
        before = mode.host_reads
        out = m.result(acc)
        assert mode.host_reads - before <= 2 and set(out) >= {"policy_loss", "kl", "ratio_per_step"}
    assert acc.calls == {"reduce": 2}


# ------------------------------------------------------------------------------------------ the flow trainer


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return make_tiny_pipeline("flux", tmp_path_factory.mktemp("pipe") / "flux", seed=0)


SMALL = ["rollout.prompts_per_iter=2", "rollout.group_size=4", "sampler.num_steps=3", "eval.num_steps=3",
         "eval.per_digit=1", "train.iterations=2", "train.micro_batch=4", "train.grad_accum=2", "threads=1",
         "checkpoint_every=1"]
FLOW_METHODS = {
    "flat": [],
    "nft_ema": ["train.objective=nft", "nft.ref_beta=0.1", "train.kl_beta=0", "train.clip_low=1e-4",
                "train.clip_high=1e-4", "train.ema_decay=0.5"],
    "tree": ["rollout.kind=tree", "tree.split_steps=[0]", "tree.factor=4", "train.micro_batch=3"],
    "solrl": ["rollout.kind=solrl", "solrl.candidates=8", "solrl.preview_steps=2", "rollout.precision=fp8_row",
              "rollout.same_init_noise=false"],
    "fp8_copy": ["rollout.precision=fp8_row", "train.kl_beta=0.01"],
    # docs/guides/methods.md: the DPO / DGPO pre-pass gathers deltas, group ids and advantages across processes
    "awm": ["train.objective=awm", "train.clip_low=1e-4", "train.clip_high=1e-4", "train.kl_beta=0.01"],
    "dpo": ["train.objective=dpo", "train.clip_low=1e-4", "train.clip_high=1e-4", "dpo.beta=50"],
    "dgpo": ["train.objective=dgpo", "train.clip_low=1e-4", "train.clip_high=1e-4", "train.kl_beta=0.01"],
    "dppo": ["train.objective=dppo", "train.clip_low=1e-4", "train.clip_high=1e-4", "train.kl_beta=0.01"],
}


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings, nested values flattened to "key/sub" for pytest.approx."""
    def flat(d, pre=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{pre}{k}/"))
            elif isinstance(v, list):
                out.update({f"{pre}{k}/{i}": x for i, x in enumerate(v)})
            elif k not in TIMING_KEYS and not k.startswith("seconds"):
                out[pre + k] = v
        return out

    return [flat(json.loads(ln)) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_flow(path: Path, out: Path, overrides: list[str], monkeypatch, on_device: bool) -> dict:
    import accelerate

    from difrl.train.flow.trainer import train

    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml",
                           [*SMALL, f"model.path={path}", *overrides])
    if not on_device:
        return train(cfg, out_dir=out)
    import difrl.models.adapters as adapters

    def load_on_device(kind, model_path, **options):  # the whole pipeline where a GPU run puts it (policy_device)
        with host_only():  # loading builds on the real meta device first (low_cpu_mem_usage): host semantics
            policy = real_load(kind, model_path, **{**options, "device": None})
        move_to_device(policy.pipe)
        return policy

    real_load = adapters.load_flow_policy
    StrictAccelerator.instances.clear()
    with monkeypatch.context() as m, emulated_device():
        m.setattr(accelerate, "Accelerator", StrictAccelerator)
        m.setattr(adapters, "load_flow_policy", load_on_device)
        summary = train(cfg, out_dir=out)
    (acc,) = StrictAccelerator.instances
    assert acc.calls["gather"] >= 4 * cfg.train.iterations and acc.calls["reduce"] >= cfg.train.iterations, acc.calls
    return summary


@pytest.mark.parametrize("method", sorted(FLOW_METHODS))
def test_flow_trainer_on_a_strict_device_equals_the_cpu_run(method, tiny_flux, tmp_path, monkeypatch):
    overrides = FLOW_METHODS[method]
    on_dev = train_flow(tiny_flux, tmp_path / "device", overrides, monkeypatch, on_device=True)
    on_cpu = train_flow(tiny_flux, tmp_path / "cpu", overrides, monkeypatch, on_device=False)
    # the same kernels, but not always the same memory layouts (views through the wrapper), so sums round apart
    # (2e-7 relative in the first rewards), and advantage normalisation by a reward std of ~0.003 magnifies that
    for dev_row, cpu_row in zip(rows(tmp_path / "device"), rows(tmp_path / "cpu"), strict=True):
        assert dev_row.keys() == cpu_row.keys()
        numbers = {k for k, v in cpu_row.items() if isinstance(v, float)}
        assert {k: dev_row[k] for k in numbers} == pytest.approx({k: cpu_row[k] for k in numbers}, rel=1e-4, abs=1e-6)
        assert {k: v for k, v in dev_row.items() if k not in numbers} == {k: v for k, v in cpu_row.items() if k not in numbers}
    assert on_dev["eval_after"] == pytest.approx(on_cpu["eval_after"], rel=1e-4)
    assert (tmp_path / "device" / "lora" / "pytorch_lora_weights.safetensors").is_file()



# ------------------------------------------------------------------------------------------ the masked trainer


# the text world is the masked world that runs on a GPU (its LM goes to cuda when there is one); Sudoku and the
# digit tokens keep their tiny policies on the CPU by design, as the digits flow world does
MASKED = {
    "text": (ROOT / "configs" / "text_arithmetic.yaml",
             ["seed=3", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=8",
              "train.updates_per_epoch=null", "train.inner_updates=2", "train.iterations=2", "eval.count=4", "eval.samples=2", "eval.pass_k=[1,2]",
              "eval.every=0", "checkpoint_every=1"]),
}


def train_masked(config, overrides: list[str], out: Path, monkeypatch, on_device: bool) -> dict:
    import accelerate

    import difrl.train.masked.trainer as masked
    from difrl.train.masked.config import load_masked_config

    cfg = load_masked_config(config, overrides)
    if not on_device:
        return masked.train(cfg, out_dir=out)
    real_build = masked.build_masked_world

    def build_on_device(cfg):  # the world's policy where a GPU run puts it (the text world: cuda when available)
        with host_only():
            world = real_build(cfg)
        for mod in world.policy.module.modules():  # transformers' hub-kernel switch checks the device's name, and
            if getattr(mod, "_use_kernels", False):  # "meta" is not one it knows (a GPU's "cuda" is): off here
                mod._use_kernels = False
        move_to_device(world.policy.module)
        return world

    StrictAccelerator.instances.clear()
    with monkeypatch.context() as m, emulated_device():
        m.setattr(accelerate, "Accelerator", StrictAccelerator)  # the data-parallel trainer's collectives checked
        m.setattr(masked, "build_masked_world", build_on_device)
        summary = masked.train(cfg, out_dir=out)
    (acc,) = StrictAccelerator.instances
    # per iteration: the gathered scores, failure flags and rollout count, each update's token count, the first
    # micro-step's ratio check and the metrics' reduce
    assert acc.calls["gather"] >= 4 * cfg.train.iterations and acc.calls["reduce"] >= 2 * cfg.train.iterations, acc.calls
    return summary


@pytest.mark.parametrize("world", sorted(MASKED))
def test_masked_trainer_on_a_strict_device_equals_the_cpu_run(world, tmp_path, monkeypatch):
    config, overrides = MASKED[world]
    on_dev = train_masked(config, overrides, tmp_path / "device", monkeypatch, on_device=True)
    on_cpu = train_masked(config, overrides, tmp_path / "cpu", monkeypatch, on_device=False)
    for dev_row, cpu_row in zip(rows(tmp_path / "device"), rows(tmp_path / "cpu"), strict=True):
        assert dev_row.keys() == cpu_row.keys()
        numbers = {k for k, v in cpu_row.items() if isinstance(v, float)}
        assert {k: dev_row[k] for k in numbers} == pytest.approx({k: cpu_row[k] for k in numbers}, rel=1e-4, abs=1e-6)
    assert on_dev["eval_after"] == pytest.approx(on_cpu["eval_after"], rel=1e-4)
