"""FlowConfig's checks of the reward-backpropagation, GARDO and Pref-GRPO sections against the rest of the config
(FlowConfig.validate calls check_methods): a located ConfigError naming the key, before anything loads.

    check_methods(cfg, refuse_ignored)   # e.g. train.objective=draft with reward.weights={ocr: 1}: "reward.weights.ocr ... not
                         # differentiable"
"""

from __future__ import annotations

from dataclasses import fields

from difrl.config import config_error

DIFFERENTIABLE_HINT = ("the differentiable built-ins are digit_prob, digit_margin, clip_score, pickscore, hpsv2, "
                       "aesthetic and brightness")


def _differentiable(name: str) -> bool | None:
    from difrl.rewards import differentiable

    try:
        return differentiable(name)
    except (ValueError, ImportError, AttributeError):  # an unknown reward: RewardConfig.validate names it
        return None


def check_methods(cfg, refuse_ignored) -> None:
    """`refuse_ignored`: difrl.train.config's (passed in: this module is below config.py's)."""
    t, r, obj = cfg.train, cfg.rollout, cfg.train.objective
    backprop = obj in ("draft", "refl")
    for name, section in (("draft", cfg.draft), ("refl", cfg.refl)):
        if obj != name:
            refuse_ignored(section, name, [f.name for f in fields(section)], f"train.objective={obj}: the {name} "
                           f"section configures train.objective={name}")
    if backprop:
        check_backprop(cfg, refuse_ignored)
    g = cfg.gardo
    if not g.enabled:
        refuse_ignored(g, "gardo", [f.name for f in fields(g) if f.name != "enabled"], "gardo.enabled=false")
    else:
        if obj != "grpo":
            raise config_error("gardo.enabled", f"GARDO gates the GRPO loss's per-step KL; train.objective={obj} has "
                                                "none (use train.objective=grpo)")
        if t.kl_beta <= 0:
            raise config_error("train.kl_beta", "GARDO's gated KL needs a weight > 0 (its recipes: 0.01 .. 0.07)")
        if r.kind == "tree":
            raise config_error("rollout.kind", "GARDO's flags and diversity are per sample; a tree trains edges "
                                               "(use rollout.kind=flat or solrl)")
        weights = cfg.reward.weights or {}
        from difrl.rewards import reward_key

        keys = {reward_key(n): w for n, w in weights.items()}
        aux = g.aux_rewards if g.aux_rewards is not None else [k for k, w in keys.items() if w == 0]
        if not aux:
            raise config_error("gardo.aux_rewards", "GARDO judges the proxy reward by auxiliary rewards, and there are "
                                                    "none: add them to reward.weights with weight 0 (scored, not "
                                                    "trained on), e.g. reward.weights={digit_prob: 1.0, digit_margin: 0.0}")
        missing = [k for k in aux if k not in keys]
        if missing:
            raise config_error("gardo.aux_rewards", f"{missing} are not rewards of reward.weights ({sorted(keys)}); an "
                                                    "auxiliary reward must be scored: add it there with weight 0")
        if not any(w != 0 for k, w in keys.items() if k not in aux):
            raise config_error("reward.weights", "GARDO needs a proxy reward (weight != 0) beside its auxiliary ones")
    p = cfg.pref
    if p.judge is None:
        refuse_ignored(p, "pref", ["tau"], "pref.judge is null (Pref-GRPO off)")
    else:
        if p.judge != "sigmoid" and ":" not in p.judge:
            raise config_error("pref.judge", f"{p.judge!r}: use sigmoid (from the scalar reward) or a module:function "
                                             "pairwise judge")
        if backprop:
            raise config_error("pref.judge", f"train.objective={obj} backpropagates the reward itself; win rates "
                                             "are advantages' inputs (use train.objective=grpo or nft)")
        if r.kind == "tree":
            raise config_error("pref.judge", "a tree's advantages are per depth over its leaves; win rates are per "
                                             "group (use rollout.kind=flat or solrl)")


def check_backprop(cfg, refuse_ignored) -> None:
    """train.objective=draft / refl: a differentiable reward, flat rollouts from the policy itself, one pass."""
    t, r, obj, n = cfg.train, cfg.rollout, cfg.train.objective, cfg.sampler.num_steps
    why = f"train.objective={obj} samples fresh trajectories with gradient and has no log-prob, ratio or advantage"
    if r.kind != "flat":
        raise config_error("rollout.kind", f"{why}: rollout.kind={r.kind} (a candidate pool / tree of stored "
                                           "transitions) does not apply; use rollout.kind=flat")
    if r.precision != "fp32" or r.sync_every != 1:
        raise config_error("rollout.precision" if r.precision != "fp32" else "rollout.sync_every",
                           f"{why}: its samples must come from the trained policy itself (the gradient flows through "
                           "them), not from a rollout copy")
    if cfg.correct.method != "none":
        raise config_error("correct.method", f"{why}: there is nothing to importance-correct")
    if t.micro_batch != "auto":
        raise config_error("train.micro_batch", f"{why}; it cuts each process's samples into train.updates_per_epoch x "
                                                "train.grad_accum micro-batches: set train.micro_batch=auto")
    refuse_ignored(t, "train", ("kl_beta", "kl_form", "clip_low", "clip_high", "ratio_norm", "step_weight",
                                "policy_loss", "policy_loss_options", "inner_epochs"), why)
    refuse_ignored(cfg.steps, "steps", [f.name for f in fields(cfg.steps)],
                   f"{why}; its trained steps are {obj}'s own (draft.k, refl.first_step / last_step)")
    if cfg.gardo.enabled:
        raise config_error("gardo.enabled", f"{why}; GARDO gates a GRPO KL and shapes advantages")
    if obj == "draft" and cfg.draft.k > n:
        raise config_error("draft.k", f"= {cfg.draft.k}: the schedule has sampler.num_steps={n} steps")
    if obj == "refl":
        first, last = cfg.refl.steps(n)
        if not 0 <= first <= last <= n - 1:
            raise config_error("refl.first_step", f"stopping steps [{first}, {last}] must lie in 0..{n - 1} with "
                                                  "first <= last")
    for name, w in (cfg.reward.weights or {}).items():
        if w != 0 and _differentiable(name) is False:
            raise config_error(f"reward.weights.{name}", f"reward {name!r} is not differentiable (it declares no "
                               f"differentiable score: text recognition, detection and verifiable rewards pass "
                               f"through non-differentiable steps), so train.objective={obj} cannot backpropagate "
                               f"it; {DIFFERENTIABLE_HINT} (or use train.objective=grpo / nft, which need no "
                               "gradient of the reward)")
