"""The flow config's method sections: Sol-RL's candidate pool (`solrl`), BranchGRPO's trees (`tree`) and
DiffusionNFT (`nft`). FlowConfig (difrl/train/config.py) holds them and checks them against the rest.

    cfg = load_flow_config("configs/digits_branch.yaml")
    cfg.tree.schedule(cfg.sampler.num_steps)      # the BranchSchedule of the config's split steps
"""

from __future__ import annotations

from dataclasses import dataclass

from difrl.config import cfg_field
from difrl.solrl import SELECT_RULES


@dataclass
class SolRLConfig:
    """Sol-RL (specs/lowprec-and-correctors.md §1.2): stage 1 samples `candidates` seeds per prompt from the
    rollout.precision copy with a deterministic solver in `preview_steps` steps and rewards them; `select`
    picks rollout.group_size of them; stage 2 regenerates exactly those seeds at full precision."""
    candidates: int = cfg_field(64, ge=2, help="candidate seeds per prompt (Sol-RL: 96 for 24 trained)")
    preview_steps: int = cfg_field(6, ge=1, help="ODE steps of a candidate (Sol-RL: 6 of 10)")
    select: str = cfg_field("best_worst", choices=SELECT_RULES, help="which candidates are trained on")
    batch: int | None = cfg_field(None, ge=1, help="candidate forward batch (None = all of a process's at once)")


@dataclass
class TreeConfig:
    """BranchGRPO (specs/branch-cps-guard.md §1): one tree per prompt; every node splits into `factor` children
    at `split_steps`, so a tree has factor ** len(split_steps) leaves (= rollout.group_size). Between splits
    `steps.mode` says which steps are SDE (all_but_last: BranchGRPO; a window: BranchGRPO-Mix, ODE outside it);
    split steps are always SDE. Every SDE edge is a trained transition with its child node's depth-wise
    advantage; pruning drops edges from the backward pass only."""
    split_steps: list[int] | None = cfg_field(None, help="steps at which every node splits; None = `rounds` splits at "
                                                         "k * (num_steps // rounds)")
    rounds: int = cfg_field(4, ge=0, help="uniform splits when split_steps is None (BranchGRPO: 4)")
    factor: int = cfg_field(2, ge=2, help="children per split")
    roots: int = cfg_field(1, ge=1, help="trees per prompt (a forest): each its own initial noise and factor ** splits "
                                         "leaves, rollout.group_size = roots x leaves; advantages are normalised per "
                                         "prompt and depth over its trees (difrl.algos.tree.depthwise_advantages)")
    edge_weight: str = cfg_field("edge", choices=("edge", "leaves"),
                                 help="edge: one loss term per trained edge (BranchGRPO); leaves: each edge's loss and KL "
                                      "weighted by the leaves below it (over their mean), so every step weighs as in flat "
                                      "GRPO (difrl.algos.tree.edge_leaf_weights)")
    noise_scale: float = cfg_field(1.0, gt=0.0, help="kappa: the kernel's std multiplier at split steps (BranchGRPO's "
                                                     "script: 4.0)")
    kappa_logprob: str = cfg_field("actual", choices=("actual", "reference"),
                                   help="split edges' log-prob under the std actually used (kappa s) or under s as "
                                        "BranchGRPO's code does (kept for comparison)")
    fusion: str = cfg_field("mean", choices=("mean", "path_prob", "soft"),
                            help="internal-node reward: mean of the leaves below, path-probability weighted, or DTS's "
                                 "soft value (1/lambda) log mean exp(lambda r)")
    fusion_lambda: float = cfg_field(1.0, gt=0.0, help="soft: lambda; path_prob: alpha on the edge log-probs")
    width_prune: str = cfg_field("none", choices=("none", "per_branch", "best_worst"),
                                 help="drop tail edges (after the last split) from the backward pass: the best per "
                                      "branch, or each tree's best and worst")
    width_ratio: float = cfg_field(0.5, gt=0.0, le=1.0, help="fraction of tail edges width pruning keeps")
    depth_prune: list[int] = cfg_field(default_factory=list, help="child depths whose edges are not trained "
                                                                 "(BranchGRPO: 15,16,17,18 of 20)")
    depth_slide_every: int | None = cfg_field(None, ge=1, help="move the pruned depths one earlier every this many "
                                                               "iterations (BranchGRPO: 30); None = fixed")
    depth_stop: int | None = cfg_field(None, ge=0, help="sliding depth pruning stops here; None = the last split step")

    def schedule(self, num_steps: int):
        from difrl.branching import BranchSchedule

        if self.split_steps is None:
            return BranchSchedule.uniform(self.rounds, num_steps, self.factor) if self.rounds else BranchSchedule((), self.factor)
        return BranchSchedule(tuple(sorted(self.split_steps)), self.factor)


@dataclass
class NFTConfig:
    """DiffusionNFT (difrl/algos/nft.py; specs §1.6). Rollouts are ODE from the "old" policy, an EMA of the
    trained one: old <- d old + (1 - d) new after every iteration, d = min(old_decay_rate * iteration, old_decay_max)."""
    beta: float = cfg_field(1.0, gt=0.0, help="implicit-policy step beta")
    adv_clip: float = cfg_field(5.0, gt=0.0, help="advantages clipped to +-adv_clip, and the loss scale")
    ref_beta: float = cfg_field(1e-4, ge=0.0, help="weight of mean((v - v_ref)^2) toward the reference policy")
    timestep_fraction: float = cfg_field(0.6, gt=0.0, le=1.0, help="trained sigmas: the first fraction of the schedule")
    old_decay_rate: float = cfg_field(0.001, ge=0.0)
    old_decay_max: float = cfg_field(0.5, ge=0.0, lt=1.0)
