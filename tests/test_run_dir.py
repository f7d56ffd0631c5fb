"""A run directory is the run (issue 39): resume continues with the run's own config.yaml, a changed setting is
refused or recorded, and a directory that holds a run is not trained into again without --overwrite.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_run_dir.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from difrl.cli import main
from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import train
from difrl.train.run.rundir import RESUME_SAFE, RUN_FILES, RunDirError
from test_train import TINY, metrics, run

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")


def saved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_resume_is_the_runs_own_config(tmp_path, capsys):
    # the run: cps, noise 0.8, lr 3e-4 and a 3-digit eval, none of them the defaults or digits.yaml's
    _, d = run(tmp_path / "r", "sampler.kind=cps", "sampler.noise_level=0.8", "train.lr=3e-4", "train.iterations=2")
    before, rows = (d / "config.yaml").read_text(), metrics(d)
    capsys.readouterr()

    # README's old line: digits.yaml beside resume= disagrees with the run on algorithm keys -> one line naming them
    assert main(["train", DIGITS, f"resume={d}", "train.iterations=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"sampler.kind=cps in {d / 'config.yaml'}, {DIGITS} says flow_sde" in err
    assert "sampler.noise_level=0.8" in err and "train.lr=0.0003" in err and "eval.per_digit=3" in err
    assert "resume_override=true" in err and "train.iterations" not in err.split(". A resumed")[0]
    # the command line changing one: named as the command line's
    assert main(["train", f"resume={d}", "train.iterations=3", "sampler.noise_level=0.5"]) == 2
    assert f"sampler.noise_level=0.8 in {d / 'config.yaml'}, the command line says 0.5" in capsys.readouterr().err
    # --out (or out=) naming another directory, and --overwrite, are errors on resume
    assert main(["train", f"resume={d}", "--out", str(tmp_path / "other")]) == 2
    assert "names another directory" in capsys.readouterr().err
    assert main(["train", f"resume={d}", f"out={tmp_path / 'other'}"]) == 2
    assert "names another directory" in capsys.readouterr().err
    assert main(["train", f"resume={d}", "--overwrite"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (d / "config.yaml").read_text() == before and metrics(d) == rows  # nothing was touched
    assert not (tmp_path / "other").exists()

    # `difrl train resume=R` with safe keys only (and --out naming R itself): the run's settings, the change recorded
    assert main(["train", f"resume={d}", "train.iterations=3", "checkpoint_every=1", "threads=1", "--out", str(d)]) == 0
    assert f"resume={d} changes threads null -> 1, checkpoint_every 0 -> 1, train.iterations 2 -> 3" in capsys.readouterr().out
    cfg = saved(d)
    assert cfg["sampler"]["kind"] == "cps" and cfg["sampler"]["noise_level"] == 0.8 and cfg["train"]["lr"] == 3e-4
    assert cfg["eval"]["per_digit"] == 3 and cfg["resume"] is None
    assert cfg["history"] == [{"iteration": 2, "key": "threads", "old": None, "new": 1},
                              {"iteration": 2, "key": "checkpoint_every", "old": 0, "new": 1},
                              {"iteration": 2, "key": "train.iterations", "old": 2, "new": 3}]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["eval_before"]["samples"] == summary["eval_after"]["samples"] == 30  # the same evaluation
    assert [r["iteration"] for r in metrics(d)] == [1, 2, 3] and metrics(d)[:2] == rows

    # resume_override=true: an algorithm change goes through, takes effect, and joins the history
    assert main(["train", f"resume={d}", "train.iterations=4", "train.lr=1e-4", "resume_override=true"]) == 0
    assert saved(d)["history"][-2:] == [{"iteration": 3, "key": "train.iterations", "old": 3, "new": 4},
                                        {"iteration": 3, "key": "train.lr", "old": 3e-4, "new": 1e-4}]
    assert saved(d)["train"]["lr"] == 1e-4 and saved(d)["resume_override"] is False
    assert [r["lr"] for r in metrics(d)] == [3e-4, 3e-4, 3e-4, 1e-4]  # the optimizer took the new lr
    assert main(["train", DIGITS, "resume_override=true"]) == 2  # without resume= it means nothing: refused
    assert "resume_override" in capsys.readouterr().err


def test_masked_resume_refuses_an_algorithm_change(tmp_path, capsys):
    from difrl.train.masked.trainer import train as train_masked
    from difrl.train.masked.config import load_masked_config
    from test_train_masked import TINY as MASKED

    d = tmp_path / "s"
    train_masked(load_masked_config(None, [*MASKED, "train.iterations=1"]), out_dir=d)
    capsys.readouterr()
    assert main(["train", f"resume={d}", "train.iterations=2", "sampler.temperature=0.5"]) == 2
    assert f"sampler.temperature=1.0 in {d / 'config.yaml'}, the command line says 0.5" in capsys.readouterr().err
    assert main(["train", str(ROOT / "configs" / "digits.yaml"), f"resume={d}"]) == 2  # another trainer
    assert "A run cannot change trainer" in capsys.readouterr().err
    assert main(["train", f"resume={d}", "train.iterations=3", "eval.every=1"]) == 0
    assert [h["key"] for h in saved(d)["history"]] == ["train.iterations", "eval.every"]
    assert saved(d)["sampler"]["temperature"] == 1.0 and len(metrics(d)) == 3
    # eval.every is safe: evaluations after the resume leave the training rows as a run without them has them
    full = tmp_path / "full"
    train_masked(load_masked_config(None, [*MASKED, "train.iterations=3"]), out_dir=full)
    trained = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in metrics(d)]
    assert trained == metrics(full) and "eval/solve_rate" in metrics(d)[1]


def test_a_directory_that_holds_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    _, d = run(tmp_path / "r", "train.iterations=2", "eval.every=1")
    for marker in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints"):
        assert (d / marker).exists()
    with pytest.raises(RunDirError, match=rf"{d} already holds a run \(config.yaml, metrics.jsonl, summary.json, "
                                          rf"checkpoints/\): continue it with resume={d}, or start again in it with "
                                          r"--overwrite"):
        run(d)
    assert main(["train", DIGITS, *TINY, "--out", str(d)]) == 2  # the CLI: one line, exit 2
    assert "already holds a run" in capsys.readouterr().err
    # the config's `out` (runs/digits for the demo's YAML) is checked the same way
    with pytest.raises(RunDirError, match="already holds a run"):
        train(load_flow_config(None, [*TINY, f"out={d}"]))

    # --overwrite: an empty start; what difrl did not write stays
    stale = d / "samples" / "eval-iter-000300.png"
    stale.write_bytes(b"x")
    (d / "notes.txt").write_text("mine")
    assert set(p.name for p in d.iterdir()) <= {*RUN_FILES, "notes.txt"}  # RUN_FILES lists what a run writes
    train(load_flow_config(None, TINY), out_dir=d, overwrite=True)
    assert "removed the earlier run's config.yaml" in capsys.readouterr().out
    assert not stale.exists() and (d / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (d / "samples").iterdir()) == ["after-iter-000001.png", "before-iter-000000.png"]
    assert [r["iteration"] for r in metrics(d)] == [1]
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["iter-000001", "latest"]
    assert [e["tag"] for e in json.loads((d / "eval.json").read_text())] == ["before", "after"]


def test_resume_safe_keys_exist_in_both_trainers():
    from dataclasses import fields

    from difrl.train.config import FlowConfig
    from difrl.train.masked.config import MaskedConfig
    from difrl.train.run.rundir import _leaves

    for cls in (FlowConfig, MaskedConfig):
        keys = {k for k, _ in _leaves(cls())}
        assert set(RESUME_SAFE) <= keys, (cls, set(RESUME_SAFE) - keys)
        assert {f.name for f in fields(cls)} >= {"resume", "resume_override", "history"}
