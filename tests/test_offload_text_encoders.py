"""model.offload_text_encoders (issue 47): the text encoders stay on the host and visit the device only while embedding.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_offload_text_encoders.py -q

This machine has no GPU, so "host" and "device" are told apart two ways:
- loading onto device "meta" (data-free): the transformer goes there, the offloaded text encoders stay on the CPU;
- difrl plan's setting, under its FakeTensorMode (simulation.simulated_device): the encoders' home is "meta" (the simulated host) and the transformer is on
  the (fake) CPU, so the moves around `_encode_batch` are seen as device changes (after setup on meta, inside on the
  transformer's device, after on meta again).
On the CPU for real (home = device = CPU), the embeddings with the option on equal those with it off, bit for bit.
The planner (tiny FLUX, 1 simulated GPU): the resident "frozen" bytes drop by the text encoders' size, and the
rollout's peak (where prompts are embedded) holds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["flux2", "sd3"]
SIZE = dict(height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from difrl.models.adapters import make_tiny_pipeline

    root = tmp_path_factory.mktemp("offload")
    return {kind: make_tiny_pipeline(kind, root / kind) for kind in KINDS}


def encoder_devices(policy) -> set[torch.device]:
    return {t.device for m in policy.text_encoders().values() for t in (*m.parameters(), *m.buffers())}


@pytest.mark.parametrize("kind", KINDS)
def test_load_keeps_text_encoders_off_the_device(kind, tiny):
    """Loaded onto device "meta": the transformer and VAE are there, the text encoders were never moved (CPU)."""
    from difrl.models.adapters import load_flow_policy

    policy = load_flow_policy(kind, tiny[kind], device="meta", offload_text_encoders=True, **SIZE)
    assert policy.text_encoders(), "the tiny pipeline has text encoders"
    assert encoder_devices(policy) == {torch.device("cpu")}
    assert {p.device.type for p in policy.module.parameters()} == {"meta"}
    assert {p.device.type for p in policy.pipe.vae.parameters()} == {"meta"}
    assert all(not p.requires_grad for m in policy.text_encoders().values() for p in m.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_encoders_visit_the_transformers_device_only_while_embedding(kind, tiny):
    """difrl plan's setting: home "meta", transformer on the fake CPU. (a) after setup the encoders are on meta,
    (b) inside `_encode_batch` (prompts and the negative prompt) on the transformer's device, (c) on meta after."""
    from difrl.models.adapters import arch_flow_policy
    from difrl.train.planner.simulation import fake_parameter_swaps, simulated_device

    with simulated_device(), fake_parameter_swaps():  # fake tensors, the host's tokens real (difrl plan's mode)
        policy = arch_flow_policy(kind, tiny[kind], dtype="fp32", offload_text_encoders=True,
                                  text_encoders_home="meta", **SIZE)
        assert encoder_devices(policy) == {torch.device("meta")}  # (a)
        assert {p.device for p in policy.module.parameters()} == {torch.device("cpu")}
        seen = []
        inner = policy._encode_batch

        def recorded(prompts):
            seen.append(encoder_devices(policy))
            return inner(prompts)

        policy._encode_batch = recorded
        cond = policy.encode(["a red cube", "a blue ball"])
        neg = policy.negative_cond(2)
        assert seen == [{policy.device}, {policy.device}]  # (b): once for the prompts, once for the negative prompt
        assert encoder_devices(policy) == {torch.device("meta")}  # (c)
        assert {v.device for v in (*cond.values(), *neg.values())} == {policy.device}  # embeddings on the device


@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_equal_the_option_off(kind, tiny):
    """On the CPU for real: the same encoders run the same ops on the same device, so the embeddings (prompts, with
    and without the cache, and the negative prompt) are bitwise equal to the option off: tolerance 0. The moves
    happen (each _encode_batch sees the encoders on the transformer's device, moved there and back)."""
    from difrl.models import offload
    from difrl.models.adapters import load_flow_policy

    prompts = ["a red cube", "a blue ball", "a red cube"]
    off = load_flow_policy(kind, tiny[kind], offload_text_encoders=False, **SIZE)
    on = load_flow_policy(kind, tiny[kind], offload_text_encoders=True, **SIZE)
    assert off.text_encoders_home is None and on.text_encoders_home == torch.device("cpu")
    moves = []
    move = offload.move_module  # encoders_visiting's moves
    offload.move_module = lambda m, d: (moves.append(torch.device(d)), move(m, d))
    try:
        got = [on.encode(prompts), on.negative_cond(3)]
        on.cache_prompts = off.cache_prompts = not on.cache_prompts
        got.append(on.encode(prompts))
    finally:
        offload.move_module = move
    n_enc = len(on.text_encoders())
    # three embeddings, each: every encoder to the device, then every encoder home
    assert moves == ([on.device] * n_enc + [torch.device("cpu")] * n_enc) * 3
    off.cache_prompts = not off.cache_prompts
    want = [off.encode(prompts), off.negative_cond(3)]
    off.cache_prompts = not off.cache_prompts
    want.append(off.encode(prompts))
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), k


def test_planner_counts_offloaded_encoders_only_while_embedding(tmp_path):
    """Tiny FLUX, LoRA, 1 simulated GPU. With the option the resident "frozen" bytes drop by exactly the text encoders'
    bytes (they live on the simulated host), and the rollout, which embeds the prompts, peaks at least at what is
    resident plus the encoders on the device."""
    from difrl.models.adapters import load_flow_policy, make_tiny_pipeline
    from difrl.train.planner.flow import plan_flow
    from difrl.train.recipes import load_train_config
    from difrl.train.planner.simulation import GIB, module_bytes

    path = make_tiny_pipeline("flux", tmp_path / "flux")
    encoder_bytes = module_bytes(*load_flow_policy("flux", path).text_encoders().values())
    args = [f"model.path={path}", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=2",
            "sampler.num_steps=2", "sampler.rollout_batch=2", "train.micro_batch=2", "train.grad_accum=1",
            "train.lora.enabled=true", "train.lora.rank=2"]
    rows = {flag: plan_flow(load_train_config(ROOT / "configs" / "flux_tiny.yaml",
                                              [*args, f"model.offload_text_encoders={flag}"]), 1, None)
            for flag in (False, True)}
    for phase in ("rollout", "update"):
        off, on = rows[False]["phases"][phase], rows[True]["phases"][phase]
        # GiB floats of integer byte counts: equal to float rounding (1e-9 relative of a few MiB)
        assert (off["frozen_gib"] - on.get("frozen_gib", 0.0)) * GIB == pytest.approx(encoder_bytes, rel=1e-9)
    rollout = rows[True]["phases"]["rollout"]
    resident = sum(v for k, v in rollout.items() if k in ("params_gib", "frozen_gib", "reference_gib", "ema_gib"))
    assert rollout["peak_gib"] * GIB >= resident * GIB + encoder_bytes
    # the transient is the rollout's: the update (no embedding) is below the option-off update by the encoders' bytes,
    # no more (simulation.ResidentBlind: a resident encoder the rollout read is counted once, in "frozen", not again
    # in "activations"); GiB floats of integer byte counts: equal to float rounding
    off, on = rows[False]["phases"]["update"], rows[True]["phases"]["update"]
    assert (off["peak_gib"] - on["peak_gib"]) * GIB == pytest.approx(encoder_bytes, rel=1e-9)
    assert off["activations_gib"] == pytest.approx(on["activations_gib"], rel=1e-9)
