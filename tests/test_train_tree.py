"""The trainer with BranchGRPO tree rollouts (rollout.kind=tree) on tiny digits runs.

    .venv/bin/python -m pytest tests/test_train_tree.py -q

TINY trains 2 prompts x 4 samples in 4 steps; here each prompt is a tree split at steps 0 and 1
(2 x 2 = 4 leaves = the group), whose SDE edges (steps 0..2; the last step is ODE) are the
trained records: 2 + 4 + 4 = 10 per tree, made with 1 + 2 + 4 + 4 = 11 model evaluations.
"""

from __future__ import annotations

import pytest
import torch

from difrl.config import ConfigError
from difrl.train.config import load_flow_config
from difrl.branching import BranchSchedule, nfe, num_trained_edges
from test_train import TINY, latest_weights, metrics, run
from tolerances import FLOW_FIRST_STEP_LOG_RATIO

TREE = ("rollout.kind=tree", "tree.split_steps=[0,1]")


@pytest.mark.parametrize("overrides", [
    (),
    ("tree.noise_scale=3.0",),
    ("tree.noise_scale=3.0", "tree.kappa_logprob=reference", "sampler.kind=dance_sde", "sampler.noise_level=0.3"),
    ("steps.mode=fixed_window", "steps.window_start=0", "steps.window_size=1", "tree.fusion=soft"),  # Mix
    ("sampler.guidance=2.0", "tree.fusion=path_prob", "train.kl_beta=0.1"),
    ("rollout.precision=nvfp4", "correct.method=token_tis"),  # trees from the NVFP4 rollout copy
    ("tree.edge_weight=leaves", "train.kl_beta=0.1"),  # each edge's loss and KL weighted by its leaves
], ids=["plain", "kappa", "kappa_reference_dance", "mix_soft", "cfg_path_prob_kl", "nvfp4_tis", "leaf_weights"])
def test_tree_training_is_on_policy_and_counts_match(tmp_path, overrides):
    _, d = run(tmp_path / "r", *TREE, *overrides)
    row = metrics(d)[0]
    # split edges rescored under their stored std scale
    assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    cfg = load_flow_config(d / "config.yaml")
    sched = BranchSchedule((0, 1))
    sde = torch.tensor([True, True, True, False])
    if cfg.steps.mode == "fixed_window":
        sde = torch.tensor([True, False, False, False])  # window {0} + the split steps 0, 1; steps 2, 3 ODE
    edges = num_trained_edges(sched, 4, sde, trees=2)
    assert row["tree/edges_sampled"] == row["tree/edges_trained"] == row["nfe_train"] // (1 + (cfg.sampler.guidance != 1)) == edges
    evals = nfe(sched, 4, trees=2) * (2 if cfg.sampler.guidance != 1 else 1)
    if cfg.rollout.precision == "fp32":
        assert row["nfe_full"] == evals and row["nfe_lowprec"] == 0
    else:  # tree rollout on the copy, proximal log-probs recomputed at full precision, one per edge
        assert row["nfe_lowprec"] == evals and row["nfe_full"] == edges
        # the NVFP4 copy is another policy (a gap, K3 > 0) and the trained policy passes the independent check
        assert row["correct/kl_k3"] > 0 and row["correct/copy_policy_log_prob_gap"] > 0
        assert row["first_step_policy_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert row["trained_samples"] == 8 and row["tree/edge_adv_abs_mean"] > 0
    assert set(row["ratio_per_step"]) == ({"0", "1"} if cfg.steps.mode == "fixed_window" else {"0", "1", "2"})


def test_forest_trains_every_edge_of_its_roots(tmp_path):
    # tree.roots=2, one split at step 1: 2 prompts x 2 trees x 2 leaves = the groups of 4; per tree the SDE
    # edges are 1 (step 0) + 2 + 2 (steps 1, 2), and the step-0 edges now carry an advantage (two roots per prompt)
    _, d = run(tmp_path / "r", "rollout.kind=tree", "tree.split_steps=[1]", "tree.roots=2")
    row = metrics(d)[0]
    sched, sde = BranchSchedule((1,)), torch.tensor([True, True, True, False])
    assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert row["tree/edges_sampled"] == row["tree/edges_trained"] == row["nfe_train"] == num_trained_edges(sched, 4, sde, trees=4) == 20
    assert row["nfe_full"] == nfe(sched, 4, trees=4)
    assert row["trained_samples"] == 8 and set(row["ratio_per_step"]) == {"0", "1", "2"}
    with pytest.raises(ConfigError, match="2 tree\\(s\\) per prompt .* have 8 leaves, but rollout.group_size=4"):
        load_flow_config(None, [*TINY, *TREE, "tree.roots=2"])


def test_tree_pruning_trains_the_closed_form_number_of_edges(tmp_path):
    # 6 steps, splits at 0 and 1: per tree 2 + 4 edges before the tail, 4 chains x 3 tail edges (steps 2-4)
    six = ("sampler.num_steps=6", "train.micro_batch=4", "train.grad_accum=1")
    cases = {
        (): 2 * 18,
        ("tree.depth_prune=[4,5]",): 2 * (18 - 8),  # child depths 4, 5 = parent steps 3, 4: 4 edges each
        ("tree.width_prune=per_branch",): 2 * (6 + 4),  # best 1 of each chain's 3 tail edges
        ("tree.width_prune=best_worst", "tree.width_ratio=0.5"): 2 * (6 + 6),  # k = 6 of a tree's 12 tail edges
        ("tree.depth_prune=[5]", "tree.width_prune=per_branch"): 2 * (6 + 4),  # 2 chain edges left, keep 1
    }
    for i, (extra, trained) in enumerate(cases.items()):
        _, d = run(tmp_path / f"r{i}", *TREE, *six, *extra)
        row = metrics(d)[0]
        assert row["tree/edges_sampled"] == 2 * 18, extra
        assert row["tree/edges_trained"] == row["nfe_train"] == trained, extra


def test_tree_accumulation_with_a_partial_last_update(tmp_path):
    # 20 edges: updates of 12 and 8 edges, as 2 x 6 + (6 + 2) or 4 x 3 + (3 + 3 + 2) micro-batches
    common = (*TREE, "train.max_grad_norm=0.05", "train.kl_beta=0.2", "train.adam_eps=1.0", "train.lr=1.0",
              "train.weight_decay=0")
    _, a = run(tmp_path / "a", *common, "train.micro_batch=6", "train.grad_accum=2")
    _, b = run(tmp_path / "b", *common, "train.micro_batch=3", "train.grad_accum=4")
    _, init = run(tmp_path / "init", *common, "train.iterations=0")
    wa, wb, w0 = latest_weights(a), latest_weights(b), latest_weights(init)
    moved = 0.0
    for k in wa:
        delta_a, delta_b = wa[k] - w0[k], wb[k] - w0[k]
        moved = max(moved, float(delta_a.abs().max()))
        # a second update leaves lora_A moves of ~1e-6 on weights of ~0.1: compare to fp32 resolution there too
        atol = 1e-4 * float(delta_a.abs().max()) + 2 * torch.finfo(torch.float32).eps * float(w0[k].abs().max())
        torch.testing.assert_close(delta_a, delta_b, rtol=1e-4, atol=atol, msg=k)
    assert moved > 1e-4
    ra, rb = metrics(a)[0], metrics(b)[0]
    for k in ("policy_loss", "kl", "loss", "grad_norm"):
        assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), k


def test_tree_config_errors():
    with pytest.raises(ConfigError, match="have 8 leaves, but rollout.group_size=4"):
        load_flow_config(None, [*TINY, "rollout.kind=tree", "tree.split_steps=[0,1,2]"])
    with pytest.raises(ConfigError, match="train.objective=grpo"):
        load_flow_config(None, [*TINY, *TREE, "train.objective=nft"])
    with pytest.raises(ConfigError, match="random_subset"):
        load_flow_config(None, [*TINY, *TREE, "steps.mode=random_subset"])
    with pytest.raises(ConfigError, match="tree.depth_prune"):
        load_flow_config(None, [*TINY, *TREE, "tree.depth_prune=[0]"])
    with pytest.raises(ConfigError, match="outside the 4 steps"):
        load_flow_config(None, [*TINY, *TREE[:1], "tree.split_steps=[0,4]"])


def test_pruned_tree_updates_per_epoch_count_the_kept_edges(tmp_path, monkeypatch):
    # 6 steps, splits at 0 and 1: 18 SDE edges per tree, 2 trees per process. train.updates_per_epoch counts the
    # updates over the edges that pruning keeps (the ones trained), so micro_batch=auto sizes on them and an
    # explicit micro_batch is checked against them
    import difrl.train.flow.trainer as flow
    from difrl.train.check import plan_summary

    steps = []
    step = flow.optimizer_step
    monkeypatch.setattr(flow, "optimizer_step", lambda *a: (steps.append(1), step(*a)))
    six = (*TREE, "sampler.num_steps=6", "train.grad_accum=1")
    depth = ("tree.depth_prune=[3,4,5]", "train.updates_per_epoch=2")  # child depths 3-5 = steps 2-4: 6 kept per tree
    width = ("tree.width_prune=per_branch", "train.updates_per_epoch=3")  # 6 + 4 kept per tree: 20 = 7 + 7 + 6
    for i, (extra, kept, updates) in enumerate([((*depth, "train.micro_batch=auto"), 12, 2),
                                                ((*depth, "train.micro_batch=6"), 12, 2),
                                                ((*width, "train.micro_batch=auto"), 20, 3)]):
        steps.clear()
        cfg = load_flow_config(None, [*TINY, *six, *extra])
        assert f"{updates} optimizer update(s) per rollout" in plan_summary(cfg, 1), extra
        _, d = run(tmp_path / f"r{i}", *six, *extra)
        assert metrics(d)[0]["tree/edges_trained"] == kept, extra
        assert len(steps) == updates, extra  # optimizer steps in the one iteration (inner_epochs=1)
    with pytest.raises(ValueError, match="make 3 optimizer update\\(s\\) per pass over each process's 12 edges "
                                         "trained after pruning, but train.updates_per_epoch=2"):
        plan_summary(load_flow_config(None, [*TINY, *six, *depth, "train.micro_batch=4"]), 1)
