"""Real scale on a simulated device (issue 46, items 9c and 5): what crosses to the host, and where a policy computes.

    PYTHONPATH=. python -m pytest tests/test_scale_device.py -q

9c. A masked sampler step and the masked trainer's log-probs used to bring the full [B, L, V] logits to the host
(LLaDA-8B: V = 126,464, so 0.5 MB per position per step) and run log_softmax there. Here the policy lives on
tests/device_strict.py's emulated device, which counts every device -> host read and its bytes: a step may bring
back only per-position values (the drawn tokens, their log-probs, the confidences a sampler ranks by), so its bytes
are the same for a 1,000-token and a 126,464-token vocabulary.

5. Under FSDP with CPU offload a parameter's `.device` is its local shard's, the CPU, while the forward runs on the
GPU; a policy that read its device from its parameters sent noise, rollouts and losses to the host. The compute
device is fixed by the trainer (`set_compute_device`, called by difrl.train.scaffold.shard_policy); here a network
whose parameters stay on the host and are copied to the device for each forward (what CPU offload does) must see
its rollouts on the device.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from device_strict import DEVICE, OnDevice, emulated_device, move_to_device
from difrl.discrete.estimators import remask, token_logp
from difrl.discrete.losses import trace_logp
from difrl.discrete.policy import HFMaskedLM, MaskedNetConfig, MaskedTransformer, TinyMaskedPolicy
from difrl.discrete.samplers import eb_sample, emerge_sample, llada_sample
from difrl.models.base import policy_device

LLADA_VOCAB = 126_464  # LLaDA-8B's vocabulary (mask id 126,336)
B, L, PROMPT = 2, 8, 2  # two rows of 8 positions, the first 2 a prompt


def masked_policy(kind: str, vocab: int):
    """A tiny masked policy (hidden size 8) with a `vocab`-token output on the host: difrl's transformer, or a
    transformers BERT behind HFMaskedLM (the adapter LLaDA runs through)."""
    torch.manual_seed(0)
    mask_id = LLADA_VOCAB - 128 if vocab == LLADA_VOCAB else vocab - 1
    if kind == "tiny":
        cfg = MaskedNetConfig(vocab_size=vocab, mask_id=mask_id, seq_len=L, dim=8, layers=1, heads=1, mlp_ratio=1)
        return TinyMaskedPolicy(MaskedTransformer(cfg).eval())
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8,
                     max_position_embeddings=L, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return HFMaskedLM(BertForMaskedLM(cfg).eval(), mask_id, vocab)


def on_device(policy):
    for mod in policy.module.modules():  # transformers' hub-kernel switch does not know the "meta" device's name
        if getattr(mod, "_use_kernels", False):
            mod._use_kernels = False
    move_to_device(policy.module)
    return policy


def start_tokens(mask_id: int) -> torch.Tensor:
    tokens = torch.full((B, L), mask_id, dtype=torch.long)
    tokens[:, :PROMPT] = torch.tensor([[3, 5], [7, 11]])
    return tokens


SAMPLERS = {  # gamma = 0: EB commits one token per row per step whatever the vocabulary (no zero-entropy rows)
    "llada": lambda p, x: llada_sample(p, x, steps=6, block_length=3, temperature=0.9, seeds=1),
    "llada_cfg": lambda p, x: llada_sample(p, x, steps=6, temperature=0.0, cfg_scale=1.5, seeds=1),
    "eb": lambda p, x: eb_sample(p, x, gamma=0.0, temperature=1.0, order="margin", seeds=2),
    "emerge": lambda p, x: emerge_sample(p, x, steps=4, temperature=0.7, seeds=3),
}


def reads_of(fn) -> tuple[object, int, int]:
    """(fn's result, device -> host reads, their bytes) inside an emulated_device block."""
    with emulated_device() as mode:
        reads, nbytes = mode.host_reads, mode.host_bytes
        out = fn()
        return out, mode.host_reads - reads, mode.host_bytes - nbytes


@pytest.mark.parametrize("kind", ["tiny", "hf"])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_masked_sampler_host_bytes_per_step_do_not_grow_with_the_vocabulary(kind, sampler):
    seen = {vocab: sampler_reads(kind, SAMPLERS[sampler], vocab) for vocab in (1_000, LLADA_VOCAB)}
    (nfe, reads, nbytes), big = seen[1_000], seen[LLADA_VOCAB]
    assert big == (nfe, reads, nbytes), seen  # the same copies, the same bytes: nothing of size V crosses
    # per step at most 32 bytes per position: a token (8), its two log-probs (4 + 4), two fp64 ranking keys (8 + 8)
    assert nbytes <= 32 * B * L * nfe, seen


def sampler_reads(kind: str, run, vocab: int) -> tuple[int, int, int]:
    """(forward passes, device -> host reads, their bytes) of one rollout on the device, checked against the CPU."""
    policy = masked_policy(kind, vocab)
    x = start_tokens(policy.mask_id)
    on_cpu = run(policy, x)
    with emulated_device():
        on_device(policy)
    out, reads, nbytes = reads_of(lambda: run(policy, x))
    # the rollout's record is the host's (indices, rewards, the trainer's bookkeeping) and equals the CPU run:
    # the same kernels on the same values, so the drawn tokens are identical
    assert not any(isinstance(t, OnDevice) for t in (out.tokens, out.logp, out.policy_logp, out.step))
    assert torch.equal(out.tokens, on_cpu.tokens) and torch.equal(out.step, on_cpu.step)
    # log-probs: the same kernels, but the wrapper's memory layouts may change a matmul's summation order, so the
    # fp32 logits (and CFG's (1 + w) c - w u) differ by a few ulps: rtol 1e-6 is 8 fp32 ulps of |log p| ~ 10
    torch.testing.assert_close(out.logp, on_cpu.logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.policy_logp, on_cpu.policy_logp, rtol=1e-6, atol=1e-6)
    return out.nfe, reads, nbytes


@pytest.mark.parametrize("kind", ["tiny", "hf"])
def test_trainer_log_probs_stay_on_the_device_and_bring_back_per_token_values(kind):
    # the trained log-probs (token_logp, with their gradient) and the external rollouts' trace_logp
    seen = {vocab: log_prob_reads(kind, vocab) for vocab in (1_000, LLADA_VOCAB)}
    assert seen[LLADA_VOCAB] == seen[1_000], seen
    # token_logp: one [B, L] fp32 copy; trace_logp: one [rows, L] fp32 copy per commit step (6 at most)
    assert seen[1_000][1] <= 4 * B * L * 7, seen


def log_prob_reads(kind: str, vocab: int) -> tuple[int, int]:
    """(device -> host reads, their bytes) of token_logp with its backward and trace_logp, checked against the CPU."""
    est = SimpleNamespace(estimator=SimpleNamespace(kind="coupled", full_view=True), train=SimpleNamespace(inner_updates=2))
    policy = masked_policy(kind, vocab)
    ro = SAMPLERS["llada"](policy, start_tokens(policy.mask_id))
    rm = remask(est, ro.tokens, ro.gen_mask, ~ro.gen_mask, ro.seeds, 1, 0.4, policy.mask_id)

    def log_probs():
        lp = token_logp(est, policy, ro.tokens, rm)
        lp.sum().backward()
        return lp.detach(), trace_logp(policy, ro.tokens, ro.gen_mask, ro.step)

    ref = log_probs()
    ref_grad = [p.grad.clone() for p in policy.module.parameters()]
    policy.module.zero_grad(set_to_none=True)
    with emulated_device():
        on_device(policy)
    (lp, tr), reads, nbytes = reads_of(log_probs)
    assert not isinstance(lp, OnDevice) and not isinstance(tr, OnDevice)  # [B, L] on the caller's (host) device
    # fp32 log_softmax over V on the same kernels: equal up to summation order (1e-5: ~100 fp32 ulps of log V)
    torch.testing.assert_close(lp, ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(tr, ref[1], rtol=0, atol=1e-5)
    with emulated_device():
        grads = [p.grad for p in policy.module.parameters()]
        assert all(isinstance(g, OnDevice) for g in grads)  # the backward ran on the device
        # sums over positions in another order: within 1e-5 of the whole gradient's norm (a bias that a layer norm
        # makes irrelevant has a gradient of pure rounding noise, ~1e-12, so not per tensor)
        scale = float(torch.stack([r.norm() for r in ref_grad]).norm())
        for g, r in zip(grads, ref_grad, strict=True):
            assert float((g.cpu() - r).norm()) <= 1e-5 * scale
    return reads, nbytes


# ------------------------------------------------------------------------------------------ item 5: compute device


class Offloaded(nn.Module):
    """`net` with its parameters on the host, run on copies of them on DEVICE for each forward: FSDP2's CPU offload
    (the shards stay on the CPU, and are copied to the GPU before each all-gather), so the parameters' `.device`
    says cpu while the forward computes on the device."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, *args, **kwargs):
        state = {k: v.to(DEVICE) for k, v in (*self.net.named_parameters(), *self.net.named_buffers())}
        return torch.func.functional_call(self.net, state, args, kwargs)


class _Transformer(nn.Linear):
    config = None  # the adapter keeps it as transformer_config


def every_adapter() -> dict:
    """One policy per adapter base class, its parameters on the host."""
    from difrl.models.diffusers_base import DiffusersFlowPolicy
    from difrl.models.digits import DigitsPolicy
    from difrl.models.video_flow import MovingDigitsPolicy

    pipe = SimpleNamespace(transformer=_Transformer(2, 2), set_progress_bar_config=lambda **kw: None)
    return {"digits": DigitsPolicy.from_checkpoint(), "video": MovingDigitsPolicy.from_checkpoint(),
            "tiny_masked": masked_policy("tiny", 16), "hf_masked": masked_policy("hf", 16),
            "diffusers": DiffusersFlowPolicy(pipe, height=8, width=8)}


@pytest.mark.parametrize("name", ["digits", "video", "tiny_masked", "hf_masked", "diffusers"])
def test_the_compute_device_is_the_one_the_trainer_fixed_not_the_parameters(name):
    policy = every_adapter()[name]
    assert policy.device == policy_device(policy) == torch.device("cpu")  # unset: where the parameters are
    policy.set_compute_device("meta")  # the trainer's accelerator device (a GPU's "cuda:0")
    assert next(policy.module.parameters()).device.type == "cpu"  # nothing moved: only where the forward runs
    assert policy.device == policy_device(policy) == torch.device("meta")


def test_shard_policy_fixes_the_compute_device(monkeypatch):
    # the one place both trainers shard the policy: the accelerator's device becomes the compute device, also under
    # CPU offload where the shards it leaves stay on the host
    from difrl.train import precision

    policy = masked_policy("tiny", 16)
    monkeypatch.setattr(precision, "shard", lambda net, *a, **k: net)  # one process: no process group to shard over
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)  # the summary line is rank 0's
    precision.shard_policy(policy, policy.module, None, SimpleNamespace(), torch.device("meta"))
    assert policy.device == torch.device("meta") and next(policy.module.parameters()).device.type == "cpu"


def test_an_offloaded_flow_policy_rolls_out_on_the_compute_device():
    from difrl.models.digits import DigitsPolicy
    from difrl.rollout import rollout
    from difrl.samplers import sigma_schedule

    prompts, seeds, sigmas = ["a handwritten 3", "a handwritten 7"], torch.arange(2), sigma_schedule(4, 1.0)
    policy = DigitsPolicy.from_checkpoint()
    ref = rollout(policy, prompts, seeds, sigmas, "flow_sde", {"noise_level": 0.7})
    policy.module = Offloaded(policy.module)
    policy.set_compute_device(DEVICE)
    with emulated_device():
        batch = rollout(policy, prompts, seeds, sigmas, "flow_sde", {"noise_level": 0.7})
        assert isinstance(batch.x_final, OnDevice) and isinstance(batch.log_prob_old, OnDevice)
        # the same kernels on the same values: equal to a few fp32 ulps (layouts through the wrapper may differ)
        torch.testing.assert_close(batch.x_final.cpu(), ref.x_final, rtol=1e-5, atol=1e-6)


def test_an_offloaded_masked_policy_samples_on_the_compute_device():
    policy = masked_policy("hf", 64)
    x = start_tokens(policy.mask_id)
    ref = SAMPLERS["llada"](policy, x)
    policy.module = Offloaded(policy.module)
    policy.set_compute_device(DEVICE)
    out, _, nbytes = reads_of(lambda: SAMPLERS["llada"](policy, x))
    assert torch.equal(out.tokens, ref.tokens)
    assert nbytes <= 32 * B * L * out.nfe  # per-position values only: the logits stayed on the device
