"""The method stages of the flow recipe: the advantage-stage pieces of Pref-GRPO and GARDO (difrl/train/flow/trainer.py), on the rewards
gathered over every process (groups may span processes), and GARDO's adaptive reference.

    group_adv = advantage_function(cfg)       # valid_group_advantages, or Pref-GRPO's win-rate version of it
    adv, failed = group_adv(all_scores, weights, all_groups, all_bad, cfg.advantage, cfg.reward.aggregate)
    gardo = Gardo(cfg, unwrapped, run.state)   # cfg.gardo.enabled: the reference copy, the controller
    adv, flags = gardo.shape(adv, all_scores, weights, all_groups, failed, features)   # flags [N]: KL applies
    row.update(gardo.after_update(it, kl))     # refresh the reference after a large KL or every reset_every
    scores = candidate_reward(cfg, world, ...)  # Sol-RL stage 1's ranking score; tree_stats(...): BranchGRPO's counts

docs/guides/methods.md has the equations and the reference recipes.
"""

from __future__ import annotations

import torch

from difrl.algos import Advantages
from difrl.algos.gardo import (
    FracController,
    diversity_shaped,
    diversity_weights,
    gate,
    proxy_uncertainty,
)
from difrl.algos.pref import group_win_rates, sigmoid_judge
from difrl.rewards import score_all
from difrl.train.ema import WeightSnapshot
from difrl.train.reward_stage import across_processes, score_rewards, valid_group_advantages
from difrl.train.run.state import trainable_params
from difrl.utils.collectives import reduce
from difrl.utils.modules import use_module


def build_judge(pref_cfg, weights: dict[str, float]):
    """pref.judge -> a pairwise judge (difrl.algos.pref): sigmoid over the weighted scalar reward, or a
    module:function judge (scores, i, j) -> P(i beats j)."""
    if pref_cfg.judge == "sigmoid":
        return sigmoid_judge(weights, pref_cfg.tau)
    from difrl.rewards import import_user_module

    module, _, name = pref_cfg.judge.partition(":")
    return getattr(import_user_module(module), name)


def advantage_function(cfg):
    """The advantage stage's function: valid_group_advantages, or with pref.judge Pref-GRPO's: each group's win
    rates (over the samples whose rewards did not fail) normalised like any reward (cfg.advantage); the returned
    Advantages.reward stays the scalar weighted reward (the log's reward_mean), not the win rate (always 1/2)."""
    if cfg.pref.judge is None:
        return valid_group_advantages

    def pref_group_advantages(scores, weights, group_ids, bad, adv_cfg, aggregate, baseline=None):
        judge = build_judge(cfg.pref, weights)
        failed = torch.isin(group_ids, group_ids[bad].unique())
        ok = ~failed
        win = torch.full((len(group_ids),), float("nan"))
        if ok.any():
            win[ok] = group_win_rates({k: v[ok] for k, v in scores.items()}, group_ids[ok], judge)
        adv, failed = valid_group_advantages({"win_rate": win}, {"win_rate": 1.0}, group_ids, bad, adv_cfg, "reward_sum",
                                             baseline)
        total = sum(w * scores[k] for k, w in weights.items())
        return Advantages(adv.advantages, adv.zero_spread, torch.where(failed, float("nan"), total)), failed

    return pref_group_advantages


class Gardo:
    """GARDO's state in a run: the adaptive reference, the flagged-fraction controller and the iteration of the last
    refresh (run.state["gardo"], so a resumed run continues them). The reference is a frozen copy of the trained
    network (a separate module: swapping weights in place while the policy's graph is held would invalidate that
    graph) whose trainable weights come from `store`, a WeightSnapshot of the policy's weights that a refresh
    takes again and the checkpoint keeps (extras)."""

    def __init__(self, cfg, policy, unwrapped, state: dict):
        import copy

        self.cfg, self.g, self.policy, self.unwrapped = cfg, cfg.gardo, policy, unwrapped
        self.reference = copy.deepcopy(unwrapped).requires_grad_(False)
        self.store = WeightSnapshot(trainable_params(unwrapped))  # the policy's trainable weights at the last refresh
        self._loaded = None  # the store.shadow dict the reference module holds (a resume replaces the dict)
        self.ctl = FracController(self.g.kl_frac, self.g.kl_frac_min, self.g.kl_frac_max, self.g.kl_frac_rate,
                                  self.g.window)
        self.state = state.setdefault("gardo", {"last_reset": 0, "controller": None})

    def extras(self) -> dict:
        return {"gardo_reference": self.store}

    @torch.no_grad()
    def reference_ctx(self):
        """The context in which the policy computes the reference (the trainee's reference_ctx under GARDO)."""
        if self._loaded is not self.store.shadow:
            for name, value in self.store.shadow.items():
                self.reference.get_parameter(name).copy_(value)
            self._loaded = self.store.shadow
        self.reference.train(self.unwrapped.training)  # the same mode as the trained network's forward
        return use_module(self.policy, self.reference)

    def aux_keys(self, weights: dict[str, float]) -> list[str]:
        return list(self.g.aux_rewards) if self.g.aux_rewards is not None else [k for k, w in weights.items() if w == 0]

    def shape(self, adv: Advantages, scores: dict, weights: dict[str, float], group_ids: torch.Tensor,
              failed: torch.Tensor, features: torch.Tensor | None) -> tuple[Advantages, torch.Tensor]:
        """The gated-KL flags [N] bool (the samples the proxy overrates most, or with gardo.flag=underrated those it
        underrates most, as the reference code; none among failed groups) and, with
        gardo.diversity, the advantages shaped by the nearest-neighbour distance in the features [N, D]."""
        self.ctl.load(self.state["controller"])  # a resumed run's controller
        ok = ~failed
        flags = torch.zeros(len(group_ids), dtype=torch.bool)
        if ok.any():
            proxy = sum(w * scores[k][ok] for k, w in weights.items() if w != 0)
            u = proxy_uncertainty(proxy, [scores[k][ok] for k in self.aux_keys(weights)])
            if self.g.flag == "underrated":  # the reference code's sign: its ranks count 1 = best, so its proxy rank
                u = -u                       # minus the auxiliaries' is (N - 1) * -u (without ties)
            flags[ok] = gate(u, self.ctl.frac)  # this batch's flags use the fraction set by the batches before it
            self.ctl.update(u)
            self.state["controller"] = self.ctl.state()
        a = adv.advantages
        if self.g.diversity and features is not None and ok.any():
            shaped = a.clone()
            shaped[ok] = diversity_shaped(a[ok], diversity_weights(features[ok], group_ids[ok]))
            a = shaped.clamp(-self.cfg.advantage.clip, self.cfg.advantage.clip)
        return Advantages(a, adv.zero_spread, adv.reward), flags

    def after_update(self, it: int, kl: float | None) -> dict:
        """Refresh the reference from the policy when this update's KL (over the flagged samples) exceeded
        gardo.reset_kl or gardo.reset_every iterations passed since the last refresh. Returns the log's columns."""
        reset = (kl is not None and kl > self.g.reset_kl) or it + 1 - self.state["last_reset"] >= self.g.reset_every
        if reset:
            self.store.take()
            self.store.shadow = dict(self.store.shadow)  # a new dict: the reference module reloads it
            self.state["last_reset"] = it + 1
        return {"gardo/kl_frac": self.ctl.frac, "gardo/reference_reset": int(reset)}


def candidate_reward(cfg, world, rewards, weights, run, it: int, say, images, prompts, prompt_ids,
                     seeds) -> torch.Tensor:
    """Sol-RL stage 1's score: the weighted reward of each candidate; a failed one ranks last (-inf) under
    reward.on_error=drop_group (stage 2 re-scores and drops what still fails)."""
    metadata = [world.metadata(int(p)) for p in prompt_ids]
    scores, bad = score_rewards(lambda: score_all(rewards, images, prompts, metadata, seeds, prompt_ids), len(prompts),
                                cfg.reward.on_error, lambda: run.checkpoint(it), f"iteration {it + 1}, Sol-RL candidates",
                                run.dir, say, across_processes(run.accelerator))
    total = sum(w * scores[n] for n, w in weights.items())
    return torch.where(bad, -float("inf"), total)


def tree_stats(tr, advantages: torch.Tensor, accelerator) -> dict:
    """Edges trained and sampled (all processes) and the mean |advantage| of the trained ones."""
    adv_sum = reduce(accelerator, torch.tensor([float(advantages.abs().sum()), float(len(advantages))], dtype=torch.float64))
    return {"tree/edges_trained": int(adv_sum[1]), "tree/edges_sampled": len(tr.edges) * accelerator.num_processes,
            "tree/edge_adv_abs_mean": float(adv_sum[0] / max(float(adv_sum[1]), 1.0))}
