"""The iteration skeleton both recipes share (difrl/train/flow/trainer.py, masked.py; DRaFT-K / ReFL's phase,
difrl/train/flow/reward_backprop.py, its end): reward -> gather -> advantages -> log -> finish, each call in its loop's
banner section, the method's own stages between them.

    # ==== reward
    scores, bad = score_iteration(lambda: ..., n, cfg, run, it, say, accelerator)   # this process's n samples
    if run.agree_interrupted():
        break
    # ==== advantage
    rewards = gather_rewards(cfg, run, it, accelerator, scores, bad, all_groups)    # every process's, [N]
    adv, failed = valid_group_advantages(rewards.scores, weights, all_groups, rewards.bad, ...)   # the method's
    keep_all = kept_samples(adv, failed, cfg.advantage.drop_zero_spread)   # [N] bool: the samples trained on
    # ==== log
    row = iteration_row(it, rewards, adv, keep_all, failed, stats, method, upd, lr, times)
    # ==== checkpoint
    done, stopped, stop = close_iteration(cfg, run, row, it, t_iter, bar, world, policy, ema, evaluate, world.stop,
                                          say)     # evaluate when due, log the row, checkpoint, stop?
    if stop:
        break
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from difrl.train.dist.sharded_step import clip_sharded_grad_norm_
from difrl.train.reward_stage import across_processes, score_rewards, track_reward_failures
from difrl.train.run.rundir import stop_rule
from difrl.train.scaffold import clip_and_step, progress
from difrl.utils.collectives import gather


def score_iteration(score, n: int, cfg, run, it: int, say, accelerator) -> tuple[dict, torch.Tensor]:
    """The reward section: `score()` of this process's `n` samples through reward_stage.score_rewards (reward.on_error;
    a failure stops the run after a checkpoint of the iteration before), its gather carrying the signals (the
    trainer polls run.agree_interrupted() next). Returns (scores: name -> [n], bad [n] bool)."""
    return score_rewards(score, n, cfg.reward.on_error, lambda: run.checkpoint(it), f"iteration {it + 1}", run.dir,
                         say, run.carrying(across_processes(accelerator)))


@dataclass
class IterationRewards:
    """The iteration's rewards over every process, in global sample order (sample k at row k; N samples)."""
    scores: dict[str, torch.Tensor]  # name -> [N]
    groups: torch.Tensor  # [N] long: each sample's group id
    bad: torch.Tensor  # [N] bool: a failed reward
    failed_frac: float  # the run's failed fraction so far (reward.max_failed_frac)


def kept_samples(adv, failed: torch.Tensor, drop_zero_spread: bool) -> torch.Tensor:
    """[N] bool: the samples trained on: not in a group with a failed reward (`failed` [N]) and, with
    advantage.drop_zero_spread, not in a group whose rewards do not vary (`adv`: algos.advantages.Advantages, its
    zero_spread [N])."""
    keep = ~failed
    if drop_zero_spread:
        keep &= ~adv.zero_spread
    return keep


def gather_rewards(cfg, run, it: int, accelerator, scores: dict, bad: torch.Tensor,
                   groups: torch.Tensor) -> IterationRewards:
    """The advantage section's start: every process's scores and failures gathered (collectives, on the
    accelerator's device), the failures counted over the run (a run past reward.max_failed_frac stops here after a
    checkpoint). `groups` [N]: every sample's group id."""
    all_scores = {name: gather(accelerator, v) for name, v in scores.items()}
    all_bad = gather(accelerator, bad.long()).bool()
    failed_frac = track_reward_failures(run.state, int(all_bad.sum()), len(all_bad), cfg.reward.max_failed_frac,
                                        f"iteration {it + 1}", lambda: run.checkpoint(it), run.dir)
    return IterationRewards(all_scores, groups, all_bad, failed_frac)


def iteration_row(it: int, rewards: IterationRewards, adv, keep_all: torch.Tensor, failed: torch.Tensor,
                  stats: dict, method: dict, upd: dict, lr: float, times: tuple[float, float, float, float]) -> dict:
    """The log section's metric row: the reward and advantage `stats`, the group counts, the `method`'s own columns,
    the update's metrics `upd` (its "ratio" as ratio_mean), the learning rate and the seconds of rollout, reward and
    update from `times` = (t_iter, t_reward, t_adv, t_log)."""
    t_iter, t_reward, t_adv, t_log = times
    groups = rewards.groups
    row = {
        "iteration": it + 1,
        **stats,
        "zero_spread_groups": int(groups[adv.zero_spread].unique().numel()),
        "failed_reward_groups": int(groups[failed].unique().numel()), "failed_reward_frac": rewards.failed_frac,
        "trained_samples": int(keep_all.sum()),
        **method,
        **upd,
        "ratio_mean": upd.get("ratio", 1.0),
        "lr": lr,
        "seconds_rollout": t_reward - t_iter, "seconds_reward": t_adv - t_reward, "seconds_update": t_log - t_adv,
    }
    row.pop("ratio", None)
    return row


def optimizer_step(cfg, tr, accelerator, m) -> None:
    """An update's end: gradient clipping (train.max_grad_norm; under FSDP2 one all-reduce of the shards' squares),
    the optimizer step, the EMA update; the norm into the metrics `m`. `tr`: flow.Trainee."""
    norm = clip_and_step(tr.optimizer, tr.params, cfg.train.max_grad_norm,
                         clip_sharded_grad_norm_ if tr.fsdp else accelerator.clip_grad_norm_)
    if norm is not None:
        m.add("grad_norm", norm)
    if tr.ema is not None:
        tr.ema.update()


def close_iteration(cfg, run, row: dict, it: int, t_iter: float, bar, world, policy, ema, evaluate, should_stop,
                    say) -> tuple[int, str | None, bool]:
    """Iteration `it` (0-based) is done: the world's evaluation every eval.every iterations (with `ema`'s weights;
    `should_stop`, the world's stop rule (World.stop) or None, reads it: early stopping), `row` logged with its
    seconds, a checkpoint every checkpoint_every iterations and when stopping. Returns (iterations done, the
    early-stop reason or None, whether the loop stops: early stop, or a signal received on any process)."""
    stopped = None
    if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < cfg.train.iterations:
        t_eval = time.perf_counter()
        run.state["last_eval"] = ev = evaluate(world, policy, ema, cfg, run, "eval", it + 1)
        row.update({f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))})
        row["seconds_eval"] = time.perf_counter() - t_eval
        stopped = should_stop(cfg, ev, run.state) if should_stop is not None else None
    row["seconds"] = time.perf_counter() - t_iter
    run.log(row)
    done = it + 1
    progress(bar, row, run.state["last_eval"], world.headline)  # the bar, or a plain line off a terminal
    if stopped:  # into the checkpoint: resume= of it stays stopped while the stop rule is the same (rundir.held_stop)
        run.state["stopped_early"] = {"iteration": done, "reason": stopped, "rule": stop_rule(cfg)}
    if stopped or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
        run.checkpoint(done)
    if stopped:
        say(f"difrl: stopping after iteration {done}: {stopped}")
    return done, stopped, bool(stopped) or run.agree_interrupted()  # a signal during the update: stop after this iteration
