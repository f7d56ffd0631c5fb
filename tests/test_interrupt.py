"""Ctrl-C and SIGTERM stop a run with a checkpoint, and resume is bit-identical to a run never stopped (issue 39).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_interrupt.py -q

Real signals throughout: in the handler's own test, into an in-process masked run (sent from inside the reward
stage or the update), to a `python -m difrl train` process (SIGINT) and to a torchrun launcher's process group
(SIGTERM, two gloo processes), each run then continued with the command its stop line printed (the same launch,
`train resume=RUN_DIR` as the arguments). A poll after the reward stage rides on its verdict gather, one at an
iteration's end is one all-reduce (a fake two-process accelerator counts them).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from difrl.train.run import interrupt
from difrl.train.scaffold import TIMING_KEYS
from difrl.utils.io import load_safetensors_checked

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
# the digits world, 8 samples x 4 steps per iteration (about 0.15 s each on one thread), ITERATIONS of them: long
# enough to signal mid-run. The signal goes out as soon as the 3rd row is written and the run stops at the next
# iteration boundary it reaches (k = 3 in every run seen, at load averages of 5 on 2 cores), so 20 leave a wide
# margin (it was 40: the 20 more, trained twice, in the reference and in the resumed run, checked nothing more)
ITERATIONS = 20
TINY = ["seed=3", "threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
        "train.micro_batch=6", "train.grad_accum=2", "train.lr=1e-3", "train.clip_low=1e-3", "train.clip_high=1e-3",
        "eval.every=0", "eval.per_digit=1", "eval.num_steps=3", "train.kl_beta=0.1", f"train.iterations={ITERATIONS}",
        "train.updates_per_epoch=null"]  # digits.yaml makes 2 updates per rollout; on 2 processes these sizes make 1


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if k not in TIMING_KEYS} for ln in lines]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_safetensors_checked(path, "test")[0]


def assert_same_weights(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:  # exact: a resume replays the same ops on the same inputs (one machine, one thread count)
        assert torch.equal(ta[k], tb[k]), (a, k)


class Exited(Exception):
    pass


# ---------------------------------------------------------------------------------- the handler


def test_the_handler_by_phase(monkeypatch, tmp_path):
    exits = []

    def exit_now(signum, line):
        exits.append((128 + signum, line))
        raise Exited

    monkeypatch.setattr(interrupt, "_exit_now", exit_now)
    before = signal.getsignal(signal.SIGINT)
    with interrupt.stop_on_signals():
        with pytest.raises(Exited):  # before the run directory is open: nothing to save, out at once
            os.kill(os.getpid(), signal.SIGTERM)
        assert exits[-1][0] == 143 and "before training began" in exits[-1][1]

        interrupt.training(tmp_path)  # the loop: recorded, polled by the trainer
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested() == signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)  # within GRACE_S: the same stop delivered twice (a launcher's forward)
        assert interrupt.requested() == signal.SIGINT and len(exits) == 1
        now = time.monotonic()
        monkeypatch.setattr(interrupt, "_clock", lambda: now + interrupt.GRACE_S + 1)
        with pytest.raises(Exited):  # a second Ctrl-C: out at once, without a checkpoint
            os.kill(os.getpid(), signal.SIGINT)
        assert exits[-1][0] == 130 and "without a checkpoint" in exits[-1][1] and f"resume={tmp_path}" in exits[-1][1]

        interrupt.finishing(tmp_path, 7)  # after the final checkpoint: out at once, resume writes the rest
        with pytest.raises(Exited):
            os.kill(os.getpid(), signal.SIGINT)
        assert "after the final checkpoint (iteration 7)" in exits[-1][1]
    assert signal.getsignal(signal.SIGINT) is before and interrupt.requested() == 0


# ---------------------------------------------------------------------------------- the poll's cost


class TwoProcesses:
    """The accelerator of this process and one other, whose signal is `theirs`: each collective is recorded."""
    num_processes, is_main_process, device = 2, True, torch.device("cpu")

    def __init__(self):
        self.theirs, self.calls = 0, []

    def reduce(self, t, reduction="sum"):  # the other process's votes: 1 for the signal it got
        self.calls.append(f"all_reduce({reduction})")
        return t + torch.tensor([self.theirs == s for s in interrupt.SIGNALS], dtype=t.dtype)

    def gather(self, t):
        self.calls.append("all_gather")
        return torch.cat([t, torch.tensor([self.theirs], dtype=t.dtype)])

    def gather_object(self, objs):  # the reward stage's verdict gather; the other process carries its signal too
        self.calls.append("gather_object")
        return objs + [(self.theirs, item) for _, item in objs]


def test_a_poll_rides_on_the_reward_gather_or_is_one_all_reduce(tmp_path):
    # an iteration polls twice: after the reward stage (carried by its verdict gather, no collective of its own) and
    # at its end (one all-reduce); a signal on the other process stops this one at the same poll
    from difrl.train.scaffold import Run

    acc = TwoProcesses()
    run = Run(tmp_path, torch.nn.Linear(1, 1), None, None, {}, acc, {}, 0, total=3)
    interrupt.training(tmp_path)
    assert run.carrying(acc.gather_object)(["verdict"]) == ["verdict", "verdict"]  # the reward stage's result
    assert not run.agree_interrupted() and acc.calls == ["gather_object"]
    assert not run.agree_interrupted() and acc.calls == ["gather_object", "all_reduce(sum)"]  # the iteration's end

    acc.calls, acc.theirs = [], signal.SIGTERM  # the other process got SIGTERM during the next rollout
    run.carrying(acc.gather_object)(["verdict"])
    assert run.agree_interrupted() and run.signal == signal.SIGTERM and acc.calls == ["gather_object"]
    assert run.agree_interrupted() and acc.calls == ["gather_object"]  # agreed once: end_loop's poll needs nothing more

    run = Run(tmp_path, torch.nn.Linear(1, 1), None, None, {}, acc, {}, 0, total=3)
    interrupt.training(tmp_path)
    acc.calls, acc.theirs = [], signal.SIGINT  # ... during an update: the end poll's all-reduce says so
    assert run.agree_interrupted() and run.signal == signal.SIGINT and acc.calls == ["all_reduce(sum)"]

    one = Run(tmp_path, torch.nn.Linear(1, 1), None, None, {}, None, {}, 0, total=3)
    assert one.carrying(None) is None and not one.agree_interrupted()  # one process: the handler's flag, no collective


# ---------------------------------------------------------------------------------- the masked trainer, in process


@pytest.mark.parametrize("stage", ["reward", "update"])
def test_masked_run_stops_on_a_signal_and_resumes_exactly(tmp_path, monkeypatch, stage):
    # the signal arrives inside iteration 1's reward stage (the iteration is abandoned: checkpoint 1) or inside its
    # update (the iteration is finished: checkpoint 2); either way 3 iterations with a stop == 3 without
    from difrl.train.masked import trainer as masked
    from difrl.train.masked.config import load_masked_config
    from test_train_masked import TINY as MASKED

    def cfg(*extra):
        return load_masked_config(None, [*MASKED, "train.iterations=3", "estimator.kind=maskgrpo", *extra])

    masked.train(cfg(), out_dir=tmp_path / "full")
    calls = []
    name, real = {"reward": ("score_all", masked.score_all), "update": ("clip_and_step", masked.clip_and_step)}[stage]

    def signalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == (2 if stage == "reward" else 5):  # iteration 1's reward; its update's first step
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(masked, name, signalling)
    part = tmp_path / "part"
    with interrupt.stop_on_signals(), pytest.raises(interrupt.Interrupted) as stop:
        masked.train(cfg(), out_dir=part)
    done = 1 if stage == "reward" else 2
    assert stop.value.code == 130 and stop.value.iteration == done
    assert f"stopped by SIGINT after iteration {done} of 3" in str(stop.value)
    assert str(stop.value).endswith(f"continue with: difrl train resume={part}")
    assert len(rows(part)) == done and (part / "checkpoints" / f"iter-{done:06d}").is_dir()
    monkeypatch.setattr(masked, name, real)

    masked.train(cfg(f"resume={part}"))
    assert rows(part) == rows(tmp_path / "full")
    assert_same_weights(part / "policy.safetensors", tmp_path / "full" / "policy.safetensors")


# ---------------------------------------------------------------------------------- processes, real launches


def launch(cmd: list[str], out: Path, log: Path, signum: int, after_rows: int, group: bool = False) -> str:
    """Start `cmd`, send `signum` once out/metrics.jsonl has `after_rows` rows (to the process, or with `group`
    to its process group), wait for it; returns its stdout + stderr."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=group)
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_rows):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode != 0, text[-3000:]
    if not group:
        assert proc.returncode == 128 + signum, text[-3000:]
    return text


def stopped_at(text: str, signame: str, run_dir: Path, launch: list[str]) -> tuple[int, list[str]]:
    """The iteration of the one line that says how to continue (no traceback from difrl), and its command: the
    launch `launch` (up to the module) with `train resume=RUN_DIR` as its arguments."""
    said = [ln for ln in text.splitlines() if "continue with: " in ln]
    assert len(said) == 1 and said[0].startswith(f"difrl: stopped by {signame} after iteration "), text[-3000:]
    cmd = shlex.split(said[0].split("continue with: ", 1)[1])
    assert cmd == [*launch, "train", f"resume={run_dir}"], said[0]
    return int(said[0].split("after iteration ")[1].split()[0]), cmd


def difrl(nproc: int) -> list[str]:
    return [sys.executable, "-m", "difrl"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "difrl"]


@pytest.mark.slow  # two launches of `python -m difrl train` and an in-process run of ITERATIONS
def test_ctrl_c_checkpoints_and_resume_equals_the_run_never_stopped(tmp_path):
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    full, part = tmp_path / "full", tmp_path / "part"
    train(load_flow_config(DIGITS, TINY), out_dir=full)

    text = launch([*difrl(1), "train", DIGITS, *TINY, "--out", str(part)], part, tmp_path / "part.log",
                  signal.SIGINT, after_rows=3)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    k, resume = stopped_at(text, "SIGINT", part, difrl(1))  # `python -m difrl train resume=DIR`
    assert 3 <= k < ITERATIONS and len(rows(part)) == k
    assert (part / "checkpoints" / f"iter-{k:06d}" / "manifest.json").is_file()  # a verified checkpoint

    proc = subprocess.run(resume, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"after iteration {k}" in proc.stdout
    assert rows(part) == rows(full) and len(rows(full)) == ITERATIONS
    assert_same_weights(part / "checkpoints" / f"iter-{ITERATIONS:06d}" / "trainable.safetensors",
                        full / "checkpoints" / f"iter-{ITERATIONS:06d}" / "trainable.safetensors")
    assert_same_weights(part / "policy.safetensors", full / "policy.safetensors")
    assert yaml.safe_load((part / "config.yaml").read_text())["history"] == []  # nothing changed on resume


@pytest.mark.slow  # three torchrun launches of two processes (about 1.5 min on 2 cores)
def test_sigterm_to_a_torchrun_group_stops_both_processes_together(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    proc = subprocess.run([*difrl(2), "train", DIGITS, *TINY, "--out", str(full)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # a scheduler's SIGTERM to the launcher's process group; torchrun forwards it to both workers (in sessions of
    # their own), which agree on one iteration boundary and checkpoint it (a lone stop would hang the barrier)
    text = launch([*difrl(2), "train", DIGITS, *TINY, "--out", str(part)], part, tmp_path / "part.log",
                  signal.SIGTERM, after_rows=3, group=True)
    k, resume = stopped_at(text, "SIGTERM", part, difrl(2))  # the same torchrun launch, 2 processes
    assert 3 <= k < ITERATIONS and len(rows(part)) == k
    assert (part / "checkpoints" / f"iter-{k:06d}" / "manifest.json").is_file()
    assert "KeyboardInterrupt" not in text and f'File "{ROOT / "difrl"}' not in text  # a traceback is torchrun's own

    proc = subprocess.run(resume, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rows(part) == rows(full) and len(rows(full)) == ITERATIONS
    assert_same_weights(part / "policy.safetensors", full / "policy.safetensors")
