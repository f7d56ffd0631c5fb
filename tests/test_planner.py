"""difrl plan (difrl/train/planner/flow.py) and what it found at real size (issue 46 items 1-3, the clip).

    HF_HUB_OFFLINE=1 python -m pytest tests/test_planner.py -q

- The shipped architectures build (fake tensors, no weights) to the published transformer sizes.
- The planner on the tiny FLUX pipeline at 2 simulated GPUs counts the same parameter, gradient, optimizer-state and
  EMA bytes per process as a real 2-process FSDP run of the same functions (torchrun, gloo): the simulation checked
  against reality where we can run it.
- Item 1: under FSDP2 gradient accumulation keeps the gradients sharded (no unsharded fp32 gradients between the
  micro-steps); with accelerate's no_sync, which a CPU run used to skip, the planner shows them.
- Item 2: each FSDP block takes its inputs in the dtype the model computed them in, as unsharded (tiny FLUX, SD3, Wan).
- Item 3: FSDP setup makes the fp32 masters and the frozen reference one block at a time: its peak stays below the
  model as loaded plus a small fraction, where it used to hold the model four times over.
- The one-all-reduce clip equals torch's clip_grad_norm_.
- The masked trainer (issue 46, LLaDA-8B): the llada-8b architecture has LLaDA-8B's 8.02 B parameters; a plan of the
  text world's masked config has every category and fits; its parameter, AdamW and reference bytes per process equal
  a real 2-process FSDP run of the same masked functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3
# FLUX tiny, full fine-tuning with EMA and a KL reference: 8 samples, 2 per process on 2 processes
TINY = ["threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=2", "sampler.num_steps=3", "sampler.rollout_batch=2",
        "train.micro_batch=2", "train.grad_accum=1", "train.lora.enabled=false", "train.kl_beta=0.1",
        "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory) -> Path:
    from difrl.models.adapters import make_tiny_pipeline

    return make_tiny_pipeline("flux", tmp_path_factory.mktemp("plan") / "flux")


def tiny_cfg(path: Path, extra=()):
    from difrl.train.recipes import load_train_config

    return load_train_config(ROOT / "configs" / "flux_tiny.yaml", [f"model.path={path}", *TINY, *extra])


def test_shipped_architectures_have_the_published_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from difrl.models.adapters import arch_flow_policy
    from difrl.models.arch import ARCHS, arch_dir, parameter_count

    published = {"flux1-dev": 11.90e9, "sd3.5-large": 8.06e9, "wan2.1-t2v-14b": 14.29e9,  # difrl/assets/arch/README.md
                 "sana-1.6b": 1.604e9,  # the SANA paper's 1604M
                 "flux2-dev": 32.22e9, "flux2-klein-base-9b": 9.08e9,
                 "sd3.5-medium": 2.2432e9,  # 2,243,171,520
                 "z-image": 6.155e9,  # 6,154,908,736
                 "qwen-image": 20.43e9,
                 "wan2.2-ti2v-5b": 5.00e9, "wan2.2-t2v-a14b": 14.29e9,  # A14B: each of its two experts
                 "qwen-image-edit": 20.43e9}  # Qwen-Image's transformer
    kinds = {"flux1-dev": "flux", "sd3.5-large": "sd3", "wan2.1-t2v-14b": "wan", "sana-1.6b": "sana",
             "flux2-dev": "flux2", "flux2-klein-base-9b": "flux2_klein", "sd3.5-medium": "sd3", "z-image": "zimage",
             "qwen-image": "qwenimage",
             "wan2.2-ti2v-5b": "wan22", "wan2.2-t2v-a14b": "wan22", "qwen-image-edit": "qwenimage_edit"}
    assert set(ARCHS) == set(published)
    for name, size in published.items():
        with FakeTensorMode(allow_non_fake_inputs=True):
            policy = arch_flow_policy(kinds[name], arch_dir(name), dtype="bf16", height=256, width=256)
            n = parameter_count(policy.pipe.transformer)
        assert abs(n - size) / size < 0.001, (name, n)  # the table's two decimals
        assert {p.dtype for p in policy.pipe.transformer.parameters()} == {torch.bfloat16}
        if name == "qwen-image-edit":  # Qwen2.5-VL-7B with its vision tower (Qwen-Image's text encoder): 8.29 B
            assert abs(parameter_count(policy.pipe.text_encoder) - 8.29e9) / 8.29e9 < 0.001
        if name == "wan2.2-t2v-a14b":  # the trained module holds both experts, of one shape
            assert parameter_count(policy.pipe.transformer_2) == n and parameter_count(policy.module) == 2 * n


@pytest.fixture(scope="module")
def real_bytes(tiny_flux, tmp_path_factory) -> dict:
    """{"flow": ..., "masked": ...}: the bytes per process that one torchrun job of 2 gloo processes holds after the
    flow trainer's setup and update on the tiny FLUX pipeline (TINY), then the masked trainer's on the text world
    (TINY_MASKED). One launch runs both jobs, one after the other (accelerate's state reset between them, the process
    group kept): the bytes are those of the tensors each job built, which the job before it does not change."""
    out = tmp_path_factory.mktemp("real_bytes")
    for name, text in (("flow_worker.py", WORKER), ("masked_worker.py", MASKED_WORKER), ("worker.py", BOTH_WORKERS)):
        (out / name).write_text(text)
    script = out / "worker.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_FSDP": "true",
           "FSDP_VERSION": "2", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(tiny_flux), json.dumps(TINY), json.dumps(TINY_MASKED),
                           str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {job: json.loads((out / f"{job}.json").read_text()) for job in ("flow", "masked")}


@pytest.mark.slow  # one torchrun job of 2 processes (shared with the masked test below) and a plan, about 40 s on 2 cores
def test_plan_counts_what_two_real_processes_hold(tiny_flux, real_bytes):
    """Parameters, AdamW state, EMA and reference bytes per process: the planner (fake tensors, 2 simulated
    ranks) and a real torchrun job of 2 gloo processes running the same setup and update. Exact: the same shapes."""
    from difrl.train.planner.flow import plan_flow

    row = plan_flow(tiny_cfg(tiny_flux), 2, None)
    real = real_bytes["flow"]
    update = row["phases"]["update"]  # at the update's peak (a backward): the gradients exist
    for key in ("params", "optimizer", "ema", "reference"):
        assert update[f"{key}_gib"] * GIB == pytest.approx(real[key], abs=0.5), key  # bytes: exact (float GiB round trip)
    # gradients: at the tiny model's update peak (a forward) none exist yet; what a process holds at its optimizer step
    # is one fp32 shard per parameter shard, as the planner counts it at FLUX.1-dev's backward peak (and in
    # test_fsdp_accumulation_keeps_gradients_sharded: grads_gib == params_gib)
    assert real["grads"] == real["params"]
    assert row["gpus"] == 2 and row["fits"] is None


GRAD_PROBE = '''
def record_grads(optimizer, params):
    """{"bytes": ...}, filled at each optimizer step with the bytes of the gradients it sees (zeroed right after it)."""
    grads = {}
    _step = optimizer.step
    def step(*a, **kw):
        grads["bytes"] = tensor_bytes([p.grad for p in params.values() if p.grad is not None])
        return _step(*a, **kw)
    optimizer.step = step
    return grads
'''


WORKER = '''
import json, sys
import torch
from accelerate import Accelerator
from difrl.rollout import rollout
from difrl.train.flow.trainer import policy_update, setup_training
from difrl.train.flow.plan import plan_flow_iteration, step_masks
from difrl.train.metrics import Metrics
from difrl.train.planner.simulation import module_bytes, steady_optimizer_state, tensor_bytes
from difrl.train.recipes import load_train_config
from difrl.train.dist.sharded_step import take_fsdp_branches
from difrl.worlds import build_world

def flow_bytes(path, over):
    """The flow job: its bytes per process (a dict)."""
    cfg = load_train_config("configs/flux_tiny.yaml", [f"model.path={path}", *over, "train.ratio_check=false"])
    accelerator = Accelerator(cpu=True)
    take_fsdp_branches(accelerator)
    world = build_world("flux", path, cfg)
    n_total, per_proc, T, _, micro = plan_flow_iteration(cfg, world, 2, None, lambda *a: None)
    tr = setup_training(cfg, world.policy, accelerator)
    steady_optimizer_state(tr.optimizer, tr.params)
    sigmas = world.sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
    sde, train_mask, _ = step_masks(cfg, 0, n_total)
    k = torch.arange(per_proc)
    batch = rollout(world.policy, world.prompts[:per_proc], k + 7, sigmas, cfg.sampler.kind, cfg.sampler.kernel_kwargs(),
                    sde, train_mask[:per_proc], k, k, k + 7, cfg.sampler.guidance)
    grads = record_grads(tr.optimizer, tr.params)
    policy_update(cfg, world.policy, tr, accelerator, batch, torch.zeros(per_proc), torch.ones(per_proc, dtype=torch.bool),
                  None, T, micro, 0, Metrics(cfg.sampler.num_steps), None)
    opt = sum(tensor_bytes(v for v in st.values() if torch.is_tensor(v)) for st in tr.optimizer.state.values())  # moments and step
    row = {"params": module_bytes(tr.net), "grads": grads["bytes"], "optimizer": opt,
           "ema": tensor_bytes(tr.ema.shadow.values()), "reference": module_bytes(tr.reference)}
    return row, accelerator
''' + GRAD_PROBE


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_accumulation_keeps_gradients_sharded(tiny_flux, monkeypatch):
    """Item 1: two micro-steps per update under FSDP2 (2 simulated GPUs): the gradients between them are the sharded
    ones only. With accelerate's no_sync, as the trainer called it before (a no-op on CPU processes, which never took
    accelerate's FSDP branch), FSDP2 keeps unsharded fp32 gradients of the whole network on every process."""
    import difrl.train.flow.trainer as flow
    from difrl.train.planner.flow import plan_flow

    cfg = tiny_cfg(tiny_flux, ["train.grad_accum=2", "train.micro_batch=1"])
    row = plan_flow(cfg, 2, None)
    assert row["unsharded_grads_gib"] == 0 and row["grads_gib"] == pytest.approx(row["params_gib"], rel=1e-9)  # float64

    def old_grad_sync(accelerator, net, sharded, sync):  # the code before the fix
        from contextlib import nullcontext

        return nullcontext() if sync else accelerator.no_sync(net)

    monkeypatch.setattr(flow, "grad_sync", old_grad_sync)
    old = plan_flow(cfg, 2, None)
    # the whole fp32 network's gradients (2 x the shards of 2 processes), held unsharded beside the sharded ones
    assert old["unsharded_grads_gib"] >= 1.9 * row["grads_gib"]


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan", "flux2", "flux2_klein"])
def test_fsdp_blocks_take_inputs_in_the_dtype_the_model_computed(kind, one_process_group):
    """Item 2: the dtype of every floating input of every transformer block (tuples too: FLUX's rotary (cos, sin)),
    sharded with bf16 mixed precision (model.dtype=bf16: fp32 masters, autocast) and unsharded: the same. Before the
    fix FSDP2 cast every block's inputs to bf16 (cast_forward_inputs on every unit)."""
    from torch.utils import _pytree as pytree

    from difrl.models.adapters import ADAPTERS, build_tiny_pipeline
    from difrl.train.precision import trained_network
    from difrl.train.dist.sharding import FSDPSettings

    def block_dtypes(policy, sharded: bool):
        pipe = build_tiny_pipeline(kind)
        pipe.transformer.to(torch.bfloat16)
        pol = ADAPTERS[kind](pipe, height=32, width=32, **({"num_frames": 5} if kind == "wan" else {}))
        settings = FSDPSettings(mixed_precision="bf16") if sharded else None
        lora = type("Lora", (), {"enabled": False})()
        trained_network(pol, lora, 0, False, settings, torch.device("cpu"))
        seen = []
        for block in [m for m in pol.module.modules() if type(m).__name__.removeprefix("FSDP") in pol.block_classes]:
            block.register_forward_pre_hook(
                lambda m, a, kw: seen.append([t.dtype for t in pytree.tree_leaves((a, kw))
                                              if torch.is_tensor(t) and t.is_floating_point()]), with_kwargs=True)
        lat = (1, *pol.latent_shape)
        with torch.no_grad():
            pol.velocity(torch.randn(lat), torch.tensor([0.7]), pol.encode(["a red cube"]), 1.0)
        return seen

    plain, sharded = block_dtypes(None, False), block_dtypes(None, True)
    assert len(plain) == len(sharded) > 0
    assert sharded == plain, (kind, plain, sharded)


def test_fsdp_setup_holds_no_whole_second_copy():
    """Item 3: full fine-tuning of a bf16 model with a KL reference under FSDP2 on 8 simulated GPUs. Setup's peak is
    the model as loaded plus at most one block's fp32 masters and the shards (it was the model as loaded, a full
    reference copy and full fp32 masters, about 4x). A FLUX-shaped transformer of 12 single blocks on fake tensors."""
    import diffusers
    from torch.distributed._tools.mem_tracker import MemTracker

    from difrl.train.planner.simulation import Memory, simulated_device, simulated_processes
    from difrl.train.precision import trained_network
    from difrl.train.dist.sharding import fsdp_settings

    class Policy:  # what trained_network reads of an adapter
        block_classes = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
        autocast_dtype = None

        def __init__(self, module):
            self.module = module

    lora = type("Lora", (), {"enabled": False})()
    with simulated_processes(8) as accelerator, simulated_device():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = diffusers.FluxTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=12,
                                                     attention_head_dim=64, num_attention_heads=8,
                                                     joint_attention_dim=256, pooled_projection_dim=64,
                                                     axes_dims_rope=(8, 28, 28))
        finally:
            torch.set_default_dtype(torch.float32)
        loaded = sum(p.numel() * 2 for p in model.parameters())
        block = max(sum(p.numel() for p in b.parameters()) for b in model.single_transformer_blocks) * 4
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            net, reference, masters, fsdp = trained_network(Policy(model), lora, 0, True, fsdp_settings(accelerator),
                                                            accelerator.device)
        peak = Memory._categories(tracker.get_tracker_snapshot("peak"), Memory.PLAIN)
    assert reference is not None and fsdp is not None and masters.compute_dtype == torch.bfloat16
    total = sum(peak.values())
    # loaded + one fp32 block + its bf16 original + the shards (fp32 net, bf16 reference: 6 bytes per parameter / 8)
    assert total <= loaded + 1.5 * block + 6 / 2 / 8 * loaded + 2**20, (total / loaded, block / loaded)


def test_sharded_clip_equals_torch_clip(one_process_group):
    """One all-reduce of the shards' sums of squares: the same norm and clipped gradients as torch's clip_grad_norm_ on
    the full gradients (a one-process group: the shard is the whole tensor). fp32 sums in another order: rtol 1e-6."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from difrl.train.dist.sharded_step import clip_sharded_grad_norm_

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=g) * 3, torch.randn(11, generator=g)]
    mesh = init_device_mesh("cpu", (1,))
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(x), mesh, [Shard(0)])) for x in grads]
    for p, x in zip(params, grads):
        p.grad = distribute_tensor(x.clone(), mesh, [Shard(0)])
    ref = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(ref, grads):
        p.grad = x.clone()
    norm = clip_sharded_grad_norm_(params, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad.to_local(), r.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # the command's main in this process, two plans, about 15 s
def test_plan_command_writes_the_rows(tiny_flux, tmp_path, capsys):
    """`difrl plan CONFIG key=value --gpus N --gpu-memory GiB --json PATH` on the tiny FLUX pipeline: a row per GPU
    count with the keys the issue names and one <category>_gib per category. The command's parsing and printing are
    checked through difrl.cli.main in this process (no fresh interpreter: nothing here is about start-up imports)."""
    from difrl.cli import main

    out = tmp_path / "plan.json"
    code = main(["plan", str(ROOT / "configs" / "flux_tiny.yaml"), f"model.path={tiny_flux}", *TINY, "--gpus", "1", "2",
                 "--gpu-memory", "80", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    rows = json.loads(out.read_text())
    assert [r["gpus"] for r in rows] == [1, 2]
    for r in rows:
        assert {"config", "gpus", "gpu_memory_gib", "peak_gib", "setup_peak_gib", "fits", "params_gib", "grads_gib",
                "optimizer_gib", "activations_gib", "reference_gib", "ema_gib", "frozen_gib"} <= r.keys()
        assert r["fits"] is True and r["gpu_memory_gib"] == 80
    assert rows[1]["params_gib"] == pytest.approx(rows[0]["params_gib"] / 2, rel=0.05)  # sharded over 2 (padding)
    assert "fits 80 GiB" in printed.out and "not simulated" in printed.out


def test_plan_of_lora_counts_only_the_adapters_as_trained(tiny_flux):
    """LoRA under FSDP2 (2 simulated GPUs) and on one GPU: AdamW's state and the EMA follow the adapters alone, a
    small fraction of the (frozen, sharded) network's parameters; no reference copy (the base is the reference)."""
    from difrl.train.planner.flow import plan_flow

    cfg = tiny_cfg(tiny_flux, ["train.lora.enabled=true", "train.lora.rank=2"])
    for gpus in (1, 2):
        update = plan_flow(cfg, gpus, None)["phases"]["update"]
        assert update.get("reference_gib", 0.0) == 0.0
        assert 0 < update["optimizer_gib"] < 0.5 * update["params_gib"], (gpus, update)
        assert update["ema_gib"] == pytest.approx(update["optimizer_gib"] / 2, rel=0.05)  # fp32 adapters; AdamW: 2 moments + step


def fsdp_unit_count(tiny: Path) -> int:
    """FSDP units of the tiny FLUX transformer as the trainer shards it: every block, then the root."""
    from difrl.models.adapters import load_flow_policy

    policy = load_flow_policy("flux", tiny, device="cpu")
    blocks = [m for m in policy.module.modules() if type(m).__name__ in policy.block_classes]
    return len(blocks) + 1


def test_rollout_gathers_every_unit_once_when_asked_or_when_it_fits(tiny_flux):
    """9a: under FSDP2 (2 simulated GPUs) a rollout of 3 sampler steps all-gathers every unit before each forward
    (per_forward, FSDP's schedule: 3 all-gathers per unit) or once for the whole rollout (once: 1 per unit, the whole
    network gathered in the rollout's peak). auto chooses once when the gathered network fits half of the simulated
    GPU's free memory, per_forward when it does not."""
    from difrl.train.planner.flow import plan_flow

    units = fsdp_unit_count(tiny_flux)
    rows = {mode: plan_flow(tiny_cfg(tiny_flux, [f"rollout.fsdp_gather={mode}"]), 2, None)
            for mode in ("per_forward", "once")}
    gathers = {m: r["collectives_by_kind"]["rollout"]["dist.all_gather_single"]["count"] for m, r in rows.items()}
    assert gathers == {"per_forward": 3 * units, "once": units}, gathers  # 1 batch of 2 samples, guidance embedded
    assert rows["once"]["rollout_gather"] == "once" and rows["per_forward"]["rollout_gather"] == "per_forward"
    once, per = rows["once"]["phases"]["rollout"], rows["per_forward"]["phases"]["rollout"]
    assert once.get("unsharded_params_gib", 0) > per.get("unsharded_params_gib", 0)  # the whole network, gathered
    big, small = (plan_flow(tiny_cfg(tiny_flux, ["rollout.fsdp_gather=auto"]), 2, gib) for gib in (80, 0.0001))
    assert (big["rollout_gather"], small["rollout_gather"]) == ("once", "per_forward")


def test_copy_sync_gathers_each_unit_once_in_the_copy_dtype(tiny_flux):
    """9b: the fp8 rollout copy of a bf16 full fine-tune (fp32 masters) under FSDP2 (2 simulated GPUs): each sync reads
    the trained weights with one all-gather per FSDP unit, of the weights cast to bf16 (the dtype the copy is made
    from), where it used to all-gather every parameter on its own in fp32 (twice the bytes)."""
    from difrl.models.adapters import load_flow_policy
    from difrl.train.planner.flow import plan_flow

    row = plan_flow(tiny_cfg(tiny_flux, ["model.dtype=bf16", "rollout.precision=fp8"]), 2, None)
    sync = row["collectives_by_kind"]["sync"]
    assert list(sync) == ["dist.all_gather_single"]
    assert sync["dist.all_gather_single"]["count"] == fsdp_unit_count(tiny_flux)
    params = sum(p.numel() for p in load_flow_policy("flux", tiny_flux, device="cpu").module.parameters())
    # the bytes counted are each gathered buffer's (world x padded shards): bf16, the padding at most 1 row a tensor
    assert params * 2 <= sync["dist.all_gather_single"]["gib"] * GIB < params * 2 * 1.1
    assert row["sync_peak_gib"] > 0 and "sync" in row["phases"]


# ---------------------------------------------------------------------------------- the masked trainer (LLaDA-8B)

# the text world's bundled tiny MLM, bf16 (fp32 masters) with a KL reference: 4 samples, 2 per process on 2 processes,
# 2 inner updates x 1 optimizer update x 2 accumulated micro-batches of 1 sequence each
TINY_MASKED = ["threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=2", "train.updates_per_epoch=1",
               "train.grad_accum=2", "train.inner_updates=2", "train.kl_beta=0.1", "model.dtype=bf16"]


def test_llada_8b_architecture_has_its_published_size():
    """difrl/assets/arch/llada-8b: LLaDA-8B's shapes on Llama blocks, 8.02 B parameters (the model card's table) and
    exactly the count the README derives; bf16, untied head, bidirectional attention in every layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from difrl.models.arch import ARCHS, MASKED_ARCHS, arch_dir, build_arch_lm, parameter_count

    assert MASKED_ARCHS == ("llada-8b",) and "llada-8b" not in ARCHS
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, config = build_arch_lm(arch_dir("llada-8b"), torch.bfloat16)
        n = parameter_count(model)
    assert n == 8_015_581_184  # 32 x 218,112,000 + 2 x 126,464 x 4096 + 4096 (difrl/assets/arch/README.md)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.shape == (126_464, 4096) and config["mask_token_id"] == 126_336
    attention = [m for m in model.modules() if hasattr(m, "is_causal")]
    assert len(attention) == 32 and not any(m.is_causal for m in attention) and model.config.is_causal is False


def test_plan_of_the_masked_trainer_has_every_category_and_fits(tmp_path):
    """`difrl plan configs/text_arithmetic.yaml ... --gpus 2 --gpu-memory 80 --json PATH` (the command's main, in this
    process) dispatches a masked config to plan_masked: a row of the planner's schema with every category of a full
    fine-tune with a KL reference under FSDP2, the sampler's configured forwards and the verdict."""
    import argparse

    from difrl.cli.args import load as _load
    from difrl.train.planner.command import main

    out = tmp_path / "plan.json"
    args = argparse.Namespace(config=str(ROOT / "configs" / "text_arithmetic.yaml"), overrides=TINY_MASKED, gpus=[2],
                              gpu_memory=80.0, arch=None, json=str(out))
    assert main(args, _load) == 0
    (row,) = json.loads(out.read_text())
    assert row["trainer"] == "masked" and row["gpus"] == 2 and row["arch"] == "text_mlm_base" and row["fits"] is True
    assert {"config", "gpu_memory_gib", "peak_gib", "setup_peak_gib", "phases", "update_collectives",
            "rollout_collectives", "not_simulated"} <= row.keys()
    update, rollout = row["phases"]["update"], row["phases"]["rollout"]
    for key in ("params", "unsharded_params", "grads", "optimizer", "activations", "reference", "collective_buffers"):
        assert update[f"{key}_gib"] > 0, key
    assert update["unsharded_grads_gib"] == 0  # sharded accumulation (grad_sync), as in the flow trainer
    # sampling: every unit gathered once (rollout_forwards), the bf16 network whole beside the fp32 shards (1/2 of it)
    assert rollout["unsharded_params_gib"] == pytest.approx(rollout["params_gib"], rel=0.01)
    assert row["rollout_forwards"] == 4 and row["rollout_collectives"] == 4  # sampler.steps; 3 blocks + the root
    assert row["micro_steps"] == 4 and row["seq_len"] == 13  # 2 x 1 x 2; "[BOS]<|user|>07+45=<|assistant|>" + 4
    assert row["update_peak_gib"] > 0 and row["setup_peak_gib"] > 0


@pytest.mark.slow  # the torchrun job of test_plan_counts_what_two_real_processes_hold (real_bytes) and a plan
def test_masked_plan_counts_what_two_real_processes_hold(real_bytes):
    """The masked trainer's setup and update on the bundled text world: parameters (fp32 master shards), AdamW state
    and the bf16 reference per process, by the planner (fake tensors, 2 simulated ranks) and by a real torchrun job
    of 2 gloo processes running masked.setup_training, old_log_probs and policy_update. Exact: the same shapes."""
    from difrl.train.planner.masked import plan_masked
    from difrl.train.recipes import load_train_config

    row = plan_masked(load_train_config(ROOT / "configs" / "text_arithmetic.yaml", TINY_MASKED), 2, None)
    real = real_bytes["masked"]
    update = row["phases"]["update"]
    for key in ("params", "optimizer", "reference"):
        assert update[f"{key}_gib"] * GIB == pytest.approx(real[key], abs=0.5), key  # bytes: exact (float GiB round trip)
    assert real["grads"] == real["params"] - real["buffers"]  # one fp32 gradient shard per fp32 parameter shard
    assert real["reference"] > 0 and row["fits"] is None


MASKED_WORKER = '''
import json, sys
import torch
from difrl.discrete.samplers import SAMPLERS
from difrl.train.masked.trainer import old_log_probs, policy_update, setup_training
from difrl.train.masked.plan import plan_masked_iteration, processes, rollout_forwards
from difrl.train.metrics import Metrics
from difrl.train.recipes import load_train_config
from difrl.train.planner.simulation import module_bytes, steady_optimizer_state, tensor_bytes
from difrl.utils.rng import mix_seed
from difrl.worlds import build_masked_world

def masked_bytes(over):
    """The masked job: its bytes per process (a dict)."""
    cfg = load_train_config("configs/text_arithmetic.yaml", [*over, "train.ratio_check=false"])
    world = build_masked_world(cfg)
    policy = world.policy
    accelerator, fsdp = processes(policy)
    split = plan_masked_iteration(cfg, accelerator.num_processes, accelerator.process_index)
    tr = setup_training(cfg, policy, accelerator, fsdp)
    steady_optimizer_state(tr.optimizer, tr.params)
    P, G = cfg.rollout.prompts_per_iter, cfg.rollout.group_size
    batch = world.prompts(P, mix_seed(cfg.seed, 0, 1)).repeat(G).select(split.rows)
    seeds = torch.tensor([mix_seed(cfg.seed, 0, 0, int(i)) for i in split.rows], dtype=torch.int64)
    tr.net.eval()
    with rollout_forwards(tr.net, tr.fsdp):
        o = SAMPLERS[cfg.sampler.kind](policy, batch.tokens, batch.cond, seeds=seeds, **cfg.sampler.sampler_kwargs())
    r = old_log_probs(cfg, policy, tr, 0, batch, o.tokens, o.gen_mask, seeds)
    tr.net.train()
    grads = record_grads(tr.optimizer, tr.params)
    S = split.per_proc
    policy_update(cfg, policy, tr, accelerator, split, r, torch.zeros(S), torch.ones(S, dtype=torch.bool),
                  torch.ones(o.tokens.shape), torch.ones(o.tokens.shape, dtype=torch.bool), 0, Metrics())
    opt = sum(tensor_bytes(v for v in st.values() if torch.is_tensor(v)) for st in tr.optimizer.state.values())  # moments and step
    row = {"params": module_bytes(tr.net), "buffers": sum(b.numel() * b.element_size() for b in tr.net.buffers()),
           "grads": grads["bytes"], "optimizer": opt, "reference": module_bytes(tr.reference)}
    return row, accelerator
''' + GRAD_PROBE

BOTH_WORKERS = '''
import json, runpy, sys
from pathlib import Path
from accelerate.state import AcceleratorState, GradientState

path, flow_over, masked_over, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
# each worker in a namespace of its own (both import a setup_training and a policy_update)
flow = runpy.run_path(str(Path(out) / "flow_worker.py"))["flow_bytes"]
masked = runpy.run_path(str(Path(out) / "masked_worker.py"))["masked_bytes"]
for job, run in (("flow", lambda: flow(path, flow_over)), ("masked", lambda: masked(masked_over))):
    row, accelerator = run()
    if accelerator.is_main_process:
        json.dump(row, open(f"{out}/{job}.json", "w"))
    accelerator.wait_for_everyone()
    # the next job's Accelerator starts from a fresh state (its own FSDP branch), on the same process group
    AcceleratorState._reset_state()
    GradientState._reset_state()
'''


def test_plan_splits_samples_into_transitions_as_the_trainer_does(tiny_flux):
    """train.micro_batch not a multiple of a sample's trained steps (2 here): the trainer trains every transition as a
    record (flow.training_records), so a micro-batch of 1 transition is half the forward of a micro-batch of 2 (one
    sample). The planner used to pass the unsplit samples, simulating a whole sample per micro-step (Wan 14B LoRA with
    micro-batch 3 looked three times larger than with 9)."""
    from difrl.train.planner.flow import plan_flow

    one, two = (plan_flow(tiny_cfg(tiny_flux, [f"train.micro_batch={n}"]), 1, None)["phases"]["update"]
                for n in (1, 2))
    assert one["activations_gib"] < 0.75 * two["activations_gib"], (one, two)



def test_plan_of_zimage_sees_each_captions_own_tokens(tmp_path, monkeypatch):
    """Z-Image's transformer attends to each caption's unpadded tokens, which the tokenizer's mask picks: the plan of
    its tiny pipeline runs (a simulated mask could not pick them: aten.nonzero raised DynamicOutputShapeException)
    and every transformer call of the plan sees the prompt's own tokens, not the 64 it is padded to."""
    import diffusers

    from difrl.models.adapters import make_tiny_pipeline
    from difrl.models.tiny import tiny_qwen_tokenizer
    from difrl.train.planner.flow import plan_flow
    from difrl.train.recipes import load_train_config

    tok = tiny_qwen_tokenizer()
    tokens = len(tok(tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False,
                                             add_generation_prompt=True))["input_ids"])  # 20: the chat template's 19
    seen = []
    forward = diffusers.ZImageTransformer2DModel.forward

    def spy(self, x, t, cap_feats, *args, **kwargs):
        seen.append({c.shape[0] for c in cap_feats})
        return forward(self, x, t, cap_feats, *args, **kwargs)

    monkeypatch.setattr(diffusers.ZImageTransformer2DModel, "forward", spy)
    path = make_tiny_pipeline("zimage", tmp_path / "zimage")
    cfg = load_train_config(ROOT / "configs" / "zimage_tiny.yaml", [f"model.path={path}", *TINY, "model.prompts=[a]",
                                                                   "model.max_sequence_length=64"])
    row = plan_flow(cfg, 1, None)
    assert row["phases"]["update"]["activations_gib"] > 0 and seen and all(s == {tokens} for s in seen), seen


def test_plan_of_an_edit_model_gives_its_placeholder_prompts_source_images(tmp_path, monkeypatch):
    """A config whose prompt file is not on this machine is planned on placeholder prompts; an editing family's
    (qwenimage_edit: the adapter's `source_images`) need a source image each, which plain text placeholders lacked (the
    world refused them: model.prompts cannot carry images). The plan of the tiny Qwen-Image-Edit pipeline runs, and
    every embedding reads its source image resized to model.source_size (64: twice the shipped 32x32 sources), so
    the vision tower and the source latents run at the configured size."""
    from difrl.models.adapters import make_tiny_pipeline
    from difrl.models.qwenimage_edit import QwenImageEditPolicy
    from difrl.train.planner.flow import plan_flow
    from difrl.train.recipes import load_train_config

    seen = []
    embed = QwenImageEditPolicy._embed

    def spy(self, texts, images, key):
        seen.append({img.size for img in images})
        return embed(self, texts, images, key)

    monkeypatch.setattr(QwenImageEditPolicy, "_embed", spy)
    path = make_tiny_pipeline("qwenimage_edit", tmp_path / "qwenimage_edit")
    cfg = load_train_config(ROOT / "configs" / "qwenimage_edit_tiny.yaml",
                            [f"model.path={path}", *TINY, "model.prompt_file=/nonexistent/edits.jsonl",
                             "model.source_size=64"])
    row = plan_flow(cfg, 1, None)
    assert row["phases"]["update"]["activations_gib"] > 0 and seen and all(s == {(64, 64)} for s in seen), seen
