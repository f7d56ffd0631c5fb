"""Tree rollouts (BranchGRPO, branch-cps-guard.md §1): seeds in, a branching tree of trajectories out.

    from difrl.tree import BranchSchedule, tree_rollout, nfe, num_edges
    sched = BranchSchedule((0, 3, 6, 9), factor=2)                # 16 leaves per prompt
    tr = tree_rollout(policy, prompts, seeds=torch.arange(2), sigmas=sigma_schedule(20, shift=3.0),
                      schedule=sched, kernel="dance_sde", kernel_kwargs={"noise_level": 0.3},
                      split_noise_scale=4.0)
    rewards = reward(policy.decode(tr.x_leaf))                    # [2 * 16], tree-major, paths lexicographic
    tr.evaluations == nfe(sched, 20, trees=2) == 406              # spec §1.7: 203 per tree
    tr.edges                                                      # difrl.rollout.Rollout of the trained edges, T=1

Fusion, depth-wise advantages and pruning of the edges live in ``difrl.algos.tree``.

**Tree.** One tree per prompt, with root latent ``x_0 = noise(init_seeds[p], -1)`` (the flat engine's
initial noise). At step i every live node takes one step; at a split step (``schedule.split_steps``)
it emits ``factor`` children instead of one (§1.1). A node's *path* is the tuple of child indices it
took at the splits so far; every node of a segment between splits shares its path.

**Noise.** A node's noise seed is a pure function of (root seed, path):
``node_seed(root, ()) = root`` and ``node_seed(root, path + (c,)) = mix_seed(node_seed(root, path), c)``.
The noise of the edge that leaves a node at step i and enters a node with seed s is
``sample_noise(s, i)`` (counter-based, difrl.utils.rng), so a node's latent does not depend on which
other nodes or prompts exist, nor on the forward batch. A tree with no split steps is therefore the
flat engine's sample with ``seed = root seed``: ``tree_rollout(..., BranchSchedule(()))`` reproduces
``difrl.rollout.rollout`` bit for bit (same forward batches).

**Noise injection (§1.2).** Steps where ``sde_mask`` is set use `kernel`; split steps are always
SDE; the other steps are deterministic ODE (Euler) steps with log-prob 0 and are not trained
(BranchGRPO-Mix: ``mix_sde_mask``). At a split step the siblings share the kernel's mean mu and std
s and are drawn as ``x' = mu + kappa * s * z`` (kappa = ``split_noise_scale``). Their edge log-prob is
``log N(x'; mu, (kappa s)^2)`` with ``kappa_logprob="actual"`` (the distribution actually sampled;
default) or ``log N(x'; mu, s^2)`` with ``"reference"`` (BranchGRPO's code, kept for comparison:
its PPO ratio is consistent but its split-edge score is kappa times too large, §1.2 pitfall).
The kernels take no custom std, so split edges are sampled and scored by ``split_step`` here.

**Edges for training.** ``TreeRollout.edges`` is a ``Rollout`` whose rows are the trained (SDE)
edges, T = 1 each, in tree-major order (then step, then path). Row e holds ``x`` = the parent's
latent, ``x_next`` = the child's, ``sigma/sigma_next/step`` of the parent's step, ``log_prob_old``,
``mean_old``, ``prompt_ids``/``group_ids`` of its tree (group id = tree), ``seeds`` = the child's
noise seed (the seed of the edge's noise), ``init_seeds`` = the root seed, ``cond`` = its tree's
conditioning row, and ``x_final`` = its *first* descendant leaf (following child 0 at every later
split; for a tail edge, its only leaf). ``edges.extras`` holds ``"logprob_scale"`` [E, 1] (the factor on
the kernel's std in the stored log-prob: kappa for split edges under "actual", else 1),
``"std_old"`` [E, 1], ``"is_split"`` [E] and ``"edge_index"`` [E] (into ``tree.edge_*``). The trainer
recomputes a batch of edges with ``split_step(kind, x, v, sigma, sigma_next, action=x_next,
logprob_scale=extras["logprob_scale"][:, 0])`` (``recompute_edges`` does the forward too); for
rows with scale 1 that is bit-identical to ``KERNELS[kind](..., action=x_next)``, so only split
edges with kappa != 1 under "actual" need it. ``Rollout.select`` indexes the per-edge ``extras``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from difrl.models.base import Cond, FlowPolicy, cond_repeat, cond_select
from difrl.rollout import INIT_STEP, Rollout, sample_noise
from difrl.samplers.kernels import KERNELS, StepOutput, cps_unnormalized_log_prob, gaussian_log_prob, ode_step
from difrl.samplers.schedules import fixed_window
from difrl.utils.rng import mix_seed, mix_seed_tensor

KappaLogProb = Literal["actual", "reference"]

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
    """Model evaluations of a tree rollout (spec §1.7): every live node is evaluated once per step,
    (s1 + 1) + f (s2 - s1) + f^2 (s3 - s2) + ... + f^m (N - 1 - s_m) per tree. With classifier-free
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
    log_prob: torch.Tensor | None = None  # [Nn] fp32: log-prob of the edge into each node; 0 for roots and ODE edges

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


# ---------------------------------------------------------------------------------- the split step


def _per_row(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A float or [B] scale -> [B, 1, ..., 1] fp32, broadcasting against `like` [B, ...]."""
    t = torch.as_tensor(scale, dtype=torch.float32, device=like.device)
    t = t.expand(like.shape[0]) if t.ndim == 0 else t.to(torch.float32).reshape(-1)
    return t.view(-1, *([1] * (like.ndim - 1)))


def split_step(kind: str, x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise: torch.Tensor | None = None, *,
               action: torch.Tensor | None = None, noise_scale: torch.Tensor | float = 1.0,
               logprob_scale: torch.Tensor | float | None = None, **kernel_kwargs) -> StepOutput:
    """A kernel step with its std scaled (§1.2): x_next = mu + noise_scale * s * noise (sampling) or
    the given `action`, and log_prob = log N(x_next; mu, (logprob_scale * s)^2), where (mu, s) are
    `kind`'s mean and std. ``logprob_scale`` defaults to ``noise_scale`` (the sampled distribution);
    1 gives BranchGRPO's reference log-prob. Scales are floats or [B]. Returns StepOutput with
    ``std = logprob_scale * s`` (the std of the log-prob). With both scales 1 this is exactly
    ``KERNELS[kind]`` (same ops, same bits); for scale-1 rows of a mixed batch too."""
    step_fn = KERNELS[kind]
    if logprob_scale is None:
        logprob_scale = noise_scale
    plain = lambda s: isinstance(s, (int, float)) and float(s) == 1.0  # noqa: E731
    if plain(noise_scale) and plain(logprob_scale):
        return step_fn(x, v, sigma, sigma_next, noise, action=action, **kernel_kwargs)
    if kind == "ode":
        return ode_step(x, v, sigma, sigma_next, action=action)
    if (noise is None) == (action is None):
        raise ValueError("pass exactly one of `noise` (to sample) or `action` (to score a stored x_next)")
    reduce = kernel_kwargs.get("reduce", "mean")
    base = step_fn(x, v, sigma, sigma_next, action=x if action is None else action, **kernel_kwargs)  # mu, s
    mean = base.mean
    std_b = base.std.view(-1, *([1] * (mean.ndim - 1)))  # [B, 1, ...] the kernel's s
    if action is None:
        x_next = mean + std_b * _per_row(noise_scale, mean) * noise.to(torch.float32)
    else:
        x_next = action.to(torch.float32)
    std = base.std * _per_row(logprob_scale, mean).reshape(-1)
    flow_grpo_cps = kind == "cps" and kernel_kwargs.get("log_prob_form", "gaussian") == "flow_grpo"
    log_prob_fn = cps_unnormalized_log_prob if flow_grpo_cps else gaussian_log_prob  # the kernel's density form
    return StepOutput(x_next, log_prob_fn(x_next, mean, std, reduce), mean, std)


# ---------------------------------------------------------------------------------- the engine


@dataclass
class TreeRollout:
    """A batch of trees: structure, trained edges as a Rollout, leaves."""

    tree: Tree
    edges: Rollout  # E trained edges, T = 1, tree-major (module docstring)
    trained_edge: torch.Tensor  # [E] long: the edge index (into tree.edge_*) of each row of `edges`
    x_leaf: torch.Tensor  # [P * leaves, *latent] fp32: tree-major, paths lexicographic (= tree.leaf_node order)
    x0_pred_leaf: torch.Tensor  # [P * leaves, *latent]: x^0 = x - sigma v at the last step (BranchGRPO's reward input, §1.1)
    node_seed: torch.Tensor  # [Nn] long: each node's noise seed
    evaluations: int  # rows passed to policy.velocity (model evaluations; x2 network rows under CFG)
    forward_calls: int
    x_nodes: torch.Tensor | None = None  # [Nn, *latent] every node's latent when store_nodes=True
    info: dict = field(default_factory=dict)

    @property
    def leaf_node(self) -> torch.Tensor:
        return self.tree.leaf_node

    @property
    def leaf_tree(self) -> torch.Tensor:
        return self.tree.tree[self.tree.leaf_node]


def _edges_rollout(prompts, prompt_ids, group_ids, init_seeds, cond, x_leaf, tree: Tree, rec: dict,
                   node_seed_t: torch.Tensor, lat: tuple[int, ...], device) -> tuple[Rollout, torch.Tensor]:
    """The recorded SDE edges (step-major as sampled) as a tree-major Rollout with T = 1."""
    if rec["child"]:
        child = torch.cat(rec["child"])
        cat = lambda k: torch.cat(rec[k])  # noqa: E731
    else:
        child = torch.zeros(0, dtype=torch.long)
        cat = lambda k: torch.zeros((0, *lat)) if k in ("x", "x_next", "mean") else torch.zeros(0)  # noqa: E731
    order = torch.argsort(tree.tree[child] * tree.num_nodes + child)  # tree-major, then step, then path
    child = child[order]

    def pick(name: str) -> torch.Tensor:
        vals = cat(name)
        return vals[order.to(vals.device)]

    t = tree.tree[child]
    edge_index = child - tree.num_trees
    step = tree.edge_step[edge_index]
    one = lambda a: a.unsqueeze(1)  # noqa: E731  [E, ...] -> [E, 1, ...]
    edges = Rollout(
        prompts=[prompts[i] for i in t.tolist()], prompt_ids=prompt_ids[t], group_ids=group_ids[t],
        seeds=node_seed_t[child], init_seeds=init_seeds[t], cond=cond_select(cond, t.to(device)),
        x_final=x_leaf[tree.first_leaf[child].to(x_leaf.device)], step=one(step).to(device),
        x=one(pick("x")), x_next=one(pick("x_next")), sigma=one(pick("sigma")), sigma_next=one(pick("sigma_next")),
        log_prob_old=one(pick("log_prob")), mean_old=one(pick("mean")),
        extras={"logprob_scale": one(pick("logprob_scale")), "std_old": one(pick("std")),
                "is_split": tree.edge_is_split[edge_index], "edge_index": edge_index},
    )
    return edges, edge_index


@torch.no_grad()
def tree_rollout(
    policy: FlowPolicy,
    prompts: list[str],
    seeds: torch.Tensor,
    sigmas: torch.Tensor,
    schedule: BranchSchedule,
    kernel: str = "dance_sde",
    kernel_kwargs: dict | None = None,
    split_noise_scale: float = 1.0,
    kappa_logprob: KappaLogProb = "actual",
    sde_mask: torch.Tensor | None = None,
    prompt_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    init_seeds: torch.Tensor | None = None,
    guidance: float = 1.0,
    cond: Cond | None = None,
    batch_size: int | None = None,
    store_nodes: bool = False,
    device: str | torch.device = "cpu",
) -> TreeRollout:
    """One tree per prompt over `sigmas` ([N + 1]); root seed `seeds[p]` (module docstring).

    split_noise_scale: kappa, the std multiplier at split steps (BranchGRPO's script: 4.0).
    kappa_logprob: "actual" scores split edges under kappa * s, "reference" under s (§1.2).
    sde_mask [N] bool: SDE steps between splits (default all; split steps are always SDE).
    prompt_ids / group_ids [P]: per tree (default arange(P)); init_seeds [P]: initial-noise seeds
    (default `seeds`; equal values share one root latent, BranchGRPO's init_same_noise).
    batch_size: model forward batch over the live nodes of a step (default all at once).
    store_nodes: keep every node's latent in ``x_nodes`` (memory: one latent per node)."""
    if kappa_logprob not in ("actual", "reference"):
        raise ValueError(f"kappa_logprob must be 'actual' or 'reference', got {kappa_logprob!r}")
    P, N = len(prompts), len(sigmas) - 1
    if schedule.split_steps and kernel == "ode":
        raise ValueError("a split step needs a stochastic kernel: with kernel='ode' all children would be equal")
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    if len(seeds) != P:
        raise ValueError(f"one root seed per prompt: got {len(seeds)} seeds for {P} prompts")
    init_seeds = seeds if init_seeds is None else torch.as_tensor(init_seeds, dtype=torch.long)
    prompt_ids = torch.arange(P) if prompt_ids is None else torch.as_tensor(prompt_ids, dtype=torch.long)
    group_ids = torch.arange(P) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
    tree = build_tree(schedule, N, P, sde_mask)
    sde = effective_sde_mask(N, schedule, sde_mask)
    split = schedule.split_mask(N)
    cond = policy.encode(prompts) if cond is None else cond
    cond = {k: v.to(device) for k, v in cond.items()}
    kernel_kwargs = kernel_kwargs or {}
    kappa = float(split_noise_scale)
    lp_kappa = kappa if kappa_logprob == "actual" else 1.0
    f = schedule.factor

    lat = tuple(policy.latent_shape)
    x = sample_noise(init_seeds, INIT_STEP, lat, device)  # [M, *latent] live nodes, M = P at the roots
    seed_live = seeds.clone()  # [M] the live nodes' noise seeds
    node_seed_t = torch.zeros(tree.num_nodes, dtype=torch.long)
    node_seed_t[:P] = seeds
    log_prob_node = torch.zeros(tree.num_nodes)
    x_nodes = [x] if store_nodes else None
    rec = {k: [] for k in ("child", "x", "x_next", "sigma", "sigma_next", "log_prob", "mean", "std", "logprob_scale")}
    evaluations = calls = 0
    x0_pred = x
    for i in range(N):
        M = x.shape[0]
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        live_tree = tree.tree[tree.nodes_at(i)].to(device)  # [M]
        bs = batch_size or M
        vs = []
        for lo in range(0, M, bs):  # every live node of the step, one batched forward per chunk
            xb = x[lo:lo + bs]
            sig = torch.full((xb.shape[0],), sigma, device=device)
            vs.append(policy.velocity(xb, sig, cond_select(cond, live_tree[lo:lo + bs]), guidance))
            evaluations += xb.shape[0]
            calls += 1
        v = vs[0] if len(vs) == 1 else torch.cat(vs)
        if i == N - 1:
            x0_pred = x.to(torch.float32) - sigma * v.to(torch.float32)  # x^0 = x - sigma v (§1.1 item 5)
        k = f if split[i] else 1
        x_in, v_in = (x, v) if k == 1 else (x.repeat_interleave(k, 0), v.repeat_interleave(k, 0))
        sig_in = torch.full((M * k,), sigma, device=device)
        sig_next_in = torch.full_like(sig_in, sigma_next)
        if split[i]:  # siblings share mu and s, differ in their own noise (child seeds), std kappa * s
            seed_next = mix_seed_tensor(seed_live.repeat_interleave(k), torch.arange(k).repeat(M))
            noise = sample_noise(seed_next, i, lat, device)
            out = split_step(kernel, x_in, v_in, sig_in, sig_next_in, noise, noise_scale=kappa,
                             logprob_scale=lp_kappa, **kernel_kwargs)
            scale = lp_kappa
        elif sde[i]:
            seed_next = seed_live
            noise = sample_noise(seed_next, i, lat, device)
            out = KERNELS[kernel](x_in, v_in, sig_in, sig_next_in, noise, **kernel_kwargs)  # = the flat engine's step
            scale = 1.0
        else:
            seed_next = seed_live
            out = ode_step(x_in, v_in, sig_in, sig_next_in)
        children = tree.nodes_at(i + 1)
        node_seed_t[children] = seed_next
        if sde[i]:
            log_prob_node[children] = out.log_prob.float().cpu()
            for name, val in (("child", children), ("x", x_in), ("x_next", out.x_next), ("sigma", sig_in),
                              ("sigma_next", sig_next_in), ("log_prob", out.log_prob), ("mean", out.mean),
                              ("std", out.std), ("logprob_scale", torch.full_like(sig_in, scale))):
                rec[name].append(val)
        x, seed_live = out.x_next, seed_next
        if store_nodes:
            x_nodes.append(x)
    tree.log_prob = log_prob_node
    if N and split[N - 1]:
        x0_pred = x0_pred.repeat_interleave(f, 0)  # siblings made at the last step share the parent's x^0
    edges, edge_index = _edges_rollout(prompts, prompt_ids, group_ids, init_seeds, cond, x, tree, rec, node_seed_t,
                                       lat, device)
    return TreeRollout(tree=tree, edges=edges, trained_edge=edge_index, x_leaf=x, x0_pred_leaf=x0_pred,
                       node_seed=node_seed_t, evaluations=evaluations, forward_calls=calls,
                       x_nodes=torch.cat(x_nodes) if store_nodes else None,
                       info={"kernel": kernel, "kernel_kwargs": dict(kernel_kwargs), "split_noise_scale": kappa,
                             "kappa_logprob": kappa_logprob, "guidance": guidance})


# ---------------------------------------------------------------------------------- training-side helpers


def recompute_edges(policy: FlowPolicy, edges: Rollout, kernel: str, kernel_kwargs: dict | None = None,
                    guidance: float = 1.0) -> StepOutput:
    """The stored transitions of `edges` (any Rollout: tree edges or flat samples) under the current
    policy, one forward over all E*T rows, each scored with its stored ``extras["logprob_scale"]``
    (1 where there is none: then this is exactly ``KERNELS[kernel](..., action=x_next)``).
    The trainer's ``transition_log_prob`` is this. Returns StepOutput with log_prob [E, T],
    mean [E*T, ...], std [E*T] (the std the log-prob used)."""
    B, T = edges.step.shape
    flat = lambda t: t.reshape(B * T, *t.shape[2:])  # noqa: E731
    x, x_next, sigma, sigma_next = flat(edges.x), flat(edges.x_next), flat(edges.sigma), flat(edges.sigma_next)
    v = policy.velocity(x, sigma, cond_repeat(edges.cond, T), guidance)
    scale = edges.extras.get("logprob_scale")
    scale = 1.0 if scale is None else flat(scale)
    out = split_step(kernel, x, v, sigma, sigma_next, action=x_next, logprob_scale=scale, **(kernel_kwargs or {}))
    return StepOutput(out.x_next, out.log_prob.view(B, T), out.mean, out.std)
