"""Tree rollouts (BranchGRPO, docs/reference/specs/branch-cps-guard.md §1): counting (difrl.branching), the engine
(difrl.tree_rollout), kappa, rescoring (difrl.rollout.recompute), fusion, advantages, pruning.

    pytest tests/test_tree.py -q
"""

import math

import pytest
import torch

from difrl.algos.tree import (depth_prune, depth_pruning_set, depthwise_advantages, edge_advantages, edge_leaf_weights,
                              fuse_rewards,
                              width_prune)
from difrl.branching import BranchSchedule, build_tree, mix_sde_mask, nfe, node_seed, num_edges, num_trained_edges
from difrl.models.base import cond_repeat
from difrl.models.digits import DigitsPolicy, digit_prompt
from difrl.rollout import recompute, rollout, sample_noise
from difrl.samplers import KERNELS, all_but_last, sigma_schedule
from difrl.tree_rollout import tree_rollout

N = 6
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
# Exact float comparisons here: the same ops on the same rows (a tree without splits runs the flat sampler's steps on
# the same 3 rows; recompute is one forward over the same B*T rows either way), values copied, gathered or set (0 for
# ODE edges and flat groups, a clip's bound). Tolerances elsewhere: fp32 latents / log-probs of O(1..10) computed in
# another batch shape or against a float64 re-derivation, a few ulp, stated inline.
from tolerances import FP32_REORDER  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    return DigitsPolicy.from_checkpoint()


def prompts(k=2, first=3):
    return [digit_prompt((first + d) % 10) for d in range(k)]


def brute_nfe(schedule, n):
    return sum(schedule.width(i) for i in range(n))


# ---------------------------------------------------------------------------------- schedule and counts


def test_schedule_validation():
    with pytest.raises(ValueError):
        BranchSchedule((3, 1))
    with pytest.raises(ValueError):
        BranchSchedule((1, 1))
    with pytest.raises(ValueError):
        BranchSchedule((-1, 2))
    with pytest.raises(ValueError):
        BranchSchedule((0,), factor=1)
    with pytest.raises(ValueError):
        nfe(BranchSchedule((0, 6)), 6)  # step 6 is outside [0, 5]
    assert BranchSchedule([0, 3]).split_steps == (0, 3)
    assert BranchSchedule.uniform(4, 20).split_steps == (0, 5, 10, 15)
    assert BranchSchedule((0, 3, 6, 9)).leaves == 16


@pytest.mark.parametrize("splits,factor,n", [((), 2, 6), ((0,), 2, 6), ((1, 4), 2, 6), ((0, 2, 5), 2, 6), ((2,), 3, 6),
                                             ((0, 3, 6, 9), 2, 20), ((5, 19), 3, 20)])
def test_nfe_closed_form_matches_the_structure(splits, factor, n):
    s = BranchSchedule(splits, factor)
    t = build_tree(s, n, num_trees=3)
    evaluated = sum(len(t.nodes_at(d)) for d in range(n))  # every node above the leaves takes one step
    assert nfe(s, n, trees=3) == brute_nfe(s, n) * 3 == evaluated
    assert num_edges(s, n, trees=3) == t.num_nodes - 3 == evaluated + 3 * (s.leaves - 1)
    assert len(t.leaf_node) == 3 * s.leaves


def test_spec_counts_for_branchgrpo_default():
    s = BranchSchedule((0, 3, 6, 9))
    assert nfe(s, 20) == 203 and num_edges(s, 20) == 218  # spec §1.7
    assert nfe(s, 20) / 16 == 12.6875 and num_edges(s, 20) / 16 == 13.625  # exact: integers over 16
    mix = mix_sde_mask(20, s, 0, 4)
    assert mix.nonzero().flatten().tolist() == [0, 1, 2, 3, 6, 9]
    assert num_trained_edges(s, 20, mix) == 34  # the reference's fixed Mix window (§1.7)


@pytest.mark.parametrize("splits,factor", [((), 2), ((0,), 2), ((1, 4), 2), ((0, 2, 5), 2), ((2,), 3)])
def test_engine_counts_evaluations(policy, splits, factor):
    s = BranchSchedule(splits, factor)
    tr = tree_rollout(policy, prompts(2), torch.tensor([11, 12]), sigma_schedule(N), s, batch_size=3)
    assert tr.evaluations == nfe(s, N, trees=2)
    assert tr.forward_calls == sum(math.ceil(2 * s.width(i) / 3) for i in range(N))
    assert tr.tree.num_nodes - 2 == num_edges(s, N, trees=2)
    assert len(tr.edges) == num_trained_edges(s, N, trees=2) == num_edges(s, N, trees=2)  # all steps SDE by default
    assert tr.x_leaf.shape == (2 * s.leaves, 64) and tr.x0_pred_leaf.shape == tr.x_leaf.shape
    assert tr.leaf_tree.tolist() == [0] * s.leaves + [1] * s.leaves
    # leaves in lexicographic path order inside each tree
    paths = [tr.tree.path_of(int(n)) for n in tr.leaf_node[:s.leaves]]
    assert paths == sorted(paths) and len(set(paths)) == s.leaves


# ---------------------------------------------------------------------------------- equivalence and reproducibility


@pytest.mark.parametrize("kernel", ["flow_sde", "dance_sde"])
def test_single_branch_tree_is_the_flat_rollout(policy, kernel):
    sig, p, seeds = sigma_schedule(N), prompts(3), torch.tensor([5, 9, 2])
    mask = all_but_last(N)
    flat = rollout(policy, p, seeds, sig, kernel=kernel, sde_mask=mask, train_mask=mask)
    tr = tree_rollout(policy, p, seeds, sig, BranchSchedule(()), kernel=kernel, sde_mask=mask)
    assert torch.equal(tr.x_leaf, flat.x_final)
    T = flat.step.shape[1]
    e = tr.edges  # tree-major, then step: [3 * T] rows -> [3, T]
    for name in ("x", "x_next", "log_prob_old", "mean_old", "sigma", "sigma_next", "step"):
        got = getattr(e, name)[:, 0].reshape(3, T, *getattr(flat, name).shape[2:])
        assert torch.equal(got, getattr(flat, name)), name
    assert torch.equal(e.seeds.view(3, T), flat.seeds[:, None].expand(3, T))
    assert torch.equal(e.x_final.view(3, T, 64), flat.x_final[:, None].expand(3, T, 64))


def test_single_branch_tree_gives_the_flat_loss(policy):
    # a moved policy (ratio != 1), the same advantage per sample: the PPO-clip loss over the edges (records of
    # one step) equals the flat loss over [B, T], element by element and in the mean
    import copy

    from difrl.algos import ppo_clip_loss

    sig, p, seeds = sigma_schedule(N), prompts(3), torch.tensor([5, 9, 2])
    mask = all_but_last(N)
    flat = rollout(policy, p, seeds, sig, sde_mask=mask, train_mask=mask)
    tr = tree_rollout(policy, p, seeds, sig, BranchSchedule(()), "flow_sde", sde_mask=mask)
    moved = DigitsPolicy(copy.deepcopy(policy.net))
    with torch.no_grad():
        for w in moved.net.parameters():
            w.add_(1e-3 * torch.randn_like(w))
        lp_flat = recompute(moved, flat, "flow_sde").log_prob  # [3, T]
        lp_edge = recompute(moved, tr.edges, "flow_sde").log_prob  # [3 * T, 1]
    adv = torch.tensor([1.0, -0.5, 2.0])
    T = flat.step.shape[1]
    pg_flat, _ = ppo_clip_loss(lp_flat, flat.log_prob_old, adv, 1e-3, 1e-3)
    pg_edge, _ = ppo_clip_loss(lp_edge, tr.edges.log_prob_old, adv.repeat_interleave(T), 1e-3, 1e-3)
    assert (lp_flat - flat.log_prob_old).abs().max() > 1e-4  # the ratio is not trivially 1
    assert torch.equal(pg_edge.view(3, T), pg_flat)
    assert pg_edge.mean() == pg_flat.mean()


def test_node_seeds_follow_the_path(policy):
    s = BranchSchedule((1, 3))
    tr = tree_rollout(policy, prompts(2), torch.tensor([40, 41]), sigma_schedule(N), s)
    t = tr.tree
    for node in range(t.num_nodes):
        root = [40, 41][int(t.tree[node])]
        assert int(tr.node_seed[node]) == node_seed(root, t.path_of(node))
    assert len(set(tr.node_seed[t.leaf_node].tolist())) == 8  # every leaf has its own noise
    # each edge's x_next - mean is its std times the noise drawn from (child seed, step)
    e = tr.edges
    z = torch.stack([sample_noise(e.seeds[i:i + 1], int(e.step[i, 0]), (64,))[0] for i in range(len(e))])
    # fp32: (mean + std z) - mean gives std z back to an ulp of the O(1) latent (~1e-7); 1e-5 leaves room for mean's
    # recomputation order
    torch.testing.assert_close(e.x_next[:, 0] - e.mean_old[:, 0], e.extras["std_old"] * z, rtol=0, atol=1e-5)


def test_node_latents_do_not_depend_on_batching_or_other_prompts(policy):
    sig, s = sigma_schedule(N), BranchSchedule((0, 2, 4))
    kw = dict(kernel="dance_sde", split_noise_scale=2.0, store_nodes=True)
    base = tree_rollout(policy, prompts(2), torch.tensor([7, 8]), sig, s, **kw)
    chunked = tree_rollout(policy, prompts(2), torch.tensor([7, 8]), sig, s, batch_size=3, **kw)
    more = tree_rollout(policy, [digit_prompt(0)] + prompts(2), torch.tensor([99, 7, 8]), sig, s, **kw)
    # the noise is exactly the same; the latents agree up to the CPU matmul's batch-size-dependent blocking
    torch.testing.assert_close(chunked.x_nodes, base.x_nodes, rtol=0, atol=1e-5)
    t, t3 = base.tree, more.tree
    for node in range(t.num_nodes):
        tree, depth, path = int(t.tree[node]), int(t.depth[node]), t.path_of(node)
        other = t3.node_id(tree + 1, depth, path)
        assert t.node_id(tree, depth, path) == node
        assert int(more.node_seed[other]) == int(base.node_seed[node])
        torch.testing.assert_close(more.x_nodes[other], base.x_nodes[node], rtol=0, atol=1e-5)  # batch shape, as above


# ---------------------------------------------------------------------------------- kappa at split steps


def dance_mean_std(x, v, sigma, sigma_next, eta):
    """DanceGRPO step by hand (spec §0): mu = x - D v - (eta^2 D / (2 sigma)) x1^, s = eta sqrt(D)."""
    d = sigma - sigma_next
    x1 = x + (1 - sigma) * v
    return x - d * v - (eta**2 * d / (2 * sigma)) * x1, eta * math.sqrt(d)


@pytest.mark.parametrize("mode", ["actual", "reference"])
def test_kappa_split_edges_log_prob(policy, mode):
    eta, kappa, sig = 0.3, 3.0, sigma_schedule(N)
    kk = {"noise_level": eta}
    tr = tree_rollout(policy, prompts(2), torch.tensor([3, 4]), sig, BranchSchedule((0, 3)), kernel="dance_sde",
                      kernel_kwargs=kk, split_noise_scale=kappa, kappa_logprob=mode)
    e = tr.edges
    split = e.extras["is_split"]
    assert split.sum() == 2 * (2 + 4)  # per tree: 2 edges at step 0, 4 at step 3
    scale = e.extras["logprob_scale"][:, 0]
    assert torch.equal(scale, torch.where(split, torch.tensor(kappa if mode == "actual" else 1.0), torch.tensor(1.0)))
    i = int(split.nonzero()[-1])  # a split edge
    x, xn, step = e.x[i, 0], e.x_next[i, 0], int(e.step[i, 0])
    with torch.no_grad():
        v = policy.velocity(x[None], sig[step:step + 1], {k: c[i:i + 1] for k, c in e.cond.items()}, 1.0)[0]
    mu, s = dance_mean_std(x.double(), v.double(), float(sig[step]), float(sig[step + 1]), eta)
    z = sample_noise(e.seeds[i:i + 1], step, (64,))[0].double()
    # sampled with std kappa * s; fp32 sampler against this float64 re-derivation: a few ulp of O(1) latents
    torch.testing.assert_close(xn.double(), mu + kappa * s * z, rtol=0, atol=1e-5)
    s_lp = kappa * s if mode == "actual" else s
    want = (-((xn.double() - mu) ** 2) / (2 * s_lp**2) - math.log(s_lp) - HALF_LOG_2PI).mean()
    # fp32 mean of 64 log-densities of O(1..10) against float64 (ulp(8) ~ 1e-6 each, and the latents' own rounding)
    assert float(e.log_prob_old[i, 0]) == pytest.approx(float(want), abs=1e-4)
    assert float(e.extras["std_old"][i, 0]) == pytest.approx(s_lp, rel=1e-5)
    # the trainer's recomputation (one forward over all edges, scored with the stored scale) gives ratio 1
    with torch.no_grad():
        out = recompute(policy, e, "dance_sde", kk)
        v_all = policy.velocity(e.x[:, 0], e.sigma[:, 0], cond_repeat(e.cond, 1), 1.0)
    torch.testing.assert_close(out.log_prob, e.log_prob_old, rtol=0, atol=1e-5)  # one forward vs the sampler's: fp32
    # the plain kernel recomputes every edge scored under s: all of them under "reference", only the others under "actual"
    plain = KERNELS["dance_sde"](e.x[:, 0], v_all, e.sigma[:, 0], e.sigma_next[:, 0], action=e.x_next[:, 0], **kk)
    same = (plain.log_prob - e.log_prob_old[:, 0]).abs() < 1e-5
    assert torch.equal(same, ~split if mode == "actual" else torch.ones_like(split))


# ---------------------------------------------------------------------------------- Mix (ODE outside a window)


def test_mix_tree_trains_only_sde_edges(policy):
    sig, s = sigma_schedule(8), BranchSchedule((0, 4))
    mask = mix_sde_mask(8, s, 1, 2)
    assert mask.nonzero().flatten().tolist() == [0, 1, 2, 4]
    tr = tree_rollout(policy, prompts(2), torch.tensor([1, 2]), sig, s, sde_mask=mask, store_nodes=True)
    assert tr.evaluations == nfe(s, 8, trees=2)
    assert len(tr.edges) == num_trained_edges(s, 8, mask, trees=2) == 2 * (2 + 2 + 2 + 4)
    assert set(tr.edges.step[:, 0].tolist()) == {0, 1, 2, 4}
    t = tr.tree
    ode_nodes = t.edge_child[~t.edge_is_sde]
    assert torch.all(t.log_prob[ode_nodes] == 0) and torch.all(t.log_prob[t.edge_child[t.edge_is_sde]] != 0)  # set
    # an ODE edge is the Euler step of its parent
    n = int(ode_nodes[-1])
    par, step = int(t.parent[n]), int(t.step[n])
    xp = tr.x_nodes[par][None]
    with torch.no_grad():
        v = policy.velocity(xp, sig[step:step + 1], policy.encode([prompts(2)[int(t.tree[n])]]), 1.0)
    # the Euler step re-done on one row (another batch shape than the tree's): fp32 rounding of O(1) latents
    torch.testing.assert_close(tr.x_nodes[n], (xp + (sig[step + 1] - sig[step]) * v)[0], rtol=0, atol=1e-5)
    # x0_pred of the leaves: x - sigma v at the last step; with an ODE last step that is the leaf itself
    torch.testing.assert_close(tr.x0_pred_leaf, tr.x_leaf, rtol=0, atol=1e-5)


def test_rollout_select_indexes_edge_extras(policy):
    tr = tree_rollout(policy, prompts(2), torch.tensor([1, 2]), sigma_schedule(N), BranchSchedule((0,)),
                      split_noise_scale=2.0)
    idx = torch.tensor([0, 3, 5])
    sub = tr.edges.select(idx)
    assert len(sub) == 3 and torch.equal(sub.extras["logprob_scale"], tr.edges.extras["logprob_scale"][idx])
    assert torch.equal(sub.extras["edge_index"], tr.trained_edge[idx])


# ---------------------------------------------------------------------------------- fusion and advantages


def small_tree(num_steps=2, splits=(0, 1), trees=1):
    return build_tree(BranchSchedule(splits), num_steps, trees)


def test_fusion_modes_by_hand():
    t = small_tree()  # root 0; depth 1: 1, 2; depth 2: 3, 4 (children of 1), 5, 6 (children of 2)
    assert t.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2]
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert fuse_rewards(t, r).tolist() == [2.75, 1.5, 4.0, 1.0, 2.0, 3.0, 5.0]
    t.log_prob = torch.tensor([0.0, 0.0, math.log(4.0), 0.0, math.log(3.0), 0.0, 0.0])
    pp = fuse_rewards(t, r, "path_prob")  # node 1: 1/4 * 1 + 3/4 * 2; root: 1/5 * 1.75 + 4/5 * 4
    torch.testing.assert_close(pp, torch.tensor([0.2 * 1.75 + 0.8 * 4.0, 1.75, 4.0, 1.0, 2.0, 3.0, 5.0]),
                               **FP32_REORDER)
    soft = fuse_rewards(t, r, "soft", lam=1.0)
    lme = lambda xs, lam=1.0: math.log(sum(math.exp(lam * x) for x in xs) / len(xs)) / lam  # noqa: E731
    torch.testing.assert_close(soft, torch.tensor([lme([1, 2, 3, 5]), lme([1, 2]), lme([3, 5]), 1.0, 2.0, 3.0, 5.0]),
                               **FP32_REORDER)  # fp32 logsumexp against float64 math
    torch.testing.assert_close(fuse_rewards(t, r, "soft", lam=-2.0)[0], torch.tensor(lme([1, 2, 3, 5], -2.0)),
                               **FP32_REORDER)
    torch.testing.assert_close(fuse_rewards(t, r, "soft", lam=1e-5), fuse_rewards(t, r), rtol=0, atol=1e-4)  # lam -> 0
    assert fuse_rewards(t, r, "soft", lam=0.0).tolist() == fuse_rewards(t, r).tolist()


def test_fusion_on_chains_and_uneven_counts():
    # factor 3, splits at 1 and 2 over 4 steps, two trees: a trunk (depth 0-1), chains after the last split
    t = build_tree(BranchSchedule((1, 2), factor=3), 4, 2)
    r = torch.arange(18, dtype=torch.float32) ** 1.5 / 10
    mean, soft = fuse_rewards(t, r), fuse_rewards(t, r, "soft", lam=0.7)
    t.log_prob = torch.randn(t.num_nodes, generator=torch.Generator().manual_seed(0))
    pp = fuse_rewards(t, r, "path_prob")
    for n in range(t.num_nodes):
        lo = int(t.first_leaf[n])
        below = r[lo:lo + int(t.num_leaves[n])].double()  # a node's leaves are contiguous
        assert float(mean[n]) == pytest.approx(float(below.mean()), rel=1e-6)  # fp32 against float64: a few ulp
        assert float(soft[n]) == pytest.approx(float(torch.logsumexp(0.7 * below, 0) - math.log(len(below))) / 0.7, rel=1e-5)
        if t.depth[n] >= 3:  # after the last split every node has one child: path_prob copies it
            assert float(pp[n]) == float(r[lo])  # exact: a copy (weight 1 x the child)
    assert torch.equal(pp[t.nodes_at(0)], pp[t.nodes_at(1)])  # the trunk copies its single child


def test_depthwise_advantages_by_hand():
    t = small_tree(trees=2)
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 7.0, 7.0, 7.0])  # tree 1 has no spread
    adv = depthwise_advantages(t, fuse_rewards(t, r))
    a1 = 1.25 / math.sqrt(2 * 1.25**2)  # depth 1 of tree 0: [1.5, 4], unbiased std
    std2 = math.sqrt(sum((x - 2.75) ** 2 for x in (1, 2, 3, 5)) / 3)
    for (depth, path), want in {(0, ()): 0.0, (1, (0,)): -a1, (1, (1,)): a1}.items():
        assert float(adv[t.node_id(0, depth, path)]) == pytest.approx(want, abs=1e-6)  # fp32 of O(1) values
    leaves0 = adv[t.leaf_node[:4]]
    torch.testing.assert_close(leaves0, torch.tensor([(x - 2.75) / std2 for x in (1, 2, 3, 5)]), rtol=0, atol=1e-6)
    assert torch.all(adv[t.tree == 1] == 0)  # std < 1e-6: zero; roots (one node per depth): zero (set: exact)
    assert torch.all(adv[t.depth == 0] == 0)
    clipped = depthwise_advantages(t, fuse_rewards(t, torch.tensor([0.0, 0, 0, 10, 0, 0, 0, 0])), clip=1.0)
    assert float(clipped.max()) == 1.0


def test_forest_advantages_are_per_prompt_and_depth():
    # tree.roots: a prompt's R trees are normalised together per depth. 16 single-leaf trees (no split) per
    # prompt are flat GRPO: every depth carries the group z-score of the leaf rewards (unbiased std).
    r = torch.randn(32, generator=torch.Generator().manual_seed(3))
    chains = build_tree(BranchSchedule(()), 3, 32)  # 2 prompts x 16 roots, 3 steps
    adv = depthwise_advantages(chains, fuse_rewards(chains, r), roots=16)
    g = r.view(2, 16)
    z = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-8)).flatten()
    for d in range(4):
        torch.testing.assert_close(adv[chains.nodes_at(d)], z, rtol=0, atol=1e-5)
    assert torch.all(depthwise_advantages(chains, fuse_rewards(chains, r)) == 0)  # one tree each: no signal at all
    # 2 prompts x 2 roots, split at step 1: depth 1 has one node per tree but two per prompt, so the first
    # step's edges (depth 1) get the gap between the roots' subtrees; depth 2 normalises the 4 leaves
    t = build_tree(BranchSchedule((1,)), 2, 4)
    r = torch.tensor([1.0, 2.0, 4.0, 6.0, 0.0, 0.0, 3.0, 3.0])
    adv = depthwise_advantages(t, fuse_rewards(t, r), roots=2)
    a1 = 1 / math.sqrt(2)  # two values, unbiased std: +-1/sqrt(2) whatever their gap
    assert adv[t.nodes_at(1)].tolist() == pytest.approx([-a1, a1, -a1, a1], abs=1e-6)  # fp32 vs float64, O(1)
    s = math.sqrt(sum((x - 3.25) ** 2 for x in (1, 2, 4, 6)) / 3)
    assert adv[t.nodes_at(2)][:4].tolist() == pytest.approx([(x - 3.25) / s for x in (1, 2, 4, 6)], abs=1e-6)
    assert torch.all(depthwise_advantages(t, fuse_rewards(t, r))[t.nodes_at(1)] == 0)  # roots=1: a trunk, no signal
    with pytest.raises(ValueError, match=r"roots=3 \(tree.roots, trees per prompt\) must divide"):
        depthwise_advantages(t, fuse_rewards(t, r), roots=3)


def test_edge_advantages_follow_the_child(policy):
    tr = tree_rollout(policy, prompts(2), torch.tensor([1, 2]), sigma_schedule(N), BranchSchedule((0, 2)))
    node_adv = depthwise_advantages(tr.tree, fuse_rewards(tr.tree, torch.randn(8, generator=torch.Generator().manual_seed(1))))
    adv = edge_advantages(tr, node_adv)
    assert adv.shape == (len(tr.edges),)
    child = tr.tree.edge_child[tr.edges.extras["edge_index"]]
    assert torch.equal(adv, node_adv[child])


def test_edge_leaf_weights_make_every_step_weigh_as_in_flat_grpo(policy):
    # tree.edge_weight=leaves: splits at 0 and 2 (x2) over N steps, 2 trees: an edge counts the leaves below its
    # child, so each trained step's weights sum to the 8 leaves (flat GRPO: 8 samples per step), over the mean weight
    tr = tree_rollout(policy, prompts(2), torch.tensor([1, 2]), sigma_schedule(N), BranchSchedule((0, 2)))
    rows = torch.arange(len(tr.edges))
    w = edge_leaf_weights(tr, rows)
    child = tr.tree.edge_child[tr.trained_edge]
    leaves = tr.tree.num_leaves[child].float()
    torch.testing.assert_close(w, leaves / leaves.mean(), **FP32_REORDER)
    assert w.mean().item() == FP32_REORDER.approx(1.0)
    step = tr.tree.edge_step[tr.trained_edge]
    per_step = [float((w * leaves.mean())[step == i].sum()) for i in step.unique().tolist()]
    assert per_step == FP32_REORDER.approx([8.0] * len(per_step))  # 2 trees x 4 leaves on every trained step
    assert sorted(set(leaves.tolist())) == [1.0, 2.0]  # steps 0-1: the first split's edges (2 leaves each); then 1
    assert len(edge_leaf_weights(tr, rows[:0])) == 0


# ---------------------------------------------------------------------------------- pruning


def tail_tree():
    # splits at 0 and 1 over 4 steps: edges 0-1 (step 0), 2-5 (step 1), 6-9 (step 2), 10-13 (step 3)
    t = build_tree(BranchSchedule((0, 1)), 4, 1)
    assert t.edge_step.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    return t


def test_width_pruning_per_branch():
    t = tail_tree()
    edges = torch.arange(14)
    # tail edges 6..13; chains (by leaf): {6, 10}, {7, 11}, {8, 12}, {9, 13}
    adv = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, -1.0, 0.5, 2.0, 3.0, -2.0, 0.5, 1.0])
    keep = width_prune(t, edges, adv, "per_branch", 0.5)
    assert keep.tolist() == [True] * 6 + [False, True, True, True, True, False, False, False]  # ties keep the earlier
    assert width_prune(t, edges, adv, "per_branch", 1.0).all()
    assert width_prune(t, edges, adv, "per_branch", 0.1).sum() == 6 + 4  # at least one per chain
    # only masked-in edges are candidates and groups are counted among them
    mask = torch.ones(14, dtype=torch.bool)
    mask[10] = False
    kept = width_prune(t, edges, adv, "per_branch", 0.5, mask=mask)
    assert not kept[10] and kept[6] and kept.sum() == 6 + 4


def test_width_pruning_best_worst():
    t = tail_tree()
    edges = torch.arange(14)
    adv = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, -1.0, 0.5, 2.0, 3.0, -2.0, 0.4, 1.5])
    keep = width_prune(t, edges, adv, "best_worst", 0.5)  # n = 8, k = 4: best {10, 9}, worst {11, 7}
    assert keep.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 9, 10, 11]
    keep = width_prune(t, edges, adv, "best_worst", 0.1)  # k = max(2, 0) = 2: best 10, worst 11
    assert keep.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 11]
    # a subset of edges given by index (e.g. the trained ones): the mask is over that subset
    sub = torch.tensor([1, 6, 7, 9])
    assert width_prune(t, sub, adv[sub], "best_worst", 0.5).tolist() == [True, False, True, True]
    assert width_prune(build_tree(BranchSchedule(()), 4, 1), torch.arange(4), torch.randn(4), "best_worst").all()


def test_depth_pruning_fixed_and_sliding():
    t = tail_tree()  # child depth = step + 1
    edges = torch.arange(14)
    assert depth_prune(t, edges, {3, 4}).tolist() == [True] * 6 + [False] * 8
    assert depth_pruning_set({3, 4}, iteration=0, interval=10, stop_depth=1) == {3, 4}
    assert depth_pruning_set({3, 4}, iteration=10, interval=10, stop_depth=1) == {2, 3}
    assert depth_pruning_set({3, 4}, iteration=25, interval=10, stop_depth=1) == {1, 2}
    assert depth_pruning_set({3, 4}, iteration=999, interval=10, stop_depth=1) == {1, 2}  # stops at stop_depth
    # stop_depth defaults to the last split step (1 here)
    keep = depth_prune(t, edges, {3, 4}, iteration=15, interval=10)  # {2, 3}: steps 1 and 2
    assert keep.tolist() == [True, True] + [False] * 8 + [True] * 4
    # spec §1.7: five tail depths of 16 pruned from 218 edges leaves 138
    big = build_tree(BranchSchedule((0, 3, 6, 9)), 20, 1)
    assert int(depth_prune(big, torch.arange(218), {16, 17, 18, 19, 20}).sum()) == 138
    tail = big.edge_step > 9
    assert int(width_prune(big, torch.arange(218), torch.zeros(218), "per_branch", 0.5).sum()) == 218 - 80
    assert int(tail.sum()) == 160
