"""Ctrl-C (SIGINT) and SIGTERM (what schedulers and launchers send) stop a run with a checkpoint.

    with stop_on_signals(program=("train",), argv=argv):   # `difrl train` and the entry scripts, around the trainer
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
  Interrupted is raised: `difrl train` prints one line with the command that continues the run (continue_command)
  and exits 130 (SIGINT) or 143 (SIGTERM), with no traceback. Under several processes every process polls at the
  same points and the decision is collective (Run.interrupted: every process's signal, agreed on), so all stop
  at the same iteration boundary and meet in the checkpoint's barrier. A second signal exits at once, without a
  checkpoint, unless it comes within GRACE_S of the first: that is the same stop reaching the process twice
  (accelerate's single-process launcher sends SIGTERM to its child after the terminal's SIGINT reached both).
- **finishing** (after the final checkpoint: the final evaluation, weights, report): a signal exits at once;
  the same continue command writes what is missing.

The continue command is the launch this process came from with the program's arguments replaced by
`resume=RUN_DIR` (launch_command): the launcher's own command line when the parent process is one (accelerate
launch, torchrun: /proc/PPID/cmdline ends with this process's script or module and its arguments, so every
launcher option, --config_file and --num_processes included, is kept), else this process's command line
(sys.orig_argv) on one process. Where it cannot be known (several processes whose launcher is not the parent,
e.g. srun or mpirun; a trainer called in process) the line says what to run in words instead of a wrong command.
accelerate 1.16 passes its config file to no worker (no ACCELERATE_CONFIG_FILE: its launcher turns the file into
ACCELERATE_* / FSDP_* variables), which is why the launcher's command line is read.

A launcher gives its workers a limited time after forwarding a signal (torchrun: 30 s,
TORCH_ELASTIC_SHUTDOWN_TIMEOUT; accelerate's single-process launcher: 5 s) and then kills them: a longer
iteration is lost to such a kill (the previous checkpoint stays intact). Without stop_on_signals (a library
user calling train()) signals keep Python's default behaviour; the polls still run (Run.interrupted says what
one costs) and find no signal.
"""

from __future__ import annotations

import os
import shlex
import shutil
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
                         f"{continue_command(run_dir)}")


class _State:
    def __init__(self):
        self.installed = False
        self.phase = "setup"  # setup | training | finishing
        self.signum = 0       # the first signal of the training phase, 0 = none
        self.at = 0.0         # when it came (_clock)
        self.run_dir: Path | None = None
        self.iteration = 0    # the final checkpoint's iteration (finishing)
        self.launch: list[str] | None = ["difrl", "train"]  # launch_command's, without resume=RUN_DIR
        self.unknown = ""     # why the launch is unknown (launch None): the words continue_command says instead
        self.note = ""        # said after the command (several nodes)
        self.carried: int | None = None  # the signal agreed on in the reward stage's gather (carrying), not yet polled


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
                          f"`{continue_command(_state.run_dir)}` writes the final evaluation, weights or report if "
                          "they are missing")
    now = _clock()
    if not _state.signum:
        _state.signum, _state.at = signum, now
        _say(f"difrl: {name}: stopping at the next iteration boundary with a checkpoint (send it again to exit at "
             "once, without one)")
    elif now - _state.at >= GRACE_S:
        _exit_now(signum, f"difrl: second signal ({name}): exiting now without a checkpoint; `"
                          f"{continue_command(_state.run_dir)}` continues from the newest one in "
                          f"{_state.run_dir}/checkpoints")


# ---------------------------------------------------------------------------------- the command that continues


def _cmdline(pid: int) -> list[str] | None:
    """Process `pid`'s command line (Linux /proc), None where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [os.fsdecode(a) for a in raw.split(b"\0")[:-1]] or None


def _readable(prefix: list[str]) -> list[str]:
    """`python /venv/bin/accelerate launch ...` (what the kernel records for a console script: its interpreter, then
    the script's path) as `accelerate launch ...` when `accelerate` on PATH is that same file; else as it is."""
    if len(prefix) > 1 and Path(prefix[0]).name.startswith("python") and os.path.isfile(prefix[1]):
        name, found = Path(prefix[1]).name, shutil.which(Path(prefix[1]).name)
        if found and os.path.samefile(found, prefix[1]):
            return [name, *prefix[2:]]
    return list(prefix)


def launch_command(program: tuple[str, ...] | None, argv: list[str] | None) -> tuple[list[str] | None, str, str]:
    """How this process was launched, for continue_command: (launch, unknown, note). `launch`: the launch with the
    program's arguments replaced by `program` (("train",) for `difrl train`, () for an entry script), to be followed
    by resume=RUN_DIR; None where it cannot be known, `unknown` then says in words what to run. `argv`: the
    arguments the program parsed (None: sys.argv[1:]). No `program` (a library user's stop_on_signals()), other
    arguments than sys.argv[1:], or a sys.argv that does not end the command line (runpy) mean the run is not its
    process's own program (a test, a notebook): `difrl train` on one process.

    The target (a script, `-m MODULE`'s module or a console script) and its arguments end this process's command
    line (sys.orig_argv); a launcher's command line ends with the same tokens (accelerate launch and torchrun pass
    them on as given), so a parent process whose command line ends so, with something else before, is the
    launcher, and what comes before is kept whole."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    args = list(sys.argv[1:])
    own = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    # not this process's own command line: no program, other arguments parsed, sys.argv set in process (runpy)
    if program is None or (argv is not None and list(argv) != args) or own[len(own) - len(args):] != args:
        if world > 1:
            return None, ("the launch that started these processes again, with `difrl train resume=RUN_DIR` as "
                          "the program (this run was started in process: its command is not known here)"), ""
        return ["difrl", "train"], "", ""
    n = len(args) + 1  # the target and its arguments
    parent = _cmdline(os.getppid())
    if parent and len(parent) > n and parent[-n:] == own[-n:] and parent[:-n] != own[:-n]:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        note = (f" (on node {os.environ.get('GROUP_RANK', '0')}; every node runs its own launch command with its "
                "arguments replaced the same way)") if world > local else ""
        return [*_readable([*parent[:-n], own[-n]]), *program], "", note
    if world > 1:  # srun, mpirun, a launcher that is not the parent: its command line is out of sight
        return None, (f"the launch that started these {world} processes again, with "
                      f"`{shlex.join([*program, 'resume=RUN_DIR'])}` in place of the arguments after {own[-n]} "
                      "(this process cannot see its launcher's command line)"), ""
    return [*_readable(own[:len(own) - n + 1]), *program], "", ""  # python [options] TARGET, or TARGET on PATH


def continue_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir` as it was launched (stop_on_signals' launch_command), or,
    where that cannot be known, what to run in words."""
    if _state.launch is None:
        return _state.unknown.replace("RUN_DIR", shlex.quote(str(run_dir)))
    return shlex.join([*_state.launch, f"resume={run_dir}"]) + _state.note


@contextmanager
def stop_on_signals(program: tuple[str, ...] | None = None, argv: list[str] | None = None):
    """SIGINT and SIGTERM handled as the module docstring says, inside the block (the main thread only; elsewhere
    this does nothing). The previous handlers are restored after it. `program`: the arguments before
    `resume=RUN_DIR` in the command that continues the run (("train",) for `difrl train`, () for an entry
    script), `argv` the ones the program parsed (launch_command); without `program` (a library user's run),
    `difrl train resume=RUN_DIR` on one process."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _state.__init__()
    _state.launch, _state.unknown, _state.note = launch_command(program, argv)
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
    _state.phase, _state.signum, _state.run_dir, _state.carried = "training", 0, Path(run_dir), None


def finishing(run_dir: Path, iteration: int) -> None:
    """The final checkpoint (of `iteration`) is written: from now on a signal exits at once."""
    _state.phase, _state.run_dir, _state.iteration = "finishing", Path(run_dir), iteration


def requested() -> int:
    """The signal that asked this process to stop during training (signal.SIGINT, SIGTERM), else 0."""
    return int(_state.signum)


# ---------------------------------------------------------------------------------- agreeing (Run.interrupted)


def carrying(gather):
    """score_rewards' `gather` (accelerate's gather_object over the processes; None on one process) with this
    process's signal carried along: [(signal, item)] is gathered in place of [item], and the processes' signals,
    agreed on (the largest: SIGTERM over SIGINT), are kept for the next poll (agreed), which then needs no
    collective of its own. The reward stage's one collective is thereby also the poll after it."""
    if gather is None:
        return None

    def carry(items: list) -> list:
        pairs = gather([(requested(), item) for item in items])  # every process's, in rank order
        _state.carried = max(s for s, _ in pairs)
        return [item for _, item in pairs]
    return carry


def agreed(accelerator) -> int:
    """The signal every process stops on (0: none), the same on all of them; every process must call it at the
    same points. What a poll costs: on one process (or accelerator None) a read of the flag the handler set;
    right after a `carrying` gather, the signal that gather agreed on (nothing more); otherwise one all-reduce
    (sum) of two int32 on the accelerator's device (per signal, how many processes got it) and its read on the
    host: the collective's latency (microseconds within a node, a network round trip across nodes) and a host
    sync, where the trainers' loops are already synced (Run.interrupted says where)."""
    carried, _state.carried = _state.carried, None
    if carried is not None:
        return carried
    signum = requested()
    if accelerator is None or accelerator.num_processes == 1:
        return signum
    import torch

    from difrl.utils.collectives import reduce

    votes = reduce(accelerator, torch.tensor([signum == s for s in SIGNALS], dtype=torch.int32), "sum")  # [2]
    return max((int(s) for s, n in zip(SIGNALS, votes.tolist()) if n), default=0)
