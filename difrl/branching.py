"""Tree counting for BranchGRPO (docs/reference/specs/branch-cps-guard.md §1): split schedules, NFE and edge counts,
node seeds and the tree's index structure. Pure bookkeeping: no policy, no tensors of latents.

    from difrl.branching import BranchSchedule, build_tree, nfe, num_edges, num_trained_edges, mix_sde_mask
    sched = BranchSchedule((0, 3, 6, 9), factor=2)                # 16 leaves per tree
    nfe(sched, 20, trees=2) == 406                                # §1.7: 203 model evaluations per tree
    num_edges(sched, 20) == 218                                   # parent->child edges per tree
    num_trained_edges(sched, 20, mix_sde_mask(20, sched, 0, 4)) == 34   # BranchGRPO-Mix's SDE edges
    tree = build_tree(sched, 20, num_trees=2)                     # parents, depths, paths, leaves, edges

The engine that samples these trees is ``difrl.tree_rollout``; fusion, depth-wise advantages and
pruning of its edges live in ``difrl.algos.tree``.

**Tree.** One tree per prompt. At step i every live node takes one step; at a split step
(``schedule.split_steps``) it emits ``factor`` children instead of one (§1.1). A node's *path* is the
tuple of child indices it took at the splits so far; every node of a segment between splits shares
its path. Split steps are always SDE (§1.2); the other steps are SDE where ``sde_mask`` is set
(default all) and deterministic ODE steps elsewhere (BranchGRPO-Mix: ``mix_sde_mask``). Only the SDE
edges are trained.

**Node seeds.** A node's noise seed is a pure function of (root seed, path):
``node_seed(root, ()) = root`` and ``node_seed(root, path + (c,)) = mix_seed(node_seed(root, path), c)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difrl.samplers.schedules import fixed_window
from difrl.utils.rng import mix_seed

# ---------------------------------------------------------------------------------- schedule and counts


@dataclass(frozen=True)
class BranchSchedule:
    """Split steps (step indices, sorted, unique) and the branching factor (children per split, §1.1)."""

    split_steps: tuple[int, ...] = ()
    factor: int = 2

    def __post_init__(self):
        steps = tuple(int(s) for s in self.split_steps)
        object.__setattr__(self, "split_steps", steps)
        if list(steps) != sorted(set(steps)):
            raise ValueError(f"split_steps must be sorted and unique, got {steps}")
        if steps and steps[0] < 0:
            raise ValueError(f"split_steps must be >= 0, got {steps}")
        if int(self.factor) < 2:
            raise ValueError(f"factor must be >= 2 (children per split), got {self.factor}")

    @classmethod
    def uniform(cls, rounds: int, num_steps: int, factor: int = 2) -> "BranchSchedule":
        """BranchGRPO's default without explicit points: splits at k * (num_steps // rounds), k < rounds."""
        return cls(tuple(sorted({min(k * (num_steps // rounds), num_steps - 1) for k in range(rounds)})), factor)

    @property
    def leaves(self) -> int:
        """Leaves per tree: factor ** (number of splits)."""
        return self.factor ** len(self.split_steps)

    def validate(self, num_steps: int) -> None:
        if self.split_steps and self.split_steps[-1] > num_steps - 1:
            raise ValueError(f"split step {self.split_steps[-1]} is outside the {num_steps} steps [0, {num_steps - 1}]")

    def split_mask(self, num_steps: int) -> torch.Tensor:
        """[N] bool: the split steps."""
        self.validate(num_steps)
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[list(self.split_steps)] = True
        return mask

    def width(self, step: int) -> int:
        """Live nodes per tree at `step` (before it): factor ** #{splits < step}."""
        return self.factor ** sum(s < step for s in self.split_steps)


def nfe(schedule: BranchSchedule, num_steps: int, trees: int = 1) -> int:
    """Model evaluations of a tree rollout (docs/reference/specs/branch-cps-guard.md §1.7): every live node is evaluated
    once per step, (s1 + 1) + f (s2 - s1) + f^2 (s3 - s2) + ... + f^m (N - 1 - s_m) per tree. With classifier-free
    guidance each evaluation is two network rows."""
    schedule.validate(num_steps)
    total, prev, width = 0, -1, 1
    for s in schedule.split_steps:
        total += width * (s - prev)
        prev, width = s, width * schedule.factor
    return trees * (total + width * (num_steps - 1 - prev))


def num_edges(schedule: BranchSchedule, num_steps: int, trees: int = 1) -> int:
    """Parent->child edges: each split step makes `factor` edges per node, each other step one, so
    edges = evaluations + (leaves - 1) per tree (§1.7; 218 for (0, 3, 6, 9), N = 20)."""
    return nfe(schedule, num_steps, trees) + trees * (schedule.leaves - 1)


def num_trained_edges(schedule: BranchSchedule, num_steps: int, sde_mask: torch.Tensor | None = None,
                      trees: int = 1) -> int:
    """Edges whose parent step is SDE (``sde_mask`` or a split step): sum over those steps of the
    children made there (34 per tree for Mix's {0,1,2,3} u {0,3,6,9}, N = 20, §1.7)."""
    sde = effective_sde_mask(num_steps, schedule, sde_mask)
    return trees * sum(schedule.width(i + 1) for i in range(num_steps) if sde[i])


def effective_sde_mask(num_steps: int, schedule: BranchSchedule, sde_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[N] bool: ``sde_mask`` (default all steps) or a split step (split steps are always SDE, §1.2)."""
    sde = torch.ones(num_steps, dtype=torch.bool) if sde_mask is None else sde_mask.bool().clone()
    if sde.shape != (num_steps,):
        raise ValueError(f"sde_mask must have shape [{num_steps}], got {tuple(sde.shape)}")
    return sde | schedule.split_mask(num_steps)


def mix_sde_mask(num_steps: int, schedule: BranchSchedule, window_start: int, window_size: int) -> torch.Tensor:
    """BranchGRPO-Mix (§1.2): SDE inside [window_start, window_start + window_size) and at the split
    steps, ODE elsewhere. (The reference computes its window with a stride that never moves it at
    20 steps; here the caller chooses the start, e.g. with ``sliding_window_start``.)"""
    return fixed_window(num_steps, window_start, window_size) | schedule.split_mask(num_steps)


def node_seed(root_seed: int, path: tuple[int, ...]) -> int:
    """The noise seed of a node: the root seed for the empty path, else mix_seed(parent's, child index)."""
    s = int(root_seed)
    for c in path:
        s = mix_seed(s, c)
    return s


# ---------------------------------------------------------------------------------- tree structure


@dataclass
class Tree:
    """The structure of `num_trees` identical trees (a pure function of schedule, N and the SDE mask)
    plus each edge's log-prob once sampled.

    Nodes are numbered depth by depth (depth d = latent after d steps; roots 0..P-1 at depth 0), and
    within a depth tree-major, then by path in lexicographic order. Edge e enters node e + P, so the
    edges are numbered by (parent step, tree, path) too. Leaves are the depth-N nodes, in node order."""

    schedule: BranchSchedule
    num_steps: int
    num_trees: int
    parent: torch.Tensor  # [Nn] long, -1 for roots
    depth: torch.Tensor  # [Nn] long
    tree: torch.Tensor  # [Nn] long
    path: torch.Tensor  # [Nn, S] long, child index at each split so far, -1 after
    num_leaves: torch.Tensor  # [Nn] long: leaves below (1 for a leaf)
    first_leaf: torch.Tensor  # [Nn] long: leaf index (into leaf_node) of the first leaf below
    depth_offsets: torch.Tensor  # [N + 2] long: nodes of depth d are depth_offsets[d]:depth_offsets[d + 1]
    edge_step: torch.Tensor  # [Ne] long: the parent's step (= parent depth)
    edge_is_split: torch.Tensor  # [Ne] bool
    edge_is_sde: torch.Tensor  # [Ne] bool: trained (ODE edges have no log-prob)
    log_prob: torch.Tensor | None = None  # [Nn] fp32 (on the rollout device): log-prob of the edge into each node; 0 for roots and ODE edges

    def __post_init__(self):
        if self.log_prob is None:
            self.log_prob = torch.zeros(len(self.parent))

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def step(self) -> torch.Tensor:
        """[Nn] the step whose transition produced each node (depth - 1; -1 for roots, §1.1)."""
        return self.depth - 1

    @property
    def is_leaf(self) -> torch.Tensor:
        return self.depth == self.num_steps

    @property
    def leaf_node(self) -> torch.Tensor:
        """[L] node ids of the leaves: tree-major, then path in lexicographic order."""
        return torch.arange(int(self.depth_offsets[-2]), int(self.depth_offsets[-1]))

    @property
    def edge_child(self) -> torch.Tensor:
        return torch.arange(self.num_trees, self.num_nodes)

    @property
    def edge_parent(self) -> torch.Tensor:
        return self.parent[self.num_trees:]

    def nodes_at(self, depth: int) -> torch.Tensor:
        return torch.arange(int(self.depth_offsets[depth]), int(self.depth_offsets[depth + 1]))

    def path_of(self, node: int) -> tuple[int, ...]:
        return tuple(int(c) for c in self.path[node] if c >= 0)

    def node_id(self, tree: int, depth: int, path: tuple[int, ...] = ()) -> int:
        """The node of `tree` at `depth` reached by `path` (one child index per split before depth)."""
        splits = sum(s < depth for s in self.schedule.split_steps)
        if len(path) != splits:
            raise ValueError(f"a node at depth {depth} has a path of {splits} child indices, got {path}")
        rank = 0
        for c in path:
            rank = rank * self.schedule.factor + int(c)
        return int(self.depth_offsets[depth]) + tree * self.schedule.factor ** splits + rank


def build_tree(schedule: BranchSchedule, num_steps: int, num_trees: int, sde_mask: torch.Tensor | None = None) -> Tree:
    """The structure of `num_trees` trees of `schedule` over `num_steps` steps (no model involved)."""
    schedule.validate(num_steps)
    N, P, f, S = num_steps, num_trees, schedule.factor, len(schedule.split_steps)
    sde = effective_sde_mask(N, schedule, sde_mask)
    split = schedule.split_mask(N)
    parent, depth, tree = [torch.full((P,), -1)], [torch.zeros(P, dtype=torch.long)], [torch.arange(P)]
    path = [torch.full((P, S), -1)]  # per depth block, in node order
    e_split, e_sde = [], []
    offsets, nsplit = [0, P], 0
    live = torch.arange(P)
    for i in range(N):
        k = f if split[i] else 1
        M = len(live)
        par = live.repeat_interleave(k)  # children of node m are contiguous, in child-index order
        child_path = path[-1].repeat_interleave(k, dim=0).clone()  # the parents' paths (previous depth block)
        if split[i]:
            child_path[:, nsplit] = torch.arange(k).repeat(M)
            nsplit += 1
        parent.append(par)
        depth.append(torch.full((M * k,), i + 1, dtype=torch.long))
        tree.append(tree[-1].repeat_interleave(k))
        path.append(child_path)
        e_split.append(torch.full((M * k,), bool(split[i])))
        e_sde.append(torch.full((M * k,), bool(sde[i])))
        live = torch.arange(offsets[-1], offsets[-1] + M * k)
        offsets.append(offsets[-1] + M * k)
    parent_t, depth_t = torch.cat(parent), torch.cat(depth)
    Nn = len(parent_t)
    # bottom-up: leaves below and the first leaf below each node
    num_leaves = torch.zeros(Nn, dtype=torch.long)
    first_leaf = torch.full((Nn,), Nn, dtype=torch.long)
    leaves = torch.arange(offsets[N], offsets[N + 1])
    num_leaves[leaves] = 1
    first_leaf[leaves] = leaves - offsets[N]
    for d in range(N, 0, -1):
        ch = torch.arange(offsets[d], offsets[d + 1])
        num_leaves.index_add_(0, parent_t[ch], num_leaves[ch])
        first_leaf.scatter_reduce_(0, parent_t[ch], first_leaf[ch], "amin")
    return Tree(schedule=schedule, num_steps=N, num_trees=P, parent=parent_t, depth=depth_t, tree=torch.cat(tree),
                path=torch.cat(path), num_leaves=num_leaves, first_leaf=first_leaf, depth_offsets=torch.tensor(offsets),
                edge_step=depth_t[P:] - 1, edge_is_split=torch.cat(e_split) if e_split else torch.zeros(0, dtype=torch.bool),
                edge_is_sde=torch.cat(e_sde) if e_sde else torch.zeros(0, dtype=torch.bool))
