"""FLUX.2's guidance checks (difrl/models/flux2.py); the shared checks of every kind (rollout == pipeline, LoRA, bf16,
FSDP) are tests/test_diffusers_models.py, test_train_diffusers.py and test_fsdp_families.py, parametrised over kinds.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_flux2.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

from difrl.models.adapters import load_flow_policy, make_tiny_pipeline  # noqa: E402
from difrl.models.base import forwards_per_step  # noqa: E402

OPTIONS = dict(height=32, width=32, max_sequence_length=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    return {kind: make_tiny_pipeline(kind, root / kind) for kind in ("flux2", "flux2_klein")}


def test_a_step_distilled_klein_refuses_guidance_its_pipeline_would_ignore(tiny):
    # Flux2KleinPipeline ignores guidance_scale when model_index.json says is_distilled (FLUX.2-klein-4B / -9B): a
    # guidance of 4 would silently train and sample without CFG. The base checkpoints (is_distilled false) do CFG.
    policy = load_flow_policy("flux2_klein", tiny["flux2_klein"], **OPTIONS)
    x, sigma, cond = torch.zeros(2, *policy.latent_shape), torch.tensor([0.5, 0.5]), policy.encode(["a", "b"])
    assert forwards_per_step(policy, 4.0) == 2  # a base checkpoint: [uncond; cond]
    policy.pipe.register_to_config(is_distilled=True)
    with pytest.raises(ValueError, match=r"step-distilled .*is_distilled.*guidance=4.0"):
        policy.velocity(x, sigma, cond, guidance=4.0)
    assert forwards_per_step(policy, 1.0) == 1 and policy.velocity(x, sigma, cond, guidance=1.0).shape == x.shape


def test_dev_guidance_on_a_transformer_without_guidance_embedding_is_refused(tiny):
    policy = load_flow_policy("flux2", tiny["flux2"], **OPTIONS)
    x, cond = torch.zeros(2, *policy.latent_shape), policy.encode(["a", "b"])
    assert forwards_per_step(policy, 4.0) == 1  # embedded guidance: no uncond pass
    policy.transformer_config = SimpleNamespace(guidance_embeds=False, num_single_layers=1)
    with pytest.raises(ValueError, match="no guidance embedding"):
        policy.velocity(x, torch.tensor([0.5, 0.5]), cond, guidance=4.0)


def test_sizes_too_small_for_one_latent_patch_are_refused(tiny):
    with pytest.raises(ValueError, match=r"height=2, width=32: FLUX.2 needs both at least 4 pixels"):
        load_flow_policy("flux2_klein", tiny["flux2_klein"], height=2, width=32, max_sequence_length=16)
