"""Tree advantages and pruning (BranchGRPO, docs/reference/specs/branch-cps-guard.md §1.3-§1.6; DTS soft value §5).

    from difrl.algos.tree import fuse_rewards, depthwise_advantages, edge_advantages, width_prune, depth_prune
    values = fuse_rewards(tr.tree, leaf_rewards)              # [Nn]: mean of the leaves below (default)
    node_adv = depthwise_advantages(tr.tree, values)          # [Nn]: per tree and depth (§1.4)
    adv = edge_advantages(tr, node_adv)                       # [E]: one per row of tr.edges
    keep = depth_prune(tr.tree, tr.trained_edge, {15, 16, 17, 18})
    keep &= width_prune(tr.tree, tr.trained_edge, adv, "per_branch", 0.5, mask=keep)

`leaf_rewards` [P * leaves] are in ``tree.leaf_node`` order (tree-major, paths lexicographic: the
order of ``TreeRollout.x_leaf``). Node values are computed bottom-up, depth by depth (every leaf
sits at depth N). Pruning cuts the backward pass only: it returns a keep-mask over the given edges
and the forward rollout is unchanged (§1.6).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from difrl.branching import Tree
from difrl.tree_rollout import TreeRollout

FusionMode = Literal["mean", "path_prob", "soft"]
WidthMode = Literal["per_branch", "best_worst"]


def _children(tree: Tree, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nodes at depth + 1, their parents)."""
    ch = tree.nodes_at(depth + 1)
    return ch, tree.parent[ch]


def fuse_rewards(tree: Tree, leaf_rewards: torch.Tensor, mode: FusionMode = "mean", lam: float = 1.0,
                 alpha: float = 1.0) -> torch.Tensor:
    """Leaf rewards [L] -> a value for every node [Nn] (fp32).

    mean (BranchGRPO default, §1.3): R(n) = mean of R over the leaves below n.
    path_prob (``--tree_prob_weighted``): R(n) = sum_c softmax_c(alpha * logp(c | n)) R(c) with the
      edge log-probs ``tree.log_prob``; a node with one child copies it.
    soft (DTS, §5): V(n) = (1/lam) log mean_{leaves below n} exp(lam R), as the soft Bellman backup
      V(n) = (1/lam) log sum_c (L(c)/L(n)) exp(lam V(c)) with L = leaves below; lam -> 0 is the mean."""
    L = len(tree.leaf_node)
    if leaf_rewards.shape != (L,):
        raise ValueError(f"leaf_rewards must have shape [{L}] (tree.leaf_node order), got {tuple(leaf_rewards.shape)}")
    if mode == "soft" and lam == 0:
        mode = "mean"
    Nn = tree.num_nodes
    r = leaf_rewards.detach().to(torch.float64).cpu()
    val = torch.zeros(Nn, dtype=torch.float64)
    val[tree.leaf_node] = r
    if mode == "mean":
        total = val.clone()  # sums over the leaves below, then / count
        for d in range(tree.num_steps - 1, -1, -1):
            ch, par = _children(tree, d)
            total.index_add_(0, par, total[ch])
        return (total / tree.num_leaves.to(torch.float64)).float()
    if mode == "path_prob":
        logp = tree.log_prob.to(torch.float64).cpu()
        for d in range(tree.num_steps - 1, -1, -1):
            ch, par = _children(tree, d)
            z = alpha * logp[ch]
            zmax = torch.full((Nn,), -torch.inf, dtype=torch.float64).scatter_reduce(0, par, z, "amax")
            w = torch.exp(z - zmax[par])
            norm = torch.zeros(Nn, dtype=torch.float64).index_add_(0, par, w)
            val.index_add_(0, par, w / norm[par] * val[ch])
        return val.float()
    if mode == "soft":
        log_count = tree.num_leaves.to(torch.float64).log()
        for d in range(tree.num_steps - 1, -1, -1):
            ch, par = _children(tree, d)
            a = lam * val[ch] + log_count[ch]  # log of L(c) exp(lam V(c))
            amax = torch.full((Nn,), -torch.inf, dtype=torch.float64).scatter_reduce(0, par, a, "amax")
            s = torch.zeros(Nn, dtype=torch.float64).index_add_(0, par, torch.exp(a - amax[par]))
            nodes = tree.nodes_at(d)
            val[nodes] = (amax[nodes] + torch.log(s[nodes]) - log_count[nodes]) / lam
        return val.float()
    raise ValueError(f"mode must be 'mean', 'path_prob' or 'soft', got {mode!r}")


def soft_mean(values: torch.Tensor, lam: float) -> float:
    """(1/lam) log mean exp(lam * values): DTS's soft value of i.i.d. children (§5); lam -> 0 is the mean."""
    v = values.to(torch.float64).flatten()
    if lam == 0:
        return float(v.mean())
    return float((torch.logsumexp(lam * v, 0) - math.log(len(v))) / lam)


def depthwise_advantages(tree: Tree, node_values: torch.Tensor, eps: float = 1e-8,
                         clip: float | None = None, roots: int = 1) -> torch.Tensor:
    """Per tree and per depth (§1.4): A(n) = (R(n) - mean) / (std + eps), std unbiased; 0 for a depth
    with one node or std < 1e-6 (the root and the trunk before the first split). Optional clip to
    [-clip, clip] (BranchGRPO's adv_clip_max = 5 is applied in its loss). [Nn] fp32.
    roots: trees per prompt (a forest, ``tree.roots``): trees k*roots .. k*roots + roots - 1 are one
    prompt's and are normalised together, per depth (so the roots get advantages too)."""
    r = node_values.detach().to(torch.float64).cpu()
    if roots < 1 or tree.num_trees % roots:
        raise ValueError(f"roots={roots} (tree.roots, trees per prompt) must divide the batch's {tree.num_trees} trees: "
                         "a prompt's trees are normalised together, so the batch must hold whole forests (on several "
                         "processes, rollout.prompts_per_iter a multiple of the number of processes)")
    key = (tree.tree // roots) * (tree.num_steps + 1) + tree.depth  # one group per (prompt's forest, depth)
    uniq, inv = torch.unique(key, return_inverse=True)
    G = len(uniq)
    count = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    var = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, centred**2) / (count - 1).clamp(min=1)
    std = var.sqrt()
    adv = centred / (std[inv] + eps)
    dead = (count[inv] < 2) | (std[inv] < 1e-6)
    adv = torch.where(dead, torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.float()


def edge_advantages(tr: TreeRollout, node_advantages: torch.Tensor) -> torch.Tensor:
    """[E] the advantage of each trained edge (row of ``tr.edges``) = its child node's (§1.5)."""
    return node_advantages[tr.tree.edge_child[tr.trained_edge]]


def edge_leaf_weights(tr: TreeRollout, rows: torch.Tensor) -> torch.Tensor:
    """[E'] loss weight of the trained edges `rows` (indices into ``tr.edges``, e.g. tree_train_edges' kept): the
    leaves below each edge's child, over their mean (so the update's scale is unchanged). tree.edge_weight=leaves:
    an edge shared by k leaves counts as the k transitions flat GRPO would train there, so every step of a full
    tree weighs the same, as in flat GRPO; with one term per edge (BranchGRPO, §1.5) a step weighs as many edges as
    it has, and the early shared steps, where a coarse attribute such as the direction of motion is decided, carry
    a small share of the gradient (benchmarks/diag_branch.py measures it)."""
    t = tr.tree
    leaves = t.num_leaves[t.edge_child[tr.trained_edge[rows]]].float()
    return leaves / leaves.mean() if len(leaves) else leaves


def width_prune(tree: Tree, edges: torch.Tensor, advantages: torch.Tensor, mode: WidthMode = "per_branch",
                ratio: float = 0.5, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask [E] over `edges` (edge indices into ``tree.edge_*``) with their `advantages` [E] (§1.6).

    Only tail edges (parent step > last split step) among those with ``mask`` set (default all) are
    pruned; every other edge keeps its mask value. Ties keep the earlier edge in `edges` order.
      per_branch (mode 1): group the tail edges by their last-split ancestor (the child made at the
        last split, i.e. one leaf's chain) and keep the top max(1, floor(ratio * group)) by advantage.
      best_worst (mode 2): over all tail edges, keep the best floor(k/2) and the worst k - floor(k/2),
        k = max(2, floor(ratio * n)).
    A schedule without splits prunes nothing."""
    E = len(edges)
    keep = torch.ones(E, dtype=torch.bool) if mask is None else mask.clone().bool()
    if not tree.schedule.split_steps or E == 0:
        return keep
    last = tree.schedule.split_steps[-1]
    tail = keep & (tree.edge_step[edges] > last)
    idx = tail.nonzero().flatten()  # candidate rows, in `edges` order
    if len(idx) == 0:
        return keep
    adv = advantages.detach().float().cpu()[idx]
    desc = torch.sort(-adv, stable=True).indices  # best first; ties by position
    kept = torch.zeros(len(idx), dtype=torch.bool)
    if mode == "per_branch":
        group = tree.first_leaf[tree.edge_child[edges[idx]]]  # a tail chain has exactly one leaf
        order = desc[torch.sort(group[desc], stable=True).indices]  # by group, best first inside each
        g_sorted = group[order]
        _, counts = torch.unique_consecutive(g_sorted, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(len(order)) - starts.repeat_interleave(counts)
        k = torch.tensor([max(1, int(int(c) * ratio)) for c in counts]).repeat_interleave(counts)
        kept[order[rank < k]] = True
    elif mode == "best_worst":
        n = len(idx)
        k = max(2, int(n * ratio))
        best = k // 2
        kept[desc[:best]] = True
        kept[desc[n - (k - best):]] = True
    else:
        raise ValueError(f"mode must be 'per_branch' or 'best_worst', got {mode!r}")
    keep[idx] = kept
    return keep


def depth_pruning_set(depths: set[int] | list[int], iteration: int | None = None, interval: int | None = None,
                      stop_depth: int = 0) -> set[int]:
    """The depths pruned at `iteration` (§1.6). Fixed unless `interval` is given; sliding: every
    `interval` iterations the set moves one depth earlier, shift = min(iteration // interval,
    min(depths) - stop_depth) (never past stop_depth; BranchGRPO: interval 30, stop = last split step)."""
    depths = sorted({int(d) for d in depths})
    if not depths or interval is None:
        return set(depths)
    shift = max(0, min(int(iteration or 0) // int(interval), depths[0] - stop_depth))
    return {d - shift for d in depths}


def depth_prune(tree: Tree, edges: torch.Tensor, depths: set[int] | list[int], iteration: int | None = None,
                interval: int | None = None, stop_depth: int | None = None) -> torch.Tensor:
    """Keep-mask [E]: drop the edges whose child depth (= parent step + 1) is in the pruned set
    (``depth_pruning_set``; `stop_depth` defaults to the last split step)."""
    if stop_depth is None:
        stop_depth = max(tree.schedule.split_steps, default=0)
    active = depth_pruning_set(depths, iteration, interval, stop_depth)
    child_depth = tree.edge_step[edges] + 1
    return ~torch.isin(child_depth, torch.tensor(sorted(active), dtype=torch.long))


def tree_train_edges(tr: TreeRollout, scores: dict[str, torch.Tensor], weights: dict[str, float],
                     leaf_keep: torch.Tensor, iteration: int, tree_cfg, aggregate: str = "reward_sum", eps: float = 1e-4,
                     clip: float = 5.0, roots: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BranchGRPO's trained edges for one process's trees (docs/reference/specs/branch-cps-guard.md §1.3-§1.6). Leaf
    rewards (`scores`: name -> [L] in tree.leaf_node order) are fused into every node (tree_cfg.fusion), normalised per
    tree and depth, and each SDE edge takes its child's advantage; `aggregate` "advantage_sum" normalises each
    reward on its own, then weights them (MixGRPO's multi-reward form). Depth and width pruning (tree_cfg)
    drop edges from the backward pass, per tree so prompts never mix (§1.10). A tree with a leaf outside
    `leaf_keep` [L] bool (failed reward, zero spread) keeps its edges with keep = 0, like the flat trainer's
    samples. `roots`: trees per prompt (tree.roots, a forest), normalised together per depth. Returns (kept rows' indices into tr.edges [E'], their advantages [E'], keep [E'] bool)."""
    t, tc = tr.tree, tree_cfg

    def node_advantages(leaf_rewards: torch.Tensor) -> torch.Tensor:  # [L] -> [Nn]
        values = fuse_rewards(t, leaf_rewards, tc.fusion, tc.fusion_lambda, tc.fusion_lambda)
        return depthwise_advantages(t, values, eps, roots=roots)

    if aggregate == "reward_sum":
        node_adv = node_advantages(sum(w * scores[n].double() for n, w in weights.items()).float())
    else:
        node_adv = sum(w * node_advantages(scores[n]) for n, w in weights.items())
    adv = edge_advantages(tr, node_adv.clamp(-clip, clip))  # [E]
    edge_tree = t.tree[t.edge_child[tr.trained_edge]]  # [E] local tree of each edge (tree-major order)
    keep = leaf_keep.view(t.num_trees, -1).all(1)[edge_tree]
    sel = torch.ones(len(adv), dtype=torch.bool)
    if tc.depth_prune:
        sel &= depth_prune(t, tr.trained_edge, tc.depth_prune, iteration, tc.depth_slide_every, tc.depth_stop)
    if tc.width_prune != "none":
        for k in range(t.num_trees):
            rows = edge_tree == k
            sel[rows] = width_prune(t, tr.trained_edge[rows], adv[rows], tc.width_prune, tc.width_ratio, mask=sel[rows])
    kept = sel.nonzero().flatten()
    return kept, adv[kept], keep[kept]
