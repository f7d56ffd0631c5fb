"""Rollouts stay on the policy's device, and train.micro_batch means transitions in every rollout mode (issue 29).

A CPU machine has one real device, so the policy here lives on PyTorch's `meta` device: its tensors have shapes
but no data, and any copy of one to the host raises ("Cannot copy out of meta tensor"). A rollout that moved a
per-step latent, noise draw, velocity or record to the CPU and back (as one did before: 1.15x pipe() on an H200,
docs/reference/specs/gpu-regime.md) fails here; one that keeps the trajectory on the policy's device runs, and every
stored tensor reports that device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difrl.branching import BranchSchedule
from difrl.models.base import policy_device
from difrl.models.digits import DigitsPolicy
from difrl.rollout import per_transition, regenerate, rollout
from difrl.samplers import sigma_schedule
from difrl.solrl import candidate_pool
from difrl.train.config import load_flow_config
from difrl.train.metrics import Metrics
from difrl.tree_rollout import tree_rollout

META = torch.device("meta")
PROMPTS = ["a handwritten 3", "a handwritten 7"]


def meta_digits() -> DigitsPolicy:
    policy = DigitsPolicy.from_checkpoint()
    policy.net.to(META)
    return policy


def rollout_tensors(batch) -> dict[str, torch.Tensor]:
    return {k: getattr(batch, k) for k in ("x_final", "x", "x_next", "sigma", "sigma_next", "log_prob_old", "mean_old",
                                          "step")} | {f"cond.{k}": v for k, v in batch.cond.items()}


def test_flat_rollout_keeps_the_trajectory_on_the_policy_device():
    policy, N = meta_digits(), 6
    assert policy_device(policy) == META
    sde = torch.ones(N, dtype=torch.bool)
    train = sde.clone()
    train[-1] = False
    batch = rollout(policy, PROMPTS * 2, torch.arange(4), sigma_schedule(N, 1.0), "flow_sde", {"noise_level": 0.7},
                    sde_mask=sde, train_mask=train, batch_size=3)  # two forward chunks per step
    for name, t in rollout_tensors(batch).items():
        assert t.device == META, name
    assert batch.x.shape == (4, N - 1, 64) and batch.log_prob_old.shape == (4, N - 1)
    # ids and seeds are indices and reward keys: they stay on the CPU
    assert batch.seeds.device.type == batch.group_ids.device.type == "cpu"
    again = regenerate(policy, batch, sigma_schedule(N, 1.0), kernel="flow_sde", kernel_kwargs={"noise_level": 0.7},
                       sde_mask=sde, train_mask=train)
    assert again.x_final.device == META


def test_tree_rollout_keeps_nodes_and_edges_on_the_policy_device():
    policy, N = meta_digits(), 5
    tr = tree_rollout(policy, PROMPTS, torch.arange(2), sigma_schedule(N, 1.0), BranchSchedule((0, 2), factor=2),
                      "flow_sde", {"noise_level": 0.7}, split_noise_scale=2.0, batch_size=3)
    for name, t in rollout_tensors(tr.edges).items():
        assert t.device == META, name
    assert tr.x_leaf.device == tr.x0_pred_leaf.device == tr.tree.log_prob.device == META
    assert tr.x_leaf.shape == (2 * 4, 64) and tr.edges.x.shape[1] == 1


def test_solrl_candidates_and_regeneration_stay_on_the_policy_device():
    policy = meta_digits()
    seen = []

    def score(images, prompts, prompt_ids, seeds):  # a reward on another device gets the images once, per stage
        seen.append(images.device)
        return torch.arange(len(prompts), dtype=torch.float32)  # rewards come back on the CPU

    pool = candidate_pool(policy, None, PROMPTS, torch.tensor([0, 1]), seed=0, iteration=0, candidates=4, group_size=2,
                          preview_sigmas=sigma_schedule(3, 1.0), score=score)
    assert seen == [META] and pool.seeds.shape == (4,)
    chosen = rollout(policy, [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, pool.seeds, sigma_schedule(4, 1.0), "flow_sde",
                     {"noise_level": 0.7}, train_mask=torch.tensor([True, True, True, False]))
    assert chosen.x.device == META


def test_diffusers_adapter_rollout_has_no_host_round_trip():
    from difrl.models.sd3 import SD3Policy
    from difrl.models.adapters import build_tiny_pipeline

    policy = SD3Policy(build_tiny_pipeline("sd3"), height=32, width=32, max_sequence_length=16)
    cond = policy.encode(PROMPTS)  # the text encoders stay on the CPU here; the transformer moves to `meta`
    policy.pipe.transformer.to(META)
    assert policy_device(policy) == META
    batch = rollout(policy, PROMPTS, torch.arange(2), policy.sigma_schedule(3), "flow_sde", {"noise_level": 0.9},
                    train_mask=torch.tensor([True, True, False]), cond=cond)
    for name, t in rollout_tensors(batch).items():
        assert t.device == META, name
    assert batch.x.shape == (2, 2, *policy.latent_shape)


def test_per_transition_records_are_the_samples_steps_in_order():
    policy = DigitsPolicy.from_checkpoint()
    train = torch.tensor([True, True, True, False])
    batch = rollout(policy, PROMPTS, torch.arange(2), sigma_schedule(4, 1.0), "flow_sde", {"noise_level": 0.7},
                    train_mask=train)
    batch.extras["log_prob_rollout"] = batch.log_prob_old + 1  # a per-transition extra, as a rollout copy's
    flat = per_transition(batch)
    assert len(flat) == 6 and flat.step.shape == (6, 1)
    for b in range(2):
        for t in range(3):
            r = b * 3 + t
            assert flat.prompts[r] == batch.prompts[b] and int(flat.seeds[r]) == int(batch.seeds[b])
            assert int(flat.step[r, 0]) == int(batch.step[b, t])
            torch.testing.assert_close(flat.x[r, 0], batch.x[b, t], rtol=0, atol=0)  # exact: rows rearranged, copied
            torch.testing.assert_close(flat.log_prob_old[r, 0], batch.log_prob_old[b, t], rtol=0, atol=0)
            torch.testing.assert_close(flat.extras["log_prob_rollout"][r, 0], batch.log_prob_old[b, t] + 1, rtol=0, atol=0)
            torch.testing.assert_close(flat.select(torch.tensor([r])).cond["label"][0], batch.cond["label"][b],
                                       rtol=0, atol=0)
    # the conditioning is held once per sample (a video model's text embeddings, T times over, were tens of GiB),
    # and a micro-batch of rows gets its rows' own
    assert all(flat.cond[k] is batch.cond[k] for k in batch.cond)
    sub = flat.select(torch.tensor([5, 0, 3]))
    assert sub.cond_rows is None and torch.equal(sub.cond["label"], batch.cond["label"][torch.tensor([1, 0, 1])])


def test_metrics_masked_sums_without_a_sync_equal_the_exact_cpu_path(monkeypatch):
    # Metrics sums masked values on the host by boolean selection (exact, as before) and elsewhere by torch.where /
    # weighted index_add (no data-dependent shape, so no sync on a GPU); the second path, forced here on CPU
    # tensors, must give the same means
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(5, 3, generator=g), torch.rand(5, 3, generator=g) > 0.4
    steps = torch.randint(0, 4, (5, 3), generator=g)
    host = Metrics(4)
    host.add("loss", values, mask)
    host.add_ratio(values.exp(), steps, mask)
    monkeypatch.setattr(Metrics, "on_host", staticmethod(lambda t: False))
    device = Metrics(4)
    device.add("loss", values, mask)
    device.add_ratio(values.exp(), steps, mask)
    a, b = host.result(), device.result()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)  # float64 sums, host and device paths in another order
    assert a["ratio_per_step"].keys() == b["ratio_per_step"].keys() and a["ratio_per_step"]
    for j, (mean, std) in a["ratio_per_step"].items():
        assert b["ratio_per_step"][j] == pytest.approx([mean, std], rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------- one micro-batch unit for flat, tree and Sol-RL


def transitions_per_backward(tmp_path: Path, monkeypatch, capsys, *overrides: str) -> tuple[list[int], str]:
    """Train one tiny digits iteration; returns the transitions of every micro-batch's loss and the start-up banner."""
    import difrl.train.flow.trainer as flow
    from test_train import run

    from difrl.train.flow.objectives import grpo_micro_loss as loss  # the real one, not a spy of an earlier call

    seen = []

    def spy(policy, sub, *args, **kwargs):
        seen.append(int(sub.step.numel()))  # records x their steps = transitions through this forward/backward
        return loss(policy, sub, *args, **kwargs)

    monkeypatch.setattr(flow, "grpo_micro_loss", spy)
    run(tmp_path, *overrides)
    banner = next(ln for ln in capsys.readouterr().out.splitlines() if "micro-batch:" in ln)
    return seen, banner


@pytest.mark.parametrize("micro_batch", [6, 4], ids=["whole_samples", "split_samples"])
def test_flat_and_tree_put_the_same_transitions_through_each_backward(tmp_path, monkeypatch, capsys, micro_batch):
    # TINY: 8 samples x 3 trained steps (24 transitions) flat; as trees split at 0 and 1: 2 x 10 edges (transitions)
    keys = (f"train.micro_batch={micro_batch}", "train.grad_accum=1")
    flat, flat_banner = transitions_per_backward(tmp_path / "flat", monkeypatch, capsys, *keys)
    tree, tree_banner = transitions_per_backward(tmp_path / "tree", monkeypatch, capsys, *keys, "rollout.kind=tree",
                                                 "tree.split_steps=[0,1]")
    assert flat == [micro_batch] * (24 // micro_batch)
    assert tree == [micro_batch] * (20 // micro_batch) + ([20 % micro_batch] if 20 % micro_batch else [])
    assert f"micro-batch: {micro_batch} transitions" in flat_banner and f"micro-batch: {micro_batch} transitions" in tree_banner
    assert ("split into single-step records" in flat_banner) == (micro_batch % 3 != 0)


def test_solrl_micro_batches_count_transitions_too(tmp_path, monkeypatch, capsys):
    seen, banner = transitions_per_backward(tmp_path, monkeypatch, capsys, "train.micro_batch=6", "train.grad_accum=1",
                                            "rollout.kind=solrl", "solrl.candidates=8", "solrl.preview_steps=3")
    assert seen == [6] * 4 and "micro-batch: 6 transitions (2 sample(s) x 3 steps)" in banner
