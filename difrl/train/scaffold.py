"""The scaffold every trainer shares (difrl/train/flow/trainer.py, difrl/train/masked/trainer.py): what is not the method.

    net, reference = wrap_policy(policy, cfg.train.lora, cfg.seed, need_reference=cfg.train.kl_beta > 0)
    optimizer = make_optimizer(trainable_params(net), cfg.train)
    run_dir = claim_run_dir(cfg, out_dir, overwrite, "runs/flow")         # first: refused before anything loads
    run = Run.open(cfg, run_dir, net, optimizer, ema, extras, accelerator)   # resume, config.yaml, metrics cut back
    with reference_policy(policy, net, reference): ...                     # the KL's reference (LoRA off / frozen copy)
    run.log(row); run.checkpoint(iteration)
    if run.agree_interrupted(): break                                      # SIGINT / SIGTERM (difrl.train.run.interrupt)
    run.end_loop(done); run.finish(summary, headline)                      # final checkpoint; summary.json, report.html

A recipe (the loop) calls these in its banner sections; none of them knows which method runs. The
reward stage (build, score, failures, advantages over valid groups) is difrl/train/reward_stage.py, the update's
metrics (difrl.train.metrics.Metrics) difrl/train/metrics.py, which directory a run may use and what a resume may
change difrl/train/run/rundir.py, stopping on a signal difrl/train/run/interrupt.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from difrl.config import save_config
from difrl.train.dist.full_tensors import is_sharded, plain_copy, reshard
from difrl.train.run import interrupt
from difrl.train.run.progress import progress  # noqa: F401  (re-exported: the loops' progress line)
from difrl.train.run.rundir import (TRACKER_PACKAGES, check_resume, claim_run_dir, clear_run,  # noqa: F401  (re-exported)
                                failed_start, saved_config, show)
from difrl.train.run.sharded_state import checkpoint_format
from difrl.train.run.state import latest_checkpoint, restore_checkpoint, save_sharded, snapshot, write_checkpoint
from difrl.utils.io import atomic_write_json, json_safe, save_safetensors
from difrl.utils.modules import use_module
from difrl.utils.rng import mix_seed

# the metric-row keys that measure time (tests strip them before comparing runs)
TIMING_KEYS = ("seconds", "seconds_rollout", "seconds_reward", "seconds_update", "seconds_eval", "seconds_sampling",
               "seconds_candidates", "seconds_regenerate")


def default_threads(processes: int = 1) -> int:
    """torch's intra-op threads for a config that leaves `threads` unset. OMP_NUM_THREADS, when the environment sets
    it, is the count per process: torchrun sets 1 per worker unless told otherwise, and a user or a test suite running
    several processes side by side says with it what each may take (more threads than cores slow every process).
    Otherwise this process's share of the cores it may use (its CPU affinity split over the launch's processes)."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // processes)


# ---------------------------------------------------------------------------------- policy, reference, optimizer


def wrap_policy(policy, lora, seed: int, need_reference: bool):
    """The trained network for `policy.module` (not yet installed): a peft LoRA wrapper on the adapter's
    lora_target_modules (train.lora.targets overrides) or the module itself (full fine-tuning). Returns
    (net, reference): reference is None under LoRA (the base is the network with its adapter disabled) and a
    frozen copy under full fine-tuning when need_reference (a KL to the base), else None."""
    base = policy.module
    torch.manual_seed(mix_seed(seed, 5))  # LoRA init draws from the global RNG: same seed, same start
    if lora.enabled:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(base, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                              init_lora_weights=True if lora.init == "default" else "gaussian",
                                              target_modules=lora.targets or policy.lora_target_modules))
        return net, None
    return base, copy.deepcopy(base).requires_grad_(False) if need_reference else None


def make_optimizer(params: dict, train) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params.values(), lr=train.lr, betas=train.betas, eps=train.adam_eps,
                             weight_decay=train.weight_decay)


def reference_policy(policy, net, reference):
    """Context: `policy` computes the reference policy (the base): LoRA disabled, or the frozen copy swapped in."""
    if reference is None:
        return adapter_disabled(net)
    return use_module(policy, reference)


@contextmanager
def adapter_disabled(net):
    """peft's disable_adapter() with the network resharded on entry and before leaving: peft switches the LoRA
    weights' requires_grad off and on again on the parameters registered at that moment, which under FSDP with
    reshard_after_forward=False are a unit's gathered copies after a forward. The shards would stay frozen, and
    trainable_params (checkpoints, restore) would find no LoRA weight."""
    reshard(net)
    with net.disable_adapter():
        try:
            yield
        finally:
            reshard(net)


def clip_and_step(optimizer, params: dict, max_grad_norm: float | None, clip_grad_norm_=None) -> torch.Tensor | None:
    """Gradient clipping (returns the pre-clip norm, or None when off), optimizer step, zero grad."""
    norm = None
    if max_grad_norm is not None:
        clip = clip_grad_norm_ or torch.nn.utils.clip_grad_norm_
        norm = clip(params.values(), max_grad_norm)
        norm = norm.full_tensor() if is_sharded(norm) else torch.as_tensor(norm)  # FSDP: a replicated DTensor
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


# ---------------------------------------------------------------------------------- the ratio check


class RatioCheckError(RuntimeError):
    pass


def check_ratio(log_prob: torch.Tensor, log_prob_old: torch.Tensor, tol: float, agree=None) -> float:
    """max |log_prob - log_prob_old| of the first on-policy micro-step, the largest over processes through `agree`
    (collectives.gather_max: all raise together, none alone, which would hang backward); raises if expm1 > tol."""
    err = (agree or float)(float((log_prob.detach() - log_prob_old).abs().max()))  # agree: collective, same on all
    if not math.isfinite(err) or math.expm1(err) > tol:
        raise RatioCheckError(
            f"on-policy ratio check failed: the first micro-step's |ratio - 1| is {math.expm1(err):.3g} > {tol:g}. "
            "The log-prob recomputed for training differs from the rollout's. Likely causes: dropout or another "
            "train/eval-mode difference in the model, a batch-size-dependent kernel (compare rollout and training "
            "batch sizes), bf16/fp16 step math, torch.compile, or non-deterministic attention. Set "
            "train.ratio_check=false only if you know why.")
    return err


# ---------------------------------------------------------------------------------- the run directory


class Run:
    """A run directory: config.yaml, metrics.jsonl (one JSON row per iteration), checkpoints/, summary.json,
    reward_curve.png. Only the main process writes; every process takes part in a checkpoint's barrier."""

    def __init__(self, run_dir: Path, net, optimizer, ema, extras: dict, accelerator, state: dict, start: int,
                 total: int = 0):
        self.dir, self.net, self.optimizer, self.ema, self.extras = run_dir, net, optimizer, ema, extras
        self.accelerator, self.state, self.start, self.total = accelerator, state, start, total
        self.is_main = accelerator is None or accelerator.is_main_process
        self.sharded = any(is_sharded(p) for p in net.parameters())  # FSDP: a gathered checkpoint is collective
        self.format = "gathered"  # train.checkpoint_format, resolved (Run.open)
        self.trackers: list = []
        self.signal = 0  # the signal every process agreed to stop on (interrupted), 0 = none

    @classmethod
    def open(cls, cfg, run_dir: Path, net, optimizer, ema=None, extras: dict | None = None, accelerator=None,
             state: dict | None = None, overwrite: bool = False) -> "Run":
        """Resume (cfg.resume: weights, optimizer, EMA, extras, RNG, counters and `state`'s keys from the latest
        checkpoint), or with `overwrite` remove an earlier run's files; write config.yaml (the resume's changed
        settings appended to its history, difrl.train.run.rundir), cut metrics.jsonl back to the checkpoint's
        iteration. `run_dir` is claim_run_dir's (which refused what is not allowed before anything loaded)."""
        state = {"eval_before": None, "last_eval": None, "reward_failed": 0, "reward_scored": 0, **(state or {})}
        start, say = 0, print if accelerator is None else accelerator.print
        # train.checkpoint_format resolved (auto: sharded under FSDP, else gathered; a resumed run keeps its own)
        fmt = checkpoint_format(cfg, run_dir, any(is_sharded(p) for p in net.parameters()))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint_format=fmt))
        ckpt = (latest_checkpoint(run_dir, say, cfg.resume_unverified, accelerator) if cfg.resume
                else None)  # newest intact (manifest-checked), either format, written by any number of processes
        if cfg.resume and ckpt is None:
            raise FileNotFoundError(f"resume={cfg.resume}: no checkpoint found in {run_dir / 'checkpoints'} (the run "
                                    "stopped before its first one); start it again with --overwrite")
        if ckpt is not None:
            restore_checkpoint(ckpt, net, optimizer, ema, extras or None)
            start = ckpt.iteration
            state.update({k: ckpt.state[k] for k in state if k in ckpt.state})
            say(f"difrl: resumed from {ckpt.path} after iteration {start}")
        run = cls(run_dir, net, optimizer, ema, extras or {}, accelerator, state, start, cfg.train.iterations)
        run.format = fmt
        run.barrier()  # every process has checked the directory (claim_run_dir) before the main one writes in it
        if run.is_main:
            if overwrite and not cfg.resume:
                removed, kept = clear_run(run_dir)
                if removed:
                    say(f"difrl: --overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}"
                        + (f" (kept, not difrl's: {', '.join(kept)})" if kept else ""))
            elif not cfg.resume and (left := failed_start(run_dir)):  # no run (rundir.failed_start): replaced
                clear_run(run_dir, left)
                say(f"difrl: {run_dir} held only what a start that failed before its first iteration wrote "
                    f"({', '.join(left)}): replaced by this start")
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(run_config(cfg, run_dir, start), run_dir / "config.yaml")
            run.trackers = start_trackers(cfg, run_dir)
            truncate_metrics(run_dir / "metrics.jsonl", start)
            truncate_evals(run_dir / "eval.json", start)
            (run_dir / "metrics.jsonl").touch()
        run.barrier()
        interrupt.training(run_dir)
        return run

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def checkpoint(self, iteration: int) -> None:
        """Checkpoint `iteration`: sharded (difrl.train.run.sharded_state), every process writes its shards with DCP;
        gathered (difrl.train.run.state), under FSDP every process gathers the full tensors, the main one writes them."""
        if self.format == "sharded":
            save_sharded(self.dir, iteration, self.net, self.optimizer, self.ema, self.extras, self.state,
                         self.is_main, self.barrier)
        elif self.is_main or self.sharded:
            snap = snapshot(self.net, self.optimizer, self.ema, self.extras or None)
            if self.is_main:
                write_checkpoint(self.dir, iteration, snap, self.state)
        self.barrier()

    def agree_interrupted(self) -> bool:
        """Stop now, agreed by all processes (a collective)? True once SIGINT / SIGTERM reached this process
        (difrl.train.run.interrupt) or, under several processes, any of them: every process polls at the same points of
        its loop and the decision is agreed (interrupt.agreed), so all stop at the same iteration boundary (one
        stopping alone would leave the others waiting in the checkpoint's barrier). A trainer polls twice an
        iteration: after the reward stage, whose gather carries the signals (Run.carrying: no collective of its own),
        and at the iteration's end, after its metrics reached the host: one all-reduce of two int32. Once agreed,
        the signal is kept in self.signal."""
        self.signal = self.signal or interrupt.agreed(self.accelerator)
        return bool(self.signal)

    carrying = staticmethod(interrupt.carrying)  # score_rewards' gather, carrying the signals (the poll after it)

    def end_loop(self, done: int, stopped_early: bool = False) -> None:
        """After the loop, `done` iterations completed: a signal (polled once more) checkpoints them and raises
        interrupt.Interrupted; otherwise the final checkpoint (an early stop, `stopped_early`, wrote it already
        and finishes the run whatever came). From here a signal exits at once (resume redoes what is left: the
        final evaluation, weights, report)."""
        if not stopped_early and self.agree_interrupted():
            self.checkpoint(done)
            interrupt.finishing(self.dir, done)
            for t in self.trackers:  # flushed: TensorBoard's events of the iterations done
                t.finish()
            raise interrupt.Interrupted(self.signal, done, self.total, self.dir)
        if not stopped_early:
            self.checkpoint(done)
        interrupt.finishing(self.dir, done)

    def log(self, row: dict) -> None:
        if self.is_main:
            with open(self.dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for t in self.trackers:
                t.log(scalars, step=row["iteration"])

    def finish(self, summary: dict, headline: tuple[str, ...]) -> None:
        """summary.json, reward_curve.png and report.html (main process)."""
        if self.is_main:
            atomic_write_json(self.dir / "summary.json", summary)
            plot_reward_curve(self.dir / "metrics.jsonl", self.dir / "reward_curve.png", summary, headline)
            for t in self.trackers:
                t.finish()
            from difrl.report import write_report

            try:
                write_report(self.dir)
            except OSError as e:  # a report must never cost a finished run
                print(f"difrl: report.html not written: {e}")


def run_config(cfg, run_dir: Path, start: int):
    """The config.yaml of a run: `cfg` in the directory actually used (so it reruns there), without the command's
    own keys (resume, resume_override, resume_unverified), and on resume with the earlier history plus this
    resume's changes against the run's config.yaml, each {iteration, key, old, new} (printed too)."""
    history = list(cfg.history)
    saved = saved_config(run_dir, type(cfg)) if cfg.resume else None
    if saved is not None:
        changes = check_resume(cfg, run_dir)
        history = list(saved.history) + [{"iteration": start, "key": k, "old": old, "new": new}
                                         for k, old, new in changes]
        if changes:
            listed = ", ".join(f"{k} {show(o)} -> {show(n)}" for k, o, n in changes)
            print(f"difrl: resume={run_dir} changes {listed} (recorded in the history of {run_dir / 'config.yaml'})")
    return dataclasses.replace(cfg, out=str(run_dir), resume=None, resume_override=False, resume_unverified=False,
                               history=history)


def run_files(run_dir: Path) -> str:
    """The closing line's list of what the run directory holds: results, samples, trained weights, curve, report
    (only those written: a text run has no samples/)."""
    named = [("results", "summary.json"), ("samples", "samples"), ("trained weights", "policy.safetensors"),
             ("trained weights", "lora"), ("trained weights", "transformer"), ("curve", "reward_curve.png"),
             ("report", "report.html")]
    seen, parts = set(), []
    for label, name in named:
        if (run_dir / name).exists() and label not in seen:  # the first of the trained-weight forms present
            seen.add(label)
            parts.append(f"{label}: {run_dir / name}")
    return ", ".join(parts) or f"run directory: {run_dir}"


def start_trackers(cfg, run_dir: Path) -> list:
    """accelerate's trackers named in cfg.log_with, started, with the config's scalars as hyperparameters:
    TensorBoard writes RUN_DIR/tensorboard/; W&B logs to the project "difrl" under the run directory's name."""
    from difrl.config import ConfigError, config_to_dict

    known = {"tensorboard": "TensorBoardTracker", "wandb": "WandBTracker"}  # TRACKERS
    trackers = []
    for name in cfg.log_with:
        package, cls_name = TRACKER_PACKAGES[name], known[name]  # claim_run_dir checked it is installed
        try:
            __import__(package)
        except ImportError as e:
            raise ConfigError(f"config key 'log_with': {name} needs the package {package!r} ({e}); pip install "
                              f"'difrl[{name}]'", "log_with") from e
        from accelerate import tracking

        tracker = (getattr(tracking, cls_name)("tensorboard", run_dir) if name == "tensorboard"
                   else getattr(tracking, cls_name)("difrl", name=run_dir.name, dir=str(run_dir)))
        tracker.start()
        flat = {}

        def walk(prefix, value):
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}{k}.", v)
            elif isinstance(value, (bool, int, float, str)):
                flat[prefix[:-1]] = value
            elif value is None:  # TensorBoard's hparams take no None
                flat[prefix[:-1]] = "null"
            else:  # lists and other values: as text
                flat[prefix[:-1]] = json.dumps(value)
        walk("", config_to_dict(cfg))
        tracker.store_init_configuration(flat)
        trackers.append(tracker)
    return trackers


def truncate_metrics(path: Path, keep_iterations: int) -> None:
    """On resume, drop metric rows written after the checkpoint (a crash between the two)."""
    if not path.exists():
        return
    rows = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in rows if json.loads(ln)["iteration"] <= keep_iterations]
    if len(kept) != len(rows):
        path.write_text("".join(ln + "\n" for ln in kept))


def record_eval(run_dir: Path, tag: str, iteration: int, metrics: dict, keep_earlier: bool = False) -> None:
    """Append one evaluation ({"tag", "iteration", every metric with its provenance}) to run_dir/eval.json, a
    JSON list (a metric that is not a number, NaN or inf, is written as null); an earlier entry with the same
    tag and iteration (a resumed run redoing it) is replaced unless keep_earlier (`difrl eval`: every call kept)."""
    path = run_dir / "eval.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    if not keep_earlier:
        rows = [r for r in rows if (r.get("tag"), r.get("iteration")) != (tag, iteration)]
    rows.append({"tag": tag, "iteration": iteration, **json_safe(metrics)})
    atomic_write_json(path, rows)


def truncate_evals(path: Path, keep_iterations: int) -> None:
    """On resume, drop evaluations recorded after the checkpoint (the "after" one of a finished run included)."""
    if not path.exists():
        return
    rows = json.loads(path.read_text())
    kept = [r for r in rows if r.get("iteration", 0) <= keep_iterations and r.get("tag") != "after"]
    if len(kept) != len(rows):
        atomic_write_json(path, kept)


def save_policy(policy, net, lora_enabled: bool, path: Path) -> None:
    """A plain checkpoint of the trained network (LoRA merged) that loads as model.path: the adapter's own
    `state_dict_and_meta()` format. Call it on the main process inside `gathered(net)` (and the EMA's `swapped()`
    for EMA weights): gathering is collective, so every process enters that block, one writes."""
    module = plain_copy(net).merge_and_unload() if lora_enabled else net
    with use_module(policy, module):
        tensors, meta = policy.state_dict_and_meta()
    save_safetensors(tensors, path, meta)


# ---------------------------------------------------------------------------------- the reward curve


def plot_reward_curve(metrics_path: Path, out: Path, summary: dict, headline: tuple[str, ...]) -> None:
    """Train reward and the headline eval metrics (before, every eval, after); those outside [0, 1] (FD) on a
    right-hand axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    ev = ([(0, summary["eval_before"])]
          + [(r["iteration"], {k: r[f"eval/{k}"] for k in headline}) for r in rows if all(f"eval/{k}" in r for k in headline)]
          + [(summary["iterations"], summary["eval_after"])])
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot([r["iteration"] for r in rows], [r["reward_mean"] for r in rows], label="train reward (mean)")
    right = None
    for key in headline:
        xs, ys = [e[0] for e in ev], [e[1][key] for e in ev]
        if max(ys) <= 1.0:
            ax.plot(xs, ys, "o-", label=f"eval {key}")
        else:
            right = right or ax.twinx()
            right.plot(xs, ys, "s--", color="tab:red", label=f"eval {key}")
            right.set_ylabel(key)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    if right is not None:
        handles = [a + b for a, b in zip(handles, right.get_legend_handles_labels())]
    ax.legend(*handles, fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
