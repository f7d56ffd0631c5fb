"""A stopped run says how to continue it as it was launched, and every entry script takes `resume=DIR` (issue 46).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_resume_command.py -q     # the launch is marked slow

Fast: the continue command (difrl.train.run.interrupt.launch_command) built from a faked launcher command line (accelerate
launch, torchrun, one process, a launcher out of sight, several nodes, a run inside another program); the entry
scripts take `resume=DIR` without a config file and overrides after --out. Slow: tiny FLUX under
`accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 scripts/train_flux.py ...`, stopped
by SIGTERM to the launcher's process group, continued with exactly the command its stop line printed, equals the
run that never stopped (tests/test_fsdp.py's comparison: every metric row, the final evaluation and the last
checkpoint's tensors).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from difrl.train.run import interrupt

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------- the continue command


def said(monkeypatch, program, own: list[str], parent: list[str] | None, env: dict[str, str], argv=None) -> str:
    """continue_command(runs/x) for a process whose command line is `own` (python's sys.orig_argv; its sys.argv
    is the target and what follows) and whose parent's is `parent`, under the launcher variables `env`."""
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if "-m" in own:  # python [options] -m MODULE ARGS: sys.argv[0] is the module's file
        i, first = own.index("-m") + 1, "/x/difrl/__main__.py"
    else:  # python [options] SCRIPT ARGS
        i = next(i for i in range(1, len(own)) if not own[i].startswith("-"))
        first = own[i]
    monkeypatch.setattr(sys, "orig_argv", own)
    monkeypatch.setattr(sys, "argv", [first, *own[i + 1:]])
    monkeypatch.setattr(interrupt, "_cmdline", lambda pid: parent)
    with interrupt.stop_on_signals(program, argv):
        return interrupt.continue_command(Path("runs/x"))


def test_the_continue_command_is_the_launch_with_resume_in_place_of_the_arguments(monkeypatch, tmp_path):
    args = ["configs/flux_flow_grpo.yaml", "model.path=/m", "--out", "runs/x"]
    own = ["/v/python", "-u", "scripts/train_flux.py", *args]
    launcher = ["/v/python", str(tmp_path / "accelerate"), "launch", "--config_file", "configs/accelerate/fsdp.yaml",
                "--num_processes", "8", "scripts/train_flux.py", *args]
    processes = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    # accelerate launch (its config file reaches no worker: the launcher's command line keeps every option)
    assert said(monkeypatch, (), own, launcher, processes) == (
        f"/v/python {tmp_path / 'accelerate'} launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 "
        "scripts/train_flux.py resume=runs/x")
    (tmp_path / "accelerate").write_text("#!/v/python\n")  # the console script on PATH: named as the user types it
    (tmp_path / "accelerate").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert said(monkeypatch, (), own, launcher, processes) == (
        "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_flux.py "
        "resume=runs/x")

    # torchrun -m difrl train: the module and `train` kept
    own = ["/v/python", "-u", "-m", "difrl", "train", "configs/digits.yaml", "seed=1"]
    torchrun = ["/v/python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "difrl",
                "train", "configs/digits.yaml", "seed=1"]
    assert said(monkeypatch, ("train",), own, torchrun, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) == (
        "/v/python -m torch.distributed.run --standalone --nproc_per_node=2 -m difrl train resume=runs/x")
    # two nodes: this node's launch, and a note that each node runs its own
    line = said(monkeypatch, ("train",), own, torchrun, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0"})
    assert line.startswith("/v/python -m torch.distributed.run --standalone --nproc_per_node=2 -m difrl train "
                           "resume=runs/x (on node 0; every node runs its own launch command")

    # one process, no launcher (the parent is a shell): its own command line
    own = ["/v/python", "/v/difrl", "train", "configs/digits.yaml", "--out", "runs/x"]
    assert said(monkeypatch, ("train",), own, ["-bash"], {}) == "/v/python /v/difrl train resume=runs/x"
    (tmp_path / "difrl").write_text("#!/v/python\n")  # the difrl console script on PATH
    (tmp_path / "difrl").chmod(0o755)
    assert said(monkeypatch, ("train",), ["/v/python", str(tmp_path / "difrl"), *own[2:]], ["-bash"], {}) == (
        "difrl train resume=runs/x")
    # several processes whose launcher is not the parent (srun, mpirun): no command, what to run in words
    line = said(monkeypatch, ("train",), own, ["slurmstepd: [1.0]"], {"WORLD_SIZE": "4"})
    assert line.startswith("the launch that started these 4 processes again, with `train resume=runs/x` in place of "
                           "the arguments after /v/difrl") and "cannot see" in line
    # a run inside another program (cli.main(argv) from a test): its command line is not the run's
    assert said(monkeypatch, ("train",), own, None, {}, argv=["train", "configs/digits.yaml"]) == (
        "difrl train resume=runs/x")
    assert said(monkeypatch, None, own, None, {}) == "difrl train resume=runs/x"  # a library user's stop_on_signals()
    assert "started in process" in said(monkeypatch, None, own, None, {"WORLD_SIZE": "2"})

    # the stop line names it
    stop = interrupt.Interrupted(signal.SIGINT, 3, 9, Path("runs/x"))
    assert str(stop).endswith("continue with: difrl train resume=runs/x")


# ---------------------------------------------------------------------------------- the entry scripts' arguments


def test_entry_scripts_take_resume_without_a_config_and_overrides_after_out(tmp_path, capsys):
    from difrl.config import save_config
    from difrl.train.config import load_flow_config
    from difrl.train.entry import main

    run = tmp_path / "digits_run"
    run.mkdir()
    save_config(load_flow_config(str(ROOT / "configs" / "digits.yaml"), []), run / "config.yaml")
    # resume=DIR alone reads the run's config.yaml (here a digits run, which the FLUX script names and refuses)
    assert main("flux", [f"resume={run}"]) == 2
    err = capsys.readouterr().err
    assert f"resume={run}: {run} is a model.kind=digits run; this script trains flux" in err
    assert f"difrl train resume={run})" in err
    assert main("flux", [f"resume={tmp_path / 'none'}"]) == 2  # no run there: said so, not "config file not found"
    assert f"{tmp_path / 'none'} holds no run to continue" in capsys.readouterr().err
    # overrides after --out are overrides (train.lr's bad value is named: it was read)
    assert main("flux", [str(ROOT / "configs" / "flux_tiny.yaml"), "--out", str(tmp_path / "o"), "train.lr=abc"]) == 2
    assert "train.lr" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- accelerate launch, FSDP, 2 processes


@pytest.mark.slow  # three launches of the tiny FLUX pipeline on 2 processes (about 1.5 min on 2 cores)
def test_fsdp_run_continues_with_the_printed_command_as_if_never_stopped(tmp_path):
    pytest.importorskip("diffusers")
    from test_fsdp import assert_same_runs, command, env, flux_args, run
    from test_interrupt import launch

    from difrl.models.adapters import make_tiny_pipeline

    tiny = make_tiny_pipeline("flux", tmp_path / "tiny_flux", seed=0)
    script = [str(ROOT / "scripts" / "train_flux.py")]
    args = [*flux_args(tiny, "train.grad_accum=2"), "checkpoint_every=0"]  # only the stop writes a checkpoint
    full, part = tmp_path / "full", tmp_path / "part"
    run(2, script, args, full)

    # SIGTERM to the launcher's process group (a scheduler's stop) after iteration 1: both processes stop at one
    # boundary (iteration 1 or 2 of 3) with a checkpoint, and the main one prints the launch that continues it
    first = command(2, script, args, part)  # accelerate launch --config_file fsdp.yaml --num_processes 2 ... SCRIPT ARGS
    text = launch(first, part, tmp_path / "part.log", signal.SIGTERM, after_rows=1, group=True)
    lines = [ln for ln in text.splitlines() if "continue with: " in ln]
    assert len(lines) == 1 and lines[0].startswith("train_flux.py: stopped by SIGTERM after iteration "), text[-3000:]
    k = int(lines[0].split("after iteration ")[1].split()[0])
    assert 1 <= k < 3 and (part / "checkpoints" / f"iter-{k:06d}").is_dir()
    cmd = shlex.split(lines[0].split("continue with: ", 1)[1])
    # the launcher's options (its config file, process count, port) and the script, then resume=DIR alone
    head = cmd.index("launch")
    assert Path(cmd[head - 1]).name == "accelerate" and cmd[head:] == [*first[1:-len(args) - 2], f"resume={part}"]

    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"resumed from {part / 'checkpoints' / f'iter-{k:06d}'}" in proc.stdout + proc.stderr
    assert_same_runs(full, part)
