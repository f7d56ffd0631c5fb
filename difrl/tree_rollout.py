"""Tree rollouts (BranchGRPO, docs/reference/specs/branch-cps-guard.md §1): seeds in, a branching tree of trajectories
out.

    from difrl.branching import BranchSchedule, nfe
    from difrl.tree_rollout import tree_rollout
    sched = BranchSchedule((0, 3, 6, 9), factor=2)                # 16 leaves per prompt
    tr = tree_rollout(policy, prompts, seeds=torch.arange(2), sigmas=sigma_schedule(20, shift=3.0),
                      schedule=sched, kernel="dance_sde", kernel_kwargs={"noise_level": 0.3},
                      split_noise_scale=4.0)
    rewards = reward(policy.decode(tr.x_leaf))                    # [2 * 16], tree-major, paths lexicographic
    tr.evaluations == nfe(sched, 20, trees=2) == 406              # §1.7 there: 203 per tree
    tr.edges                                                      # difrl.rollout.Rollout of the trained edges, T=1
    recompute(policy, tr.edges, "dance_sde", {"noise_level": 0.3})   # difrl.rollout: the trainer's log-prob

The tree's structure, counts and node seeds are ``difrl.branching``; fusion, depth-wise advantages
and pruning of the edges live in ``difrl.algos.tree``.

**Roots and noise.** Tree p's root latent is ``x_0 = noise(init_seeds[p], -1)`` (the flat engine's
initial noise). The noise of the edge that leaves a node at step i and enters a node with seed s
(``difrl.branching.node_seed``) is ``sample_noise(s, i)`` (counter-based, difrl.utils.rng), so a
node's latent does not depend on which other nodes or prompts exist, nor on the forward batch. A
tree with no split steps is therefore the flat engine's sample with ``seed = root seed``:
``tree_rollout(..., BranchSchedule(()))`` reproduces ``difrl.rollout.rollout`` bit for bit (same
forward batches).

**Noise injection (§1.2).** Steps where ``sde_mask`` is set use `kernel`; split steps are always
SDE; the other steps are deterministic ODE (Euler) steps with log-prob 0 and are not trained
(BranchGRPO-Mix: ``difrl.branching.mix_sde_mask``). At a split step the siblings share the kernel's
mean mu and std s and are drawn as ``x' = mu + kappa * s * z`` (kappa = ``split_noise_scale``).
Their edge log-prob is ``log N(x'; mu, (kappa s)^2)`` with ``kappa_logprob="actual"`` (the
distribution actually sampled; default) or ``log N(x'; mu, s^2)`` with ``"reference"`` (BranchGRPO's
code, kept for comparison: its PPO ratio is consistent but its split-edge score is kappa times too
large, §1.2 pitfall). The kernels take no custom std, so split edges are sampled and scored by
``difrl.samplers.split_step``.

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
logprob_scale=extras["logprob_scale"][:, 0])`` (``difrl.rollout.recompute`` does the forward too); for
rows with scale 1 that is bit-identical to ``KERNELS[kind](..., action=x_next)``, so only split
edges with kappa != 1 under "actual" need it. ``Rollout.select`` indexes the per-edge ``extras``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from difrl.branching import BranchSchedule, Tree, build_tree, effective_sde_mask
from difrl.models.base import Cond, FlowPolicy, cond_select, policy_device
from difrl.rollout import INIT_STEP, Rollout, sample_noise
from difrl.samplers.kernels import KERNELS, ode_step, split_step
from difrl.utils.rng import mix_seed_tensor

KappaLogProb = Literal["actual", "reference"]


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
    device: str | torch.device | None = None,
) -> TreeRollout:
    """One tree per prompt over `sigmas` ([N + 1]); root seed `seeds[p]` (module docstring).

    split_noise_scale: kappa, the std multiplier at split steps (BranchGRPO's script: 4.0).
    kappa_logprob: "actual" scores split edges under kappa * s, "reference" under s (§1.2).
    sde_mask [N] bool: SDE steps between splits (default all; split steps are always SDE).
    prompt_ids / group_ids [P]: per tree (default arange(P)); init_seeds [P]: initial-noise seeds
    (default `seeds`; equal values share one root latent, BranchGRPO's init_same_noise).
    batch_size: model forward batch over the live nodes of a step (default all at once).
    store_nodes: keep every node's latent in ``x_nodes`` (memory: one latent per node).
    device: where latents, noise and edges live (default the policy's device); as in difrl.rollout.rollout no
    per-step tensor leaves it (``tree.log_prob`` too: its consumer, difrl.algos.tree, moves it once)."""
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
    device = policy_device(policy) if device is None else torch.device(device)
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
    log_prob_node = torch.zeros(tree.num_nodes, device=device)
    node_tree = tree.tree.to(device)  # [Nn] each node's tree, for the conditioning rows of a step's live nodes
    x_nodes = [x] if store_nodes else None
    rec = {k: [] for k in ("child", "x", "x_next", "sigma", "sigma_next", "log_prob", "mean", "std", "logprob_scale")}
    evaluations = calls = 0
    x0_pred = x
    sigma_values = sigmas.detach().cpu().tolist()  # python floats: one read of the schedule, no per-step sync
    for i in range(N):
        M = x.shape[0]
        sigma, sigma_next = sigma_values[i], sigma_values[i + 1]
        lo, hi = (int(o) for o in tree.depth_offsets[i:i + 2])  # this step's live nodes: a contiguous range
        live_tree = node_tree[lo:hi]  # [M] each live node's tree
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
            log_prob_node[hi:hi + len(children)] = out.log_prob.float()  # children = the next depth's range
            for name, val in (("child", children), ("x", x_in), ("x_next", out.x_next), ("sigma", sig_in),
                              ("sigma_next", sig_next_in), ("log_prob", out.log_prob), ("mean", out.mean),
                              ("std", out.std), ("logprob_scale", torch.full_like(sig_in, scale))):
                rec[name].append(val)
        x, seed_live = out.x_next, seed_next
        if store_nodes:
            x_nodes.append(x)
    tree.log_prob = log_prob_node  # on `device`: probability fusion (difrl.algos.tree) takes it to the CPU, once
    if N and split[N - 1]:
        x0_pred = x0_pred.repeat_interleave(f, 0)  # siblings made at the last step share the parent's x^0
    edges, edge_index = _edges_rollout(prompts, prompt_ids, group_ids, init_seeds, cond, x, tree, rec, node_seed_t,
                                       lat, device)
    return TreeRollout(tree=tree, edges=edges, trained_edge=edge_index, x_leaf=x, x0_pred_leaf=x0_pred,
                       node_seed=node_seed_t, evaluations=evaluations, forward_calls=calls,
                       x_nodes=torch.cat(x_nodes) if store_nodes else None,
                       info={"kernel": kernel, "kernel_kwargs": dict(kernel_kwargs), "split_noise_scale": kappa,
                             "kappa_logprob": kappa_logprob, "guidance": guidance})
