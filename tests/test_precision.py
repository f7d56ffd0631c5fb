"""Full fine-tuning of a bf16 model keeps fp32 master weights (difrl/train/precision.py); fp16 training is refused.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_precision.py -q

a. One AdamW step at lr 1e-5 on a tiny diffusers pipeline loaded in bf16 moves every weight fp32 moves (the same
   fraction), and an EMA at 0.999 moves as fp32's does; the parameters, gradients, AdamW moments and EMA are fp32,
   the forward computes in bf16 (as the model loaded in bf16 does), the frozen parts and the reference stay bf16.
   Left in bf16 (what the trainer did before), the same step moves a few percent of the weights and the EMA none.
b. LoRA on a bf16 base is left exactly as it was: nothing upcast, no autocast.
c. The flow trainer (tiny SD3, model.dtype=bf16, full fine-tuning, EMA, KL, a stale rollout copy; then DiffusionNFT):
   ratio 1 on the first on-policy micro-step, every checkpointed tensor fp32, transformer/ written in bf16 as the
   EMA weights and loadable with plain diffusers.
d. The masked trainer (hf_masked, model.dtype=bf16): the same; policy.safetensors in bf16.
e. fp16 training (model.dtype=fp16, accelerate's mixed_precision fp16) stops before anything loads, naming the key
   and bf16; the quantized rollout copy's emulation is exact under an autocast.
The FSDP2 path (upcast before sharding, MixedPrecisionPolicy(param_dtype=bf16)) is in tests/test_fsdp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difrl.config import ConfigError  # noqa: E402
from difrl.models.adapters import load_flow_policy, make_tiny_pipeline  # noqa: E402
from difrl.train.config import LoraConfig, TrainConfig, load_flow_config  # noqa: E402
from difrl.train.precision import MasterWeights, upcast_masters  # noqa: E402
from difrl.train.scaffold import clip_and_step, make_optimizer, wrap_policy  # noqa: E402
from difrl.train.run.state import EMA, trainable_params  # noqa: E402
from difrl.utils.io import load_safetensors_checked  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"height": 32, "width": 32, "max_sequence_length": 16}
GUIDANCE = {"flux": 3.5, "sd3": 4.0, "wan": 1.0}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("tiny_precision"), {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = make_tiny_pipeline(kind, root / kind, seed=0)
        return built[kind]

    return get


def load(kind: str, path: Path, dtype: str):
    return load_flow_policy(kind, path, dtype=dtype, **OPTIONS, **({"num_frames": 5} if kind == "wan" else {}))


def one_step(kind: str, path: Path, mode: str) -> dict:
    """One AdamW step (lr 1e-5, the trainer's defaults otherwise) of full fine-tuning and one EMA update at 0.999.
    mode: "masters" (loaded in bf16, upcast_masters), "bf16" (loaded in bf16 and trained as loaded), "fp32" (the
    bf16-rounded weights in fp32, computing in fp32: the same start as the other two)."""
    policy = load(kind, path, "fp32" if mode == "fp32" else "bf16")
    net, reference = wrap_policy(policy, LoraConfig(enabled=False), 0, need_reference=True)
    if mode == "fp32":
        for p in net.parameters():
            p.data = p.data.bfloat16().float()
    masters = upcast_masters(policy, net) if mode == "masters" else MasterWeights()
    params = trainable_params(net)
    before = {k: p.detach().clone() for k, p in params.items()}
    optimizer = make_optimizer(params, TrainConfig(lr=1e-5))
    ema = EMA(params, 0.999)
    gen = torch.Generator().manual_seed(0)
    x, target = (torch.randn(2, *policy.latent_shape, generator=gen) for _ in range(2))
    cond = policy.encode(["a photo of a cat", "a red dog"])
    linear_out = []  # the dtype a linear layer of the transformer computes in
    hook = next(m for m in net.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(
        lambda m, i, o: linear_out.append(o.dtype))
    v = policy.velocity(x, torch.full((2,), 0.7), cond, GUIDANCE[kind])
    hook.remove()
    (v - target).pow(2).mean().backward()
    grads = {p.grad.dtype for p in params.values() if p.grad is not None}
    clip_and_step(optimizer, params, None)
    shadow = {k: s.clone() for k, s in ema.shadow.items()}
    ema.update(0.999)
    n = sum(p.numel() for p in params.values())
    return {"policy": policy, "reference": reference, "masters": masters, "v": v.detach(), "linear_out": linear_out,
            "moved": sum(int((p.detach() != before[k]).sum()) for k, p in params.items()) / n,
            "ema_moved": sum(int((ema.shadow[k] != shadow[k]).sum()) for k in params) / n,
            "params": {p.dtype for p in params.values()}, "grads": grads, "ema": {s.dtype for s in ema.shadow.values()},
            "adam": {t.dtype for st in optimizer.state.values() for t in st.values() if t.is_floating_point() and t.ndim}}


# ---- a. one step of full fine-tuning moves what fp32 moves ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["sd3", "flux", "wan"])
def test_one_adamw_step_of_a_bf16_full_finetune_moves_what_fp32_moves(kind, tiny_dirs):
    path = tiny_dirs(kind)
    fp32, masters, as_loaded = (one_step(kind, path, mode) for mode in ("fp32", "masters", "bf16"))
    print(f"{kind}: weights moved / EMA moved: fp32 {fp32['moved']:.4f} / {fp32['ema_moved']:.4f}, fp32 masters "
          f"{masters['moved']:.4f} / {masters['ema_moved']:.4f}, bf16 as loaded {as_loaded['moved']:.4f} / "
          f"{as_loaded['ema_moved']:.4f}")
    # measured (sd3 / flux / wan): weights moved 0.987 / 1.000 / 1.000 with masters and in fp32 (SD3's dead last-block
    # add_q_proj has no gradient); left in bf16 0.031 / 0.036 / 0.270 (Wan keeps its norms and time embedder in fp32)
    assert masters["moved"] == pytest.approx(fp32["moved"], abs=1e-3) and masters["moved"] > 0.98
    assert masters["ema_moved"] == pytest.approx(fp32["ema_moved"], abs=2e-3) and masters["ema_moved"] > 0.98
    assert as_loaded["moved"] < 0.3 and as_loaded["ema_moved"] < 0.3  # the bug this module fixes
    for state in ("params", "grads", "ema", "adam"):
        assert masters[state] == {torch.float32}, state
    # the forward computes in bf16, as the model loaded in bf16 does (the same velocity up to bf16 rounding)
    assert masters["linear_out"] == [torch.bfloat16] and masters["masters"].compute_dtype == torch.bfloat16
    # bf16 compute either way; only the masters' fp32 rounding differs: 2% of the output's scale (bf16: 0.4% per op)
    torch.testing.assert_close(masters["v"], as_loaded["v"], rtol=0, atol=0.02 * float(as_loaded["v"].abs().max()))
    policy = masters["policy"]
    assert policy.autocast_dtype == policy.dtype == torch.bfloat16  # the adapter still casts its inputs to bf16
    # what is not trained stays as loaded: text encoders and VAE (Wan's VAE is fp32 on purpose), the KL's reference
    assert policy.pipe.text_encoder.dtype == torch.bfloat16
    assert policy.pipe.vae.dtype == as_loaded["policy"].pipe.vae.dtype
    assert {p.dtype for p in masters["reference"].parameters()} == {p.dtype for p in as_loaded["reference"].parameters()}


def test_as_loaded_casts_back_for_saving_and_restores_the_masters(tiny_dirs):
    policy = load("wan", tiny_dirs("wan"), "bf16")
    loaded = {n: p.dtype for n, p in policy.module.named_parameters()}
    assert set(loaded.values()) == {torch.bfloat16, torch.float32}  # diffusers keeps Wan's norms in fp32
    masters = upcast_masters(policy, policy.module)
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(1e-6)  # a master value bf16 cannot hold
    held = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    with masters.as_loaded(policy.module) as module:
        assert {n: p.dtype for n, p in module.named_parameters()} == loaded
    # exact: the fp32 masters come back as they were
    assert all(torch.equal(p, held[n]) and p.dtype == torch.float32 for n, p in policy.module.named_parameters())


def half_casts(params: dict):
    """A dispatch mode that records, by parameter name, the bytes of every half-precision copy of one of `params`
    made inside it (autocast's casts of the fp32 master weights: what the forward computes with)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {p.data_ptr(): n for n, p in params.items()}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if func is torch.ops.aten._to_copy.default and src is not None and src.data_ptr() in names \
                    and out.dtype in (torch.bfloat16, torch.float16):
                self.bytes[names[src.data_ptr()]] = out.numel() * out.element_size()
            return out

    return Casts()


@pytest.mark.parametrize("lora", [False, True])
def test_memory_per_trained_parameter(lora, tiny_dirs):
    # docs/guides/real-models.md's table ("Precision"): bytes per trained parameter after one update with the EMA on, tiny SD3 loaded in
    # bf16. Full fine-tuning: fp32 master weights, gradients, AdamW's two moments and the EMA, plus the bf16 copies
    # autocast makes of the weights during the forward (its cache holds them until the forward returns; those a
    # backward needs stay until it has run). LoRA: the same for each adapter weight (peft keeps them fp32 and computes
    # them in fp32: no half copy); the frozen base holds 2 bytes per parameter and nothing else.
    policy = load("sd3", tiny_dirs("sd3"), "bf16")
    lora_cfg = LoraConfig(rank=2, alpha=4) if lora else LoraConfig(enabled=False)
    net, _ = wrap_policy(policy, lora_cfg, 0, need_reference=False)
    upcast_masters(policy, net)
    params = trainable_params(net)
    optimizer, ema = make_optimizer(params, TrainConfig(lr=1e-5)), EMA(params, 0.999)
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = policy.encode(["a cat", "a dog"])
    with half_casts(params) as casts:
        v = policy.velocity(x, torch.full((2,), 0.7), cond, 4.0)
    v.pow(2).mean().backward()
    n = sum(p.numel() for p in params.values())
    per = {"params": sum(p.numel() * p.element_size() for p in params.values()) / n,
           "grads": sum(p.grad.numel() * p.grad.element_size() for p in params.values()) / n,
           "compute copy": sum(casts.bytes.values()) / n}
    optimizer.step()
    ema.update()
    per["adamw"] = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                       if t.ndim) / n
    per["ema"] = sum(s.numel() * s.element_size() for s in ema.shadow.values()) / n
    frozen = [p for p in net.parameters() if not p.requires_grad]
    print(f"lora={lora}: {n} trained parameters, bytes each: {per}; frozen: {len(frozen)} tensors, "
          f"{sum(p.numel() * p.element_size() for p in frozen) / max(1, sum(p.numel() for p in frozen)):.1f} bytes each")
    assert (per["params"], per["grads"], per["adamw"], per["ema"]) == (4, 4, 8, 4)
    if lora:
        assert per["compute copy"] == 0 and {p.dtype for p in frozen} == {torch.bfloat16}
    else:  # on the CPU autocast casts every trained tensor here (linear / conv weights and biases, norms): 2 bytes
        assert per["compute copy"] == 2


def test_gradient_checkpointing_recomputes_under_the_same_autocast(tiny_dirs):
    # why autocast and not a bf16 copy swapped in around the forward: a checkpointed block is recomputed inside the
    # backward, where torch.utils.checkpoint replays the autocast state; the gradients are the same as without it
    grads = {}
    for checkpointing in (False, True):
        policy = load("sd3", tiny_dirs("sd3"), "bf16")
        net, _ = wrap_policy(policy, LoraConfig(enabled=False), 0, need_reference=False)
        upcast_masters(policy, net)
        if checkpointing:
            policy.enable_gradient_checkpointing()
        net.train()
        x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
        policy.velocity(x, torch.full((2,), 0.7), policy.encode(["a cat", "a dog"]), 4.0).pow(2).mean().backward()
        grads[checkpointing] = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for n, g in grads[False].items():
        assert g.dtype == torch.float32 and torch.equal(grads[True][n], g), n  # exact: recomputed with the same ops


# ---- b. LoRA is left alone ---------------------------------------------------------------------------------------

def test_lora_on_a_bf16_base_is_left_exactly_as_it_was(tiny_dirs):
    policy = load("sd3", tiny_dirs("sd3"), "bf16")
    net, _ = wrap_policy(policy, LoraConfig(rank=2, alpha=4), 0, need_reference=False)
    dtypes = {n: p.dtype for n, p in net.named_parameters()}
    masters = upcast_masters(policy, net)
    assert masters == MasterWeights() and policy.autocast_dtype is None
    assert {n: p.dtype for n, p in net.named_parameters()} == dtypes
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}  # peft keeps the adapters in fp32
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}


# ---- c. d. the trainers ---------------------------------------------------------------------------------------------

SMALL = ["threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "sampler.num_steps=3", "eval.num_steps=3",
         "eval.per_digit=1", "train.micro_batch=4", "train.grad_accum=2", "model.dtype=bf16", "train.lora.enabled=false"]


def checkpoint_dtypes(ckpt: Path) -> dict[str, set]:
    out = {f.stem: {v.dtype for v in load_safetensors_checked(f, f.stem)[0].values()}
           for f in ckpt.glob("*.safetensors") if f.stem != "rng"}
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    out["optimizer"] = {v.dtype for st in opt["state"].values() for v in st.values() if torch.is_tensor(v) and v.ndim}
    return out


def first_step_ratios(run: Path) -> list[float]:
    return [json.loads(ln)["first_step_max_abs_log_ratio"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_flow_trainer_full_finetune_in_bf16(tiny_dirs, tmp_path):
    from diffusers import SD3Transformer2DModel

    from difrl.train.flow.trainer import train

    path = tiny_dirs("sd3")
    common = [*SMALL, "model.kind=sd3", f"model.path={path}", "sampler.guidance=4.0"]
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*common, "train.iterations=2", "train.ema_decay=0.9",
                                                                  "train.kl_beta=0.1", "rollout.sync_every=2"])
    run = Path(train(cfg, tmp_path / "grpo")["run_dir"])
    assert first_step_ratios(run) == [0.0, 0.0]  # rollouts and training compute alike (bf16 under autocast)
    saved = checkpoint_dtypes(run / "checkpoints" / "iter-000002")
    assert saved == {"trainable": {torch.float32}, "ema": {torch.float32}, "rollout_source": {torch.float32},
                     "optimizer": {torch.float32}}
    # transformer/: the EMA weights in bf16, the dtype the base was loaded in; a plain diffusers model directory
    ema = load_safetensors_checked(run / "checkpoints" / "iter-000002" / "ema.safetensors", "ema")[0]
    loaded = SD3Transformer2DModel.from_pretrained(run / "transformer", torch_dtype=torch.bfloat16).state_dict()
    written = load_safetensors_checked(run / "transformer" / "diffusion_pytorch_model.safetensors", "transformer")[0]
    assert set(ema) <= set(loaded) and {v.dtype for v in written.values()} == {torch.bfloat16}  # + a pos_embed buffer
    for k, v in ema.items():
        assert torch.equal(loaded[k], v.bfloat16()), k  # exact: the same cast of the same weights

    nft = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*common, "train.iterations=1", "train.objective=nft",
                                                                  "train.clip_low=1e-4", "train.clip_high=1e-4"])
    run = Path(train(nft, tmp_path / "nft")["run_dir"])
    assert checkpoint_dtypes(run / "checkpoints" / "iter-000001") == {
        "trainable": {torch.float32}, "old": {torch.float32}, "optimizer": {torch.float32}}  # NFT's old policy


def test_masked_trainer_full_finetune_in_bf16(tmp_path):
    pytest.importorskip("transformers")
    from difrl.train.masked.trainer import train
    from difrl.train.recipes import load_train_config

    cfg = load_train_config(ROOT / "configs" / "text_arithmetic.yaml", [
        "threads=1", "model.dtype=bf16", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4",
        "train.grad_accum=2", "train.updates_per_epoch=null", "train.inner_updates=2", "train.iterations=1", "train.kl_beta=0.1", "eval.count=4",
        "eval.samples=2", "eval.pass_k=[1]"])
    run = Path(train(cfg, tmp_path / "masked")["run_dir"])
    assert first_step_ratios(run) == [0.0]
    assert checkpoint_dtypes(run / "checkpoints" / "iter-000001") == {"trainable": {torch.float32},
                                                                       "optimizer": {torch.float32}}
    policy = load_safetensors_checked(run / "policy.safetensors", "policy")[0]
    assert {v.dtype for v in policy.values() if v.is_floating_point()} == {torch.bfloat16}


# ---- e. fp16 is refused; the rollout copy stays exact -----------------------------------------------------------------

def test_fp16_training_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from difrl.train.flow.trainer import train as train_flow
    from difrl.train.masked.trainer import train as train_masked
    from difrl.train.masked.config import load_masked_config

    missing = tmp_path / "no_pipeline_here"  # never read: the refusal comes first
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [f"model.path={missing}", "model.dtype=fp16"])
    with pytest.raises(ConfigError, match=r"'model\.dtype' = 'fp16' cannot be trained.*model\.dtype=bf16"):
        train_flow(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"'model\.dtype' = 'fp16'.*model\.dtype=bf16"):
        train_masked(load_masked_config(None, ["model.kind=hf_masked", "model.dtype=fp16"]), tmp_path / "run")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # accelerate launch --mixed_precision fp16
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [f"model.path={missing}"])
    with pytest.raises(ConfigError, match=r"mixed_precision is fp16.*--mixed_precision bf16"):
        train_flow(cfg, tmp_path / "run")
    # the published configs train in bf16 or fp32, and say which in their header
    for yaml in sorted((ROOT / "configs").glob("*.yaml")):
        text = yaml.read_text()
        assert "dtype: fp16" not in text, yaml
        header = "".join(ln for ln in text.splitlines() if ln.startswith("#"))
        assert "Precision:" in header, yaml


def test_quantized_rollout_copy_is_exact_under_autocast():
    from difrl.quant.linear import QuantLinear

    layer = torch.nn.Linear(32, 16)
    q = QuantLinear(layer, "nvfp4")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = q(x)
    assert torch.equal(inside, q(x))  # exact: autocast must not touch the emulated layer's ops
