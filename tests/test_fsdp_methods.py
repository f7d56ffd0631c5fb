"""BranchGRPO trees, Sol-RL and the rollout copy under FSDP2 (difrl/train/flow/rollout_copy.py, difrl/train/flow/plan.py).

    HF_HUB_OFFLINE=1 python -m pytest tests/test_fsdp_methods.py -q          # the end-to-end ones are marked slow

End to end: `accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2` (2 CPU processes, gloo)
against one plain process (the script run in the test process) with the same global batch (8 samples per
iteration; 1 process accumulates twice the micro-batches of each of the 2), the tiny FLUX pipeline, 3 iterations:
every metric row, the final evaluation and the trained weights, EMA and AdamW moments of the last checkpoint agree
to rtol 1e-5 (tests/test_fsdp.py's helpers and fixture, imported). Three runs, each exercising several things:
a. flat GRPO, **full fine-tuning** (every linear weight moves, so the copy must follow the sharded weights after
   each update), an fp8 rollout copy (per-tensor scales: the copy quantizes each gathered weight whole) synced every
   2 iterations (a stale copy: its source is a sharded EMA), corrected by batch-normalised TIS (token_tis_bn:
   normalised over the whole batch, gathered from both processes, as one process normalises). The forward batch
   (sampler.rollout_batch=4) makes one process's two rollout forwards see the samples each of the two processes
   sees: fp8 scales an activation per tensor, i.e. over its forward batch.
b. Sol-RL, **LoRA** (merged into the copy from the gathered base and adapter shards), stage-1 candidates on an
   fp8_row copy (emulated on CPU; row-wise scales), stage 2 on the sharded policy.
c. BranchGRPO, **LoRA**, one tree per process on the sharded policy, depth pruning that slides at iteration 3 and
   width pruning (best_worst): the trained edges per iteration (4 per tree, then 6) are what the plan's forward
   count says.
Fast: a tree plan or a Sol-RL candidate split that would give the processes different numbers of forwards is
refused before any forward (ConfigError with the counts); the FSDP copy of a sharded network built in a one-process
group equals the copy of the plain network, and its sync is verified.
"""

from __future__ import annotations

import pytest
import torch

from test_fsdp import ROOT, checkpoint_tensors, flux_args, rows, run, run_here, tiny_flux  # noqa: F401
from test_fsdp import assert_same_runs as same_runs

SCRIPT = [str(ROOT / "scripts" / "train_flux.py")]
COPY = ["rollout.quant_min_dim=0"]  # the tiny FLUX's linears are far below the preset's 1000: quantize them all
FLAT_FP8 = ["train.lora.enabled=false", "rollout.precision=fp8", *COPY, "rollout.sync_every=2",
            "sampler.rollout_batch=4", "correct.method=token_tis_bn"]
SOLRL = ["rollout.kind=solrl", "rollout.same_init_noise=false", "solrl.candidates=8", "solrl.preview_steps=2", "solrl.batch=4",
         "rollout.precision=fp8_row", *COPY]
# 4 steps (the last an ODE step): per tree 2 + 4 split edges and 4 tail SDE edges; depth pruning drops the depth-2
# edges (the second split's), from iteration 3 the depth-1 ones; best_worst keeps 2 of the 4 tail edges. One node per
# forward: one process's forward batches then hold what the two processes' hold (the depth-wise advantages of 4
# leaves amplify a last-bit difference of a reward from another forward batch to ~1e-5)
TREE = ["rollout.kind=tree", "rollout.group_size=4", "sampler.num_steps=4", "tree.split_steps=[0,1]", "tree.noise_scale=2.0",
        "tree.depth_prune=[2]", "tree.depth_slide_every=2", "tree.width_prune=best_worst", "tree.width_ratio=0.5",
        "train.micro_batch=6", "sampler.rollout_batch=1"]


def assert_same_runs(a, b, iteration: int = 3) -> None:
    """tests/test_fsdp.py's check (every numeric metric of every row, the final evaluation, every checkpoint tensor
    within rtol 1e-5), with two floors for values that cancel to near 0. The first micro-step's max |log ratio| of
    the trained policy against its own rollout (train.ratio_check) within 1e-6: a maximum over the first micro-batch,
    which holds other samples on 1 and on 2 processes, of values that are 0 up to fp32 rounding (log-probs of order
    1). The policy loss, a mean of -advantage x ratio terms of about adv_std's size that cancel to a few percent of
    it, within 1e-5 x adv_std: the rewards of leaves decoded in another batch (8 on 1 process, 4 on each of 2) differ
    in their last bits (about 1e-7 relative), and the trees' depth-wise advantages over 2-4 nodes carry that into
    the terms, which their cancelling sum then shows at up to 1e-4 of itself (seen: -0.0041126 vs -0.0041132)."""
    same_runs(a, b, iteration, lambda k, row: 1e-6 if k.endswith("max_abs_log_ratio") else
              1e-5 * row["adv_std"] if k in ("loss", "policy_loss") else 1e-7)


def one_and_two(tmp_path_factory, tiny_flux, name: str, extra: list[str], accum_one: int, accum_two: int):
    """The one-process reference and the FSDP run of one config: (its directory, the 2-process directory, output)."""
    base = tmp_path_factory.mktemp(name)
    run_here(SCRIPT, flux_args(tiny_flux, *extra, f"train.grad_accum={accum_one}"), base / "one")  # in this process
    out = run(2, SCRIPT, flux_args(tiny_flux, *extra, f"train.grad_accum={accum_two}"), base / "two")
    return base / "one", base / "two", out


@pytest.fixture(scope="module")
def flat_fp8(tiny_flux, tmp_path_factory):
    return one_and_two(tmp_path_factory, tiny_flux, "flat_fp8", FLAT_FP8, 4, 2)


@pytest.fixture(scope="module")
def solrl(tiny_flux, tmp_path_factory):
    return one_and_two(tmp_path_factory, tiny_flux, "solrl", SOLRL, 4, 2)


@pytest.fixture(scope="module")
def trees(tiny_flux, tmp_path_factory):
    return one_and_two(tmp_path_factory, tiny_flux, "trees", TREE, 2, 1)


# ---------------------------------------------------------------------------------- end to end (2 processes)


@pytest.mark.slow  # two launches of the tiny FLUX pipeline (1 and 2 processes), 2 min on 2 busy cores
def test_flat_fp8_copy_with_correction_full_finetune_equals_one_process(flat_fp8, tiny_flux):
    one, two, out = flat_fp8
    assert "a full copy per process, built one FSDP unit at a time): fp8: 21 of 30 linear layers quantized" in out
    assert_same_runs(one, two)
    r = rows(two)
    # the correction ran on the copy's rollouts (a nonzero copy/policy gap), its weights normalised to mean 1
    assert all(x["correct/copy_policy_log_prob_gap"] > 0 for x in r)
    # full fine-tuning: the trained weights left the base by far more than the tolerance
    from difrl.utils.io import load_safetensors_checked

    base = load_safetensors_checked(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors", "base")[0]
    trained = checkpoint_tensors(two, 3)
    assert max(float((trained[f"trainable/{k}"] - v).abs().max()) for k, v in base.items()) > 1e-3


@pytest.mark.slow  # two launches of the tiny FLUX pipeline (1 and 2 processes), 2 min on 2 busy cores
def test_solrl_fp8_row_candidates_lora_equals_one_process(solrl):
    one, two, out = solrl
    assert "(stage-1 candidates, synced every 1 iteration(s); a full copy per process, built one FSDP unit" in out
    assert_same_runs(one, two)
    r = rows(two)
    # 16 candidates (8 per process) x 2 preview steps on the copy; FLUX's guidance is embedded: one forward a step
    assert all(x["nfe_lowprec"] == 16 * 2 for x in r)
    trained = {k: v for k, v in checkpoint_tensors(two, 3).items() if k.startswith("trainable/")}
    assert trained and all("lora_" in k for k in trained)
    assert max(float(v.abs().max()) for k, v in trained.items() if "lora_B" in k) > 1e-3


@pytest.mark.slow  # two launches of the tiny FLUX pipeline (1 and 2 processes), 2 min on 2 busy cores
def test_branchgrpo_with_pruning_lora_equals_one_process(trees):
    from difrl.train.config import load_flow_config
    from difrl.train.flow.plan import forward_counts, step_masks

    one, two, _ = trees
    assert_same_runs(one, two)
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*TREE, "rollout.prompts_per_iter=2",
                                                                 "rollout.group_size=4", "train.iterations=3"])
    counts = forward_counts(cfg, 2, cfg.tree.schedule(4), step_masks(cfg, 0, 1)[0])
    assert counts[0] == counts[1]
    # the trained edges of every process and iteration: 2 trees x (4, 4, 6) after pruning, of 2 x 10 sampled
    assert [x["tree/edges_trained"] for x in rows(two)] == [8, 8, 12]
    assert all(x["tree/edges_sampled"] == 20 for x in rows(two))


# ---------------------------------------------------------------------------------- fast checks


class _NoForward:
    """A world that fails on any use: the plan must refuse before the model is ever called."""

    def __getattr__(self, name):
        raise AssertionError(f"the plan used the world ({name}) before refusing")


def test_uneven_forward_counts_are_refused_before_any_forward(tmp_path):
    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config
    from difrl.train.flow.plan import plan_flow_iteration

    digits = ROOT / "configs" / "digits.yaml"
    say = lambda msg: None  # noqa: E731
    # 3 trees over 2 processes: one process would train twice the edges of the other (the rollout takes every live
    # node of a step in one forward, so its counts agree)
    cfg = load_flow_config(digits, ["rollout.kind=tree", "tree.split_steps=[0,1]", "rollout.group_size=4",
                                    "rollout.prompts_per_iter=3", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"3 trees \(rollout.prompts_per_iter\) per iteration do not split evenly over "
                                          r"2 processes, so they would run different numbers of policy forwards "
                                          r"\(process 0: trees 2, trained-edge micro-batches \[17\]; process 1: trees 1, trained-edge micro-batches "
                                          r"\[9\]\)\. Every process must run the same forwards: "
                                          r"under FSDP each forward all-gathers") as e:
        plan_flow_iteration(cfg, _NoForward(), 2, tmp_path, say)
    assert e.value.key == "rollout.prompts_per_iter"
    # the same plan on 3 processes splits evenly
    plan_flow_iteration(cfg, _NoForward(), 3, tmp_path, say)
    # a forest (tree.roots=2): 4 prompts x 2 trees split over 4 processes, one forest each (a forest split over
    # processes is refused: tests/test_scale_agreement.py); 3 x 2 trees over 4 do not split evenly, even where one
    # micro-batch holds a process's edges whatever its trees (only the count of trees differs)
    forest = ["rollout.kind=tree", "tree.split_steps=[1]", "tree.roots=2", "rollout.group_size=4", "train.micro_batch=64",
              "train.updates_per_epoch=null"]
    plan_flow_iteration(load_flow_config(digits, [*forest, "rollout.prompts_per_iter=4"]), _NoForward(), 4, tmp_path, say)
    with pytest.raises(ConfigError, match=r"6 trees \(rollout.prompts_per_iter x tree.roots\) per iteration do not split "
                                          r"evenly over 4 processes.*process 0: trees 2; process 1: trees 2; process 2: "
                                          r"trees 1; process 3: trees 1.*Use a multiple of 4 for rollout.prompts_per_iter x "
                                          r"tree.roots"):
        plan_flow_iteration(load_flow_config(digits, [*forest, "rollout.prompts_per_iter=3"]), _NoForward(), 4, tmp_path, say)
    # Sol-RL: 2 prompts x 5 candidates over 4 processes (the samples split, the candidates do not)
    cfg = load_flow_config(digits, ["rollout.kind=solrl", "solrl.candidates=5", "rollout.group_size=4",
                                    "rollout.prompts_per_iter=2", "train.micro_batch=auto", "train.grad_accum=1"])
    with pytest.raises(ConfigError, match=r"10 Sol-RL candidates \(rollout.prompts_per_iter x solrl.candidates\) per "
                                          r"iteration do not split evenly over 4 processes.*process 0: Sol-RL "
                                          r"candidates \d+.*Use a multiple of 4 for rollout.prompts_per_iter x "
                                          r"solrl.candidates") as e:
        plan_flow_iteration(cfg, _NoForward(), 4, tmp_path, say)
    assert e.value.key == "solrl.candidates"


def test_pruning_keeps_equal_counts_per_tree():
    # depth pruning by depth and iteration, width pruning by a count fixed by the tree's shape: every tree, hence
    # every process with as many trees, trains as many edges, whatever the advantages pick
    from difrl.algos.tree import width_prune
    from difrl.branching import build_tree
    from difrl.train.config import load_flow_config
    from difrl.train.flow.plan import _tree_edges_kept, forward_counts, step_masks

    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*TREE, "train.iterations=3"])
    schedule, sde = cfg.tree.schedule(4), step_masks(cfg, 0, 1)[0]
    assert _tree_edges_kept(cfg, schedule, sde) == [6, 4]  # depths {1} (iteration 3), {2} (iterations 1-2)
    tree = build_tree(schedule, 4, 1, sde)
    edges = torch.arange(len(tree.edge_step))[tree.edge_step < 3]  # the SDE edges (the last step is ODE)
    for seed in range(5):  # any advantages: the same number kept
        adv = torch.randn(len(edges), generator=torch.Generator().manual_seed(seed))
        assert int(width_prune(tree, edges, adv, "best_worst", 0.5).sum()) == len(edges) - 2
    cfg = load_flow_config(ROOT / "configs" / "flux_tiny.yaml", [*TREE, "rollout.prompts_per_iter=4"])
    counts = forward_counts(cfg, 2, schedule, sde)
    assert counts[0] == counts[1] and counts[0]["trained-edge micro-batches"] == [2, 2]  # 2 trees x (6 | 4) edges / 6


def test_sharded_copy_equals_the_plain_copy_and_follows_updates():
    # FSDP2 on a one-process gloo group, in this process: the code paths of the sharded copy (meta skeleton, one
    # gathered unit per part, LoRA merged from the gathered base and adapters) build and sync the same copy as a deep
    # copy of the plain network; after an update (and a forward that left the units gathered) the sync moves both
    # alike and verifies; a sync that skips a layer is caught
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from difrl.quant import RolloutCopy
    from difrl.quant.linear import QuantLinear
    from difrl.quant.sync import WeightSyncError
    from difrl.train.flow.rollout_copy import sharded_skeleton, sharded_weights
    from difrl.train.dist.full_tensors import gathered, plain_copy
    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.train.run.state import trainable_params
    from test_fsdp import Net

    def build():
        torch.manual_seed(0)
        return get_peft_model(Net(), LoraConfig(r=2, target_modules=["fc1", "out"], init_lora_weights="gaussian"))

    def same(a: RolloutCopy, b: RolloutCopy):
        sa, sb = a.module.state_dict(), b.module.state_dict()
        assert sa.keys() == sb.keys() and any(".w_" in k for k in sa)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # fsdp_reshard_after_forward: false: a forward leaves the units gathered, and the sync must read the shards
        plain, net = build(), shard(build(), ["Block"], FSDPSettings(reshard_after_forward=False))
        parts = [sorted(p) for p in sharded_weights()(net)]  # one part per unit: each block, then the root's rest
        assert [p[0].split(".")[:2] for p in parts] == [["blocks", "0"], ["blocks", "1"], ["out", "bias"]]
        assert not any("lora" in k for p in parts for k in p)  # merged into the base weights
        ref = RolloutCopy(plain, "fp8_row", min_dim=0)
        copy = RolloutCopy(net, "fp8_row", min_dim=0, weights=sharded_weights(), skeleton=sharded_skeleton(net, {}))
        assert copy.report.quantized == sorted(ref.report.quantized, key=copy.report.quantized.index)
        same(ref, copy)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

        def update(model):  # one SGD step of the LoRA weights
            opt = torch.optim.SGD(trainable_params(model).values(), lr=0.5)
            model(x).pow(2).mean().backward()
            opt.step()

        update(plain)
        update(net)
        with gathered(net):
            # one SGD step through a sharded module and a plain one: fp32 in another order
            torch.testing.assert_close(plain_copy(net)(x), plain(x), rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            net(x)  # the units stay gathered
        assert ref.sync(plain)["changed_layers"] > 0 and copy.sync(net)["changed_layers"] > 0
        same(ref, copy)
        stale = copy.module.get_submodule("blocks.1.fc1")
        assert isinstance(stale, QuantLinear)
        real = QuantLinear.update_weight
        QuantLinear.update_weight = lambda self, w, b=None: (torch.zeros((), dtype=torch.bool) if self is stale
                                                             else real(self, w, b))
        try:
            update(net)
            with pytest.raises(WeightSyncError, match=r"layer 'blocks.1.fc1' of the fp8_row copy does not hold"):
                copy.sync(net)
        finally:
            QuantLinear.update_weight = real
    finally:
        dist.destroy_process_group()
