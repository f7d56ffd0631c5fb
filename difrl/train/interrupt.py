"""Ctrl-C (SIGINT) and SIGTERM (what schedulers and launchers send) stop a run with a checkpoint.

    with stop_on_signals():              # `difrl train` and the entry scripts, around the trainer
        summary = train(cfg)             # a signal: a checkpoint, then Interrupted (exit status 128 + signal)

The trainer says where it is (Run.open: `training`; Run.end_loop: `finishing`) and polls between stages
(Run.interrupted); the handler installed here only records the signal, so nothing is cut in the middle:

- **setup** (before the run directory is open): a signal exits at once, status 130 / 143. This command has
  saved nothing yet; a resumed run keeps the checkpoint it was resumed from.
- **training**: the first signal is recorded (one line says so, on the main process) and the loop stops at its
  next poll: after the reward stage, the iteration in progress is *abandoned* (its policy update has not begun,
  so the weights, optimizer and counters are still those of the iteration before, which is checkpointed); at
  the end of an iteration, that iteration is checkpointed. Either way the checkpoint is of a completed
  iteration, so resume continues bit-identically to a run that never stopped (tests/test_interrupt.py). Then
  Interrupted is raised: `difrl train` prints one line with the resume command and exits 130 (SIGINT) or 143
  (SIGTERM), with no traceback. Under several processes every process polls at the same points and the
  decision is collective (Run.interrupted gathers every process's signal), so all stop at the same iteration
  boundary and meet in the checkpoint's barrier. A second signal exits at once, without a checkpoint, unless it
  comes within GRACE_S of the first: that is the same stop reaching the process twice (accelerate's
  single-process launcher sends SIGTERM to its child after the terminal's SIGINT reached both).
- **finishing** (after the final checkpoint: the final evaluation, weights, report): a signal exits at once;
  `difrl train resume=RUN_DIR` writes what is missing.

A launcher gives its workers a limited time after forwarding a signal (torchrun: 30 s,
TORCH_ELASTIC_SHUTDOWN_TIMEOUT; accelerate's single-process launcher: 5 s) and then kills them: a longer
iteration is lost to such a kill (the previous checkpoint stays intact). Without stop_on_signals (a library
user calling train()) signals keep Python's default behaviour; the polls then cost nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

GRACE_S = 1.0  # a repeat within this many seconds is the same stop delivered twice
_clock = time.monotonic
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped on a signal after checkpointing iteration `iteration`; `code` is the exit status (128 +
    signal: 130 for SIGINT, 143 for SIGTERM) and str() the line that says how to continue."""

    def __init__(self, signum: int, iteration: int, total: int, run_dir: Path):
        self.signum, self.iteration, self.run_dir, self.code = signum, iteration, Path(run_dir), 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after iteration {iteration} of {total} "
                         f"(checkpoint {Path(run_dir) / 'checkpoints' / f'iter-{iteration:06d}'}); continue with: "
                         f"difrl train resume={run_dir}")


class _State:
    def __init__(self):
        self.installed = False
        self.phase = "setup"  # setup | training | finishing
        self.signum = 0       # the first signal of the training phase, 0 = none
        self.at = 0.0         # when it came (_clock)
        self.run_dir: Path | None = None
        self.iteration = 0    # the final checkpoint's iteration (finishing)


_state = _State()


def _main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _say(line: str) -> None:
    """One line on stderr from the main process, on a line of its own (the progress bar's line may be open), written
    past Python's buffers (a handler may run while the main thread is inside a buffered write, e.g. the bar's)."""
    if _main_process():
        os.write(2, ("\n" + line + "\n").encode())


def _exit_now(signum: int, line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or reentrant inside a write
            pass
    _say(line)
    os._exit(128 + signum)


def _handle(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if _state.phase == "setup":
        _exit_now(signum, f"difrl: {name} before training began: exiting now (this command saved nothing)")
    if _state.phase == "finishing":
        _exit_now(signum, f"difrl: {name} after the final checkpoint (iteration {_state.iteration}): exiting now; "
                          f"`difrl train resume={_state.run_dir}` writes the final evaluation, weights or report if "
                          "they are missing")
    now = _clock()
    if not _state.signum:
        _state.signum, _state.at = signum, now
        _say(f"difrl: {name}: stopping at the next iteration boundary with a checkpoint (send it again to exit at "
             "once, without one)")
    elif now - _state.at >= GRACE_S:
        _exit_now(signum, f"difrl: second signal ({name}): exiting now without a checkpoint; `difrl train "
                          f"resume={_state.run_dir}` continues from the newest one in {_state.run_dir}/checkpoints")


@contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM handled as the module docstring says, inside the block (the main thread only; elsewhere
    this does nothing). The previous handlers are restored after it."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _state.__init__()
    _state.installed = True
    for s in SIGNALS:
        signal.signal(s, _handle)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _state.__init__()


def training(run_dir: Path) -> None:
    """The run directory is open (Run.open): from now on a signal stops the loop at its next poll."""
    _state.phase, _state.signum, _state.run_dir = "training", 0, Path(run_dir)


def finishing(run_dir: Path, iteration: int) -> None:
    """The final checkpoint (of `iteration`) is written: from now on a signal exits at once."""
    _state.phase, _state.run_dir, _state.iteration = "finishing", Path(run_dir), iteration


def requested() -> int:
    """The signal that asked this process to stop during training (signal.SIGINT, SIGTERM), else 0."""
    return int(_state.signum)
