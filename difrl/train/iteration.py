"""The end of an iteration, shared by the flow recipe's loops (difrl/train/flow.py; DRaFT-K / ReFL's phase,
difrl/train/reward_backprop.py): evaluate when due, log the row, checkpoint, and decide whether to stop.

    done, stopped, stop = close_iteration(cfg, run, row, it, t_iter, bar, world, policy, ema, evaluate, world.stop,
                                          accelerator.print)
    if stop:
        break
"""

from __future__ import annotations

import time

from difrl.train.rundir import stop_rule
from difrl.train.scaffold import clip_and_step, progress
from difrl.train.sharded_step import clip_sharded_grad_norm_


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
