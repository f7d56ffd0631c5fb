"""The flow config's method sections: Sol-RL's candidate pool (`solrl`), BranchGRPO's trees (`tree`),
DiffusionNFT (`nft`), and the objectives of docs/guides/methods.md: the re-noised matching losses' shared keys (`matching`),
AWM (`awm`), online Diffusion-DPO (`dpo`), DGPO (`dgpo`), Flow-DPPO (`dppo`), reward backpropagation (`draft`,
`refl`), GARDO (`gardo`) and Pref-GRPO (`pref`). FlowConfig (difrl/train/config.py) holds them and checks them
against the rest (check_objective here; the last four in difrl/train/method_checks.py).

    cfg = load_flow_config("configs/digits_branch.yaml")
    cfg.tree.schedule(cfg.sampler.num_steps)      # the BranchSchedule of the config's split steps
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields

from difrl.algos.matching import AWM_WEIGHTINGS
from difrl.config import cfg_field, config_error
from difrl.solrl import SELECT_RULES

MATCHING_OBJECTIVES = ("awm", "dpo", "dgpo")  # likelihood-free, on re-noised clean samples (difrl.algos.matching)
LOG_PROB_OBJECTIVES = ("grpo", "dppo")  # on the stored SDE transitions' log-probs


@dataclass
class SolRLConfig:
    """Sol-RL (docs/reference/specs/lowprec-and-correctors.md §1.2): stage 1 samples `candidates` seeds per prompt from
    the rollout.precision copy with a deterministic solver in `preview_steps` steps and rewards them; `select`
    picks rollout.group_size of them; stage 2 regenerates exactly those seeds at full precision."""
    candidates: int = cfg_field(64, ge=2, help="candidate seeds per prompt (Sol-RL: 96 for 24 trained)")
    preview_steps: int = cfg_field(6, ge=1, help="ODE steps of a candidate (Sol-RL: 6 of 10)")
    select: str = cfg_field("best_worst", choices=SELECT_RULES, help="which candidates are trained on")
    batch: int | None = cfg_field(None, ge=1, help="candidate forward batch (None = all of a process's at once)")


@dataclass
class TreeConfig:
    """BranchGRPO (docs/reference/specs/branch-cps-guard.md §1): one tree per prompt; every node splits into `factor`
    children at `split_steps`, so a tree has factor ** len(split_steps) leaves (= rollout.group_size). Between splits
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
    """DiffusionNFT (difrl/algos/nft.py; docs/reference/specs/lowprec-and-correctors.md §1.6). Rollouts are ODE from the
    "old" policy, an EMA of the trained one: old <- d old + (1 - d) new after every iteration,
    d = min(old_decay_rate * iteration, old_decay_max)."""
    beta: float = cfg_field(1.0, gt=0.0, help="implicit-policy step beta")
    adv_clip: float = cfg_field(5.0, gt=0.0, help="advantages clipped to +-adv_clip, and the loss scale")
    ref_beta: float = cfg_field(1e-4, ge=0.0, help="weight of mean((v - v_ref)^2) toward the reference policy")
    timestep_fraction: float = cfg_field(0.6, gt=0.0, le=1.0, help="trained sigmas: the first fraction of the schedule")
    old_decay_rate: float = cfg_field(0.001, ge=0.0)
    old_decay_max: float = cfg_field(0.5, ge=0.0, lt=1.0)


@dataclass
class MatchingConfig:
    """What AWM, DPO and DGPO share (difrl/train/flow/matching_objectives.py): each rollout's clean sample is noised afresh
    at the first `timestep_fraction` of the rollout's sigmas (noise from the sample's seed; DPO / DGPO: from its
    group's, so a group's samples share it) and the velocity is compared with the flow-matching target."""
    timestep_fraction: float = cfg_field(0.6, gt=0.0, le=1.0, help="trained sigmas: the first fraction of the rollout "
                                                                    "schedule (AWM's recipe: 0.9, DGPO's: 0.99)")
    rollout: str = cfg_field("ode", choices=("ode", "sde"),
                             help="ode: deterministic rollouts (the references'); sde: the sampler.kind kernel on the "
                                  "steps.mode steps, for exploration (nothing but the clean sample is trained)")


@dataclass
class AWMConfig:
    """Advantage-weighted matching (docs/guides/methods.md "AWM"; arXiv 2509.25050): loss A' w(l, sigma) with
    A' = clip(A, -adv_clip, adv_clip) * adv_max / adv_clip, plus train.kl_beta * mean((v - v_ref)^2) and
    ema_beta * mean((v - v_ema)^2) toward an EMA of the policy, ema <- d ema + (1 - d) new after every iteration,
    d = min(ema_decay_rate * iteration, ema_decay_max)."""
    weighting: str = cfg_field("ghuber", choices=AWM_WEIGHTINGS, help="w(l, sigma): l, sigma l, or the generalised "
                                                                      "Huber sigma ((l + e)^p - e^p) / p (reference)")
    ghuber_power: float = cfg_field(0.25, gt=0.0, le=1.0, help="p of weighting=ghuber")
    adv_clip: float = cfg_field(5.0, gt=0.0, help="advantages clipped to +-adv_clip ...")
    adv_max: float = cfg_field(1.0, gt=0.0, help="... then scaled so that +-adv_clip becomes +-adv_max")
    ema_beta: float = cfg_field(1.0, ge=0.0, help="weight of the velocity KL to the EMA policy (0: no EMA is kept)")
    ema_decay_rate: float = cfg_field(0.001, ge=0.0)
    ema_decay_max: float = cfg_field(0.3, ge=0.0, lt=1.0)


@dataclass
class DPOConfig:
    """Online Diffusion-DPO (docs/guides/methods.md "DPO"): each group's best and worst sample form a pair;
    loss softplus(beta ((l_w - l_w,ref) - (l_l - l_l,ref))) per trained sigma, the reference frozen."""
    beta: float = cfg_field(2000.0, gt=0.0, help="implicit-reward scale (Flow-Factory's online DPO: 2000)")


@dataclass
class DGPOConfig:
    """DGPO (docs/guides/methods.md "DGPO"; arXiv 2510.08425): group weight sigmoid((beta / G) sum_i A_i (l_i - l_i,ref))
    on each sample's A_i l_i, the reference frozen."""
    beta: float = cfg_field(100.0, gt=0.0, help="beta_dpo (reference recipes: 100; 10 ~ 100)")
    adv_clip: float = cfg_field(5.0, gt=0.0, help="advantages clipped to +-adv_clip")


@dataclass
class DPPOConfig:
    """Flow-DPPO (docs/guides/methods.md "Flow-DPPO"; difrl/algos/dppo.py): -A rho per SDE transition, dropped where the
    exact Gaussian KL(old || new), per latent element, reaches kl_threshold and the step pushes further."""
    kl_threshold: float = cfg_field(1e-5, gt=0.0, help="trust region on the per-element transition KL (UniRL: 1e-5)")


def check_objective(cfg, refuse_ignored) -> None:
    """The objectives of docs/guides/methods.md against the rest of a FlowConfig: a located ConfigError for a setting they
    cannot honour, and for a method section set while another objective is trained (refuse_ignored: config.py's)."""
    t, r, obj = cfg.train, cfg.rollout, cfg.train.objective
    owners = {"matching": MATCHING_OBJECTIVES, "awm": ("awm",), "dpo": ("dpo",), "dgpo": ("dgpo",), "dppo": ("dppo",)}
    for name, users in owners.items():
        if obj not in users:
            section = getattr(cfg, name)
            refuse_ignored(section, name, [f.name for f in fields(section)], f"train.objective={obj}: the {name} "
                           f"section configures train.objective={' / '.join(users)}")
    if obj in MATCHING_OBJECTIVES:
        refuse_ignored(t, "train", ("clip_low", "clip_high", "kl_form"), f"train.objective={obj} has no log-prob ratio "
                       "to clip and no Gaussian step KL (its train.kl_beta weighs mean((v - v_ref)^2))")
        if r.precision != "fp32" or r.sync_every != 1:
            key = "rollout.precision" if r.precision != "fp32" else "rollout.sync_every"
            raise config_error(key, f"train.objective={obj} trains on the policy's own rollouts; rollouts from a "
                                    "copy (rollout.precision, rollout.sync_every) go through the log-prob recompute "
                                    "it does not have (use train.objective=nft or grpo with a copy)")
    if obj == "dppo":
        refuse_ignored(t, "train", ("clip_low", "clip_high"), "train.objective=dppo replaces PPO's ratio clip by the "
                       "trust region dppo.kl_threshold")


@dataclass
class DraftConfig:
    """DRaFT-K (train.objective=draft; docs/guides/methods.md "Reward backpropagation"): each sample runs the schedule with `kernel`, the last
    `k` steps with gradient, and the loss is minus its differentiable reward (no advantages, no log-probs)."""
    k: int = cfg_field(1, ge=1, help="sampler steps the reward's gradient flows through (DRaFT-K; the paper's best: 1; "
                                     "sampler.num_steps = full DRaFT)")
    kernel: str = cfg_field("ode", choices=("ode", "sampler"),
                            help="ode: deterministic Euler steps (DRaFT's DDIM with eta 0); sampler: sampler.kind with "
                                 "each sample's step noise")


@dataclass
class ReflConfig:
    """ReFL (train.objective=refl; docs/guides/methods.md "Reward backpropagation"): each sample runs to a step t drawn uniformly from
    [first_step, last_step] without gradient, predicts x0 in one step from x_t with gradient, and the loss is
    minus the reward of that prediction."""
    first_step: int | None = cfg_field(None, ge=0, help="earliest stopping step; None = 3/4 of sampler.num_steps "
                                                        "(ImageReward's ReFL: steps 30..39 of 40)")
    last_step: int | None = cfg_field(None, ge=0, help="latest stopping step; None = sampler.num_steps - 1")
    kernel: str = cfg_field("ode", choices=("ode", "sampler"), help="the steps before t: as draft.kernel")

    def steps(self, num_steps: int) -> tuple[int, int]:
        """[first, last] stopping steps for a schedule of `num_steps`."""
        first = (3 * num_steps) // 4 if self.first_step is None else self.first_step
        return first, num_steps - 1 if self.last_step is None else self.last_step


@dataclass
class GardoConfig:
    """GARDO (docs/guides/methods.md "GARDO"): the KL (train.kl_beta, train.kl_form) only on the samples whose proxy reward
    its auxiliary rewards disagree with most, against a reference refreshed from the policy, and positive advantages
    scaled by each sample's distance to its nearest group member."""
    enabled: bool = cfg_field(False, help="train GRPO with GARDO's gated KL, adaptive reference and diversity shaping")
    aux_rewards: list[str] | None = cfg_field(None, help="score keys of the auxiliary rewards that judge the proxy; "
                                                         "None = the rewards of weight 0 in reward.weights")
    kl_frac: float = cfg_field(0.1, gt=0.0, le=1.0, help="first fraction of the uncertain samples that get the KL")
    kl_frac_min: float = cfg_field(0.02, gt=0.0, le=1.0)
    kl_frac_max: float = cfg_field(0.2, gt=0.0, le=1.0)
    kl_frac_rate: float = cfg_field(0.1, ge=0.0, lt=1.0, help="the fraction grows (shrinks) by this factor when the "
                                                              "batch's mean uncertainty is above (below) all of the last "
                                                              "`window` iterations'")
    window: int = cfg_field(20, ge=1)
    reset_every: int = cfg_field(15, ge=1, help="iterations after which the reference is refreshed from the policy")
    reset_kl: float = cfg_field(3e-4, gt=0.0, help="refresh the reference after an update whose KL exceeds this")
    diversity: bool = cfg_field(True, help="scale positive advantages by the nearest-neighbour distance in the group")
    flag: str = cfg_field("overrated", choices=("overrated", "underrated"),
                          help="which disagreement gets the KL: overrated = the samples the proxy ranks above the "
                               "auxiliaries (the paper's reward-hacking pattern); underrated = those it ranks below, "
                               "what the reference code's rank difference selects (docs/guides/methods.md GARDO)")


@dataclass
class PrefConfig:
    """Pref-GRPO (docs/guides/methods.md "Pref-GRPO"): the trained reward of a sample is its win rate against the rest of its
    group under a pairwise judge."""
    judge: str | None = cfg_field(None, help="None = off; sigmoid: P(a > b) = sigmoid((r_a - r_b) / tau) from the "
                                             "weighted scalar reward; or a module:function pairwise judge "
                                             "(scores_a, scores_b, tau) -> P(a > b)")
    tau: float = cfg_field(0.05, gt=0.0, help="sigmoid judge's temperature, in reward units")
