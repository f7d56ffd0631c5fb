"""Inference-time search over denoising trees: Diffusion Tree Sampling (DTS), DTS* and best-of-N
(docs/reference/specs/branch-cps-guard.md §5), on any flow policy and reward.

    from difrl.search import SearchConfig, dts, best_of_n
    score = lambda images, prompt: reward(images, [prompt] * len(images), None)["digit_prob"]   # [B] -> [B]
    res = dts(policy, "a handwritten 3", score, sigma_schedule(10), SearchConfig(budget=160, lam=1.0), seed=0)
    res.samples(4)            # DTS: 4 draws from the tree, approximately p(x) exp(lam r(x)) / Z
    res.best                  # DTS*: (run with star=True) the highest-reward leaf found
    bon = best_of_n(policy, "a handwritten 3", score, sigma_schedule(10), n=16, seed=0)   # 160 NFEs too
    difrl sample configs/digits.yaml --search dts-star --budget 160 --prompt "a handwritten 3"

**Tree.** A dummy root sits above the initial noises; a node at depth d is the latent after d of the
N steps; leaves (depth N) carry their reward. Node noise is seeded like the BranchGRPO engine
(difrl.branching.node_seed): child j of a node with seed s gets seed mix_seed(s, j), its initial noise (a
child of the root) is noise(seed, -1) and the step into it noise(parent-step seed, step), so every
node is a pure function of (seed, path). Steps 0..N-2 use the stochastic `kernel`, the last step is
the deterministic Euler step (as the trainer's all_but_last), so a leaf is the clean sample.

**One iteration** (DTS, Jain et al. 2025): descend from the root; at a node with fewer than its cap
of children (``root_children`` at the root, ``children`` below) draw a new child from the model and
roll it out to a leaf, adding every intermediate latent to the tree; otherwise move to a child drawn
with probability proportional to exp(lam * v(child)) (DTS) or to the argmax (DTS*), skipping children
whose subtree is complete (every node at its cap, so every iteration adds a leaf; a complete tree ends
the search before the budget). Then back up the
soft values along the path: v(leaf) = r(leaf), v(n) = (1/lam) log mean_c exp(lam v(c)) over its
children (children are i.i.d. draws of p(x_{d+1} | x_d), so the uniform mean is the Monte-Carlo
estimate of the soft Bellman backup; difrl.algos.tree.soft_mean; BranchGRPO's mean fusion is lam -> 0).

**Budget.** Every step of every new node is one model evaluation (two network rows under CFG);
an iteration whose rollout would exceed ``budget`` is not started, so DTS/DTS* and best-of-N compare at
equal NFEs (best-of-N spends N per sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from difrl.algos.tree import soft_mean
from difrl.models.base import FlowPolicy, policy_device
from difrl.rollout import INIT_STEP, rollout, sample_noise
from difrl.samplers.kernels import KERNELS, ode_step
from difrl.samplers.schedules import all_but_last
from difrl.utils.rng import mix_seed

ScoreFn = Callable[[torch.Tensor, str], torch.Tensor]  # (images [B, ...] in [0, 1], prompt) -> rewards [B]


@dataclass
class SearchConfig:
    budget: int = 160  # model evaluations per prompt (NFE)
    lam: float = 1.0  # inverse temperature of the target p(x) exp(lam r(x)): choose it for the reward's scale
    children: int = 2  # children cap of an internal node
    root_children: int = 8  # initial noises (children of the dummy root)
    kernel: str = "flow_sde"
    kernel_kwargs: dict = field(default_factory=lambda: {"noise_level": 0.7})
    guidance: float = 1.0

    def __post_init__(self):
        if self.lam <= 0:
            raise ValueError(f"lam must be > 0, got {self.lam}")
        if self.children < 1 or self.root_children < 1:
            raise ValueError("children and root_children must be >= 1")
        if self.kernel not in KERNELS or self.kernel == "ode":
            raise ValueError(f"kernel must be a stochastic kernel ({', '.join(k for k in KERNELS if k != 'ode')}), "
                             f"got {self.kernel!r}: an ODE child would equal its siblings")


@dataclass
class SearchResult:
    """The searched tree of one prompt. Node 0 is the dummy root (depth -1)."""

    latents: list[torch.Tensor | None]  # per node [*latent] (None for the root)
    depth: list[int]
    parent: list[int]
    kids: list[list[int]]
    value: list[float]  # soft value estimates (reward at leaves)
    seed: list[int]
    leaves: list[int]  # leaf node ids in creation order
    rewards: list[float]  # their rewards
    leaf_nfe: list[int]  # NFEs spent when each leaf was reached (the anytime curve: any smaller budget is a prefix)
    nfe: int  # model evaluations spent (x2 network rows under CFG)
    iterations: int
    lam: float
    star: bool
    decoded: list[torch.Tensor] = field(default_factory=list)  # per leaf, the decoded image

    @property
    def best(self) -> torch.Tensor:
        """The latent of the highest-reward leaf found (DTS*'s answer) [*latent]."""
        return self.latents[self.leaves[max(range(len(self.rewards)), key=self.rewards.__getitem__)]]

    @property
    def best_reward(self) -> float:
        return max(self.rewards)

    def samples(self, k: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[int]]:
        """k descents from the root, each child drawn with probability prop. to exp(lam v): DTS's samples
        [k, *latent] (leaves may repeat) and their node ids."""
        gen = generator or torch.Generator().manual_seed(0)
        out = []
        for _ in range(k):
            n = 0
            while self.kids[n]:
                n = _sample_child(self, n, gen)
            out.append(n)
        return torch.stack([self.latents[n] for n in out]), out


def _sample_child(t: SearchResult, node: int, gen: torch.Generator, kids: list[int] | None = None) -> int:
    kids = t.kids[node] if kids is None else kids
    logits = torch.tensor([t.lam * t.value[c] for c in kids], dtype=torch.float64)
    return kids[int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))]


@torch.no_grad()
def dts(policy: FlowPolicy, prompt: str, score: ScoreFn, sigmas: torch.Tensor, cfg: SearchConfig = SearchConfig(),
        seed: int = 0, star: bool = False, max_iterations: int | None = None) -> SearchResult:
    """Diffusion Tree Sampling (star=False) or DTS* (star=True) for one prompt under an NFE budget."""
    N = len(sigmas) - 1
    lat = tuple(policy.latent_shape)
    dev = policy_device(policy)  # node latents and noise live with the policy (no per-step host round trip)
    cond = {k: v.to(dev) for k, v in policy.encode([prompt]).items()}
    sigmas = sigmas.to(dev)
    gen = torch.Generator().manual_seed(mix_seed(seed, 11))
    t = SearchResult(latents=[None], depth=[-1], parent=[-1], kids=[[]], value=[0.0], seed=[int(seed)], leaves=[],
                     rewards=[], leaf_nfe=[], nfe=0, iterations=0, lam=float(cfg.lam), star=star)
    sde = all_but_last(N)

    full = [False]  # a leaf, or a node whose children are all there and all full: nothing left to expand below

    def add(x: torch.Tensor, parent: int, node_seed: int) -> int:
        full.append(False)
        t.latents.append(x)
        t.depth.append(t.depth[parent] + 1)
        t.parent.append(parent)
        t.kids.append([])
        t.value.append(0.0)
        t.seed.append(node_seed)
        t.kids[parent].append(len(t.latents) - 1)
        return len(t.latents) - 1

    def child_of(node: int) -> int:
        """A new child of `node` drawn from the model (the root's: a new initial noise)."""
        s = mix_seed(t.seed[node], len(t.kids[node]))
        d = t.depth[node]
        if d < 0:
            return add(sample_noise(torch.tensor([s]), INIT_STEP, lat, dev)[0], node, s)
        x = t.latents[node][None]
        sigma, sigma_next = sigmas[d].view(1), sigmas[d + 1].view(1)
        v = policy.velocity(x, sigma, cond, cfg.guidance)
        t.nfe += 1
        if sde[d]:
            out = KERNELS[cfg.kernel](x, v, sigma, sigma_next, sample_noise(torch.tensor([s]), d, lat, dev), **cfg.kernel_kwargs)
        else:
            out = ode_step(x, v, sigma, sigma_next)
        return add(out.x_next[0], node, s)

    cap = lambda n: cfg.root_children if n == 0 else cfg.children  # noqa: E731
    limit = max_iterations or 10 * max(cfg.budget, 1)
    while t.iterations < limit and not full[0]:
        node = 0
        while len(t.kids[node]) == cap(node):  # full children are skipped: each iteration expands something
            open_kids = [c for c in t.kids[node] if not full[c]]
            node = max(open_kids, key=t.value.__getitem__) if star else _sample_child(t, node, gen, open_kids)
        if t.depth[node] < N:  # expand here and roll out to a leaf: N - depth evaluations (N from the root)
            cost = N - max(t.depth[node], 0)
            if t.nfe + cost > cfg.budget:
                break
            while t.depth[node] < N:
                node = child_of(node)
            full[node] = True
            image = policy.decode(t.latents[node][None])
            r = float(score(image, prompt)[0])
            if not math.isfinite(r):
                raise ValueError(f"DTS: the reward returned {r} for prompt {prompt!r} (seed {seed}, leaf {len(t.leaves)})")
            t.leaves.append(node)
            t.rewards.append(r)
            t.leaf_nfe.append(t.nfe)
            t.decoded.append(image[0])
            t.value[node] = r
        t.iterations += 1
        # back up the soft values along the path
        n = t.parent[node]
        while n >= 0:
            t.value[n] = soft_mean(torch.tensor([t.value[c] for c in t.kids[n]], dtype=torch.float64), cfg.lam)
            full[n] = len(t.kids[n]) == cap(n) and all(full[c] for c in t.kids[n])
            n = t.parent[n]
    if not t.leaves:
        raise ValueError(f"DTS: a budget of {cfg.budget} NFE cannot pay for one {N}-step sample")
    return t


@torch.no_grad()
def best_of_n(policy: FlowPolicy, prompt: str, score: ScoreFn, sigmas: torch.Tensor, n: int, seed: int = 0,
              cfg: SearchConfig = SearchConfig()) -> dict:
    """n independent samples with the same kernel (SDE steps, deterministic last step), the best by reward.
    NFE = n * N. Returns {"best", "best_reward", "samples", "rewards", "nfe"}."""
    N = len(sigmas) - 1
    seeds = torch.tensor([mix_seed(seed, 12, i) for i in range(n)])
    batch = rollout(policy, [prompt] * n, seeds, sigmas, cfg.kernel, cfg.kernel_kwargs, all_but_last(N),
                    guidance=cfg.guidance)
    rewards = score(policy.decode(batch.x_final), prompt)
    i = int(rewards.argmax())
    return {"best": batch.x_final[i], "best_reward": float(rewards[i]), "samples": batch.x_final, "rewards": rewards,
            "nfe": n * N}
