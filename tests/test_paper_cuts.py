"""The paper cuts a new user hit (issue 49), each as it was met: a failed start that blocked the next, a config file
beside resume= that extended the run unsaid, a finished run resumed, an export of an iteration not kept, the report's
last-only learning rate, the progress bar's unlabelled last evaluation and carriage returns in logs, and `difrl eval`'s
raw JSON.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_paper_cuts.py -q

The runs are the tiny digits world (tests/test_train.py's TINY settings, a few seconds each).
"""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import yaml
from test_train import TINY, metrics

from difrl.cli import main
from difrl.config import config_to_dict, save_config
from difrl.report.charts import fmt
from difrl.train.config import load_flow_config

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")


def tiny_config(path: Path, *overrides: str) -> Path:
    """A config file of the tiny digits run (every key written), as a user's own YAML."""
    save_config(load_flow_config(None, [*TINY, *overrides]), path)
    return path


def files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------- a failed start is not a run


def test_a_start_that_failed_before_its_first_iteration_is_not_a_run(tmp_path, capsys, monkeypatch):
    from difrl.train.flow import trainer as flow

    cfg, d = tiny_config(tmp_path / "tiny.yaml"), tmp_path / "run"
    # the start: a tracker whose package is missing is refused before anything is written
    if importlib.util.find_spec("wandb") is None:
        assert main(["train", str(cfg), "log_with=[wandb]", "--out", str(d)]) == 2
        assert "config key 'log_with': wandb needs the package 'wandb'" in capsys.readouterr().err
        assert not d.exists() or not any(d.iterdir())
    # a start that fails after writing config.yaml (here its evaluation before, as a failing reward would)...
    def planted(*args, **kwargs):
        raise ValueError("planted failure")

    monkeypatch.setattr(flow, "evaluate", planted)
    assert main(["train", str(cfg), "--out", str(d)]) == 2
    assert "planted failure" in capsys.readouterr().err
    assert (d / "config.yaml").is_file() and not (d / "checkpoints").exists()
    (d / "notes.txt").write_text("mine")
    # ...left no run: resume= says so and what to do, and the same command starts again
    assert main(["train", f"resume={d}"]) == 2
    err = capsys.readouterr().err
    assert f"{d} holds no run to continue, only what a start that failed before its first iteration left" in err
    assert "start it again with the command that started it, without resume=" in err
    monkeypatch.undo()
    assert main(["train", str(cfg), "--out", str(d)]) == 0
    assert f"{d} held only what a start that failed before its first iteration wrote" in capsys.readouterr().out
    assert [r["iteration"] for r in metrics(d)] == [1] and (d / "notes.txt").read_text() == "mine"
    # a run with a checkpoint is a run, as before
    assert main(["train", str(cfg), "--out", str(d)]) == 2
    assert "already holds a run" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- resume: a file beside it, a finished run


def test_a_file_beside_resume_changes_nothing_unsaid_and_a_finished_run_has_nothing_to_do(tmp_path, capsys):
    # the run started from the file with train.iterations and eval.every overridden on the command line
    cfg, d = tiny_config(tmp_path / "tiny.yaml", "train.iterations=2", "eval.every=1"), tmp_path / "run"
    assert main(["train", str(cfg), "train.iterations=1", "eval.every=0", "--out", str(d)]) == 0
    capsys.readouterr()
    written = files(d)
    # the file beside resume= would extend it to its own values: refused, naming them and what to pass instead
    assert main(["train", str(cfg), f"resume={d}"]) == 2
    err = capsys.readouterr().err
    assert f"train.iterations=1 in {d / 'config.yaml'}, {cfg} says 2; eval.every=0 in" in err
    assert "say so on the command line (train.iterations=2 eval.every=1)" in err
    # the finished run resumed as it is: one line, exit 0, nothing evaluated or written
    assert main(["train", f"resume={d}"]) == 0
    out = capsys.readouterr().out
    assert f"difrl: resume={d}: the run finished its 1 iteration; nothing to do" in out
    assert "pass train.iterations=N with N above 1" in out and "eval after" not in out
    assert files(d) == written
    # the same file with its values said on the command line: the run goes on, the changes in its history
    assert main(["train", str(cfg), f"resume={d}", "train.iterations=2", "eval.every=1"]) == 0
    assert [r["iteration"] for r in metrics(d)] == [1, 2]
    assert [h["key"] for h in yaml.safe_load((d / "config.yaml").read_text())["history"]] == ["train.iterations",
                                                                                             "eval.every"]


def test_a_run_that_stopped_early_stays_stopped_on_resume(tmp_path, capsys):
    # stop.fd_rise=0.5: every evaluation after the first (which sets the best FD) is "worse than the best", and
    # patience 1 stops the run at the second one, after iteration 2 of 4
    cfg, d = tiny_config(tmp_path / "tiny.yaml", "train.iterations=4", "eval.every=1", "stop.fd_rise=0.5",
                         "stop.patience=1"), tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(d)]) == 0
    assert [r["iteration"] for r in metrics(d)] == [1, 2]
    capsys.readouterr()
    written = files(d)
    # resumed as it is, or with more iterations: the stop still holds (its rule is the same): one line, exit 0,
    # nothing evaluated or written
    for extra in ([], ["train.iterations=6"]):
        assert main(["train", f"resume={d}", *extra]) == 0, extra
        out = capsys.readouterr().out
        assert f"difrl: resume={d}: the run stopped early after iteration 2 (Fréchet distance" in out, extra
        assert "nothing to do" in out and "change its stop rule" in out and "eval after" not in out, extra
        assert files(d) == written, extra
    # stopped after its stop's checkpoint was written but before its summary (a kill in the final evaluation):
    # resume finishes the run (evaluation after, summary, weights) without training past the stop
    (d / "summary.json").unlink()
    assert main(["train", f"resume={d}"]) == 0
    summary = json.loads((d / "summary.json").read_text())
    assert summary["iterations"] == 2 and "stop.fd_rise" in summary["stopped_early"]
    assert [r["iteration"] for r in metrics(d)] == [1, 2]
    # a changed stop rule (here none: stop.fd_rise=null) lifts the stop: the run continues to train.iterations
    assert main(["train", f"resume={d}", "stop.fd_rise=null", "resume_override=true"]) == 0
    assert [r["iteration"] for r in metrics(d)] == [1, 2, 3, 4]
    assert json.loads((d / "summary.json").read_text())["stopped_early"] is None


# ---------------------------------------------------------------------------------- export: the kept iterations


def test_export_of_an_iteration_not_kept_lists_the_kept_ones(tmp_path, capsys):
    d = tmp_path / "run"
    for it in (30, 35):
        (d / "checkpoints" / f"iter-{it:06d}").mkdir(parents=True)
    save_config(load_flow_config(DIGITS, []), d / "config.yaml")
    assert main(["export", str(d), "--iteration", "17"]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint {d / 'checkpoints' / 'iter-000017'}: {d} kept the checkpoints of iterations 30, 35" in err


# ---------------------------------------------------------------------------------- the report's settings


def test_the_report_shows_each_value_a_resume_changed_with_its_iteration(tmp_path):
    from difrl.report import write_report

    d = tmp_path / "run"
    d.mkdir()
    # what config.yaml holds after `difrl train resume=R train.iterations=4 train.lr=1e-4 resume_override=true` on a
    # run stopped at its checkpoint 3 (tests/test_run_dir.py): the last lr, and the history of the change
    cfg = config_to_dict(load_flow_config(DIGITS, ["train.lr=1e-4", "train.iterations=4"]))
    cfg["history"] = [{"iteration": 3, "key": "train.iterations", "old": 3, "new": 4},
                      {"iteration": 3, "key": "train.lr", "old": 3e-4, "new": 1e-4},
                      {"iteration": 3, "key": "eval.every", "old": 0, "new": 1}]
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    html = write_report(d).read_text()
    # iterations 1-3 ran at 3e-4 (their metric rows' lr), 4 at 1e-4
    assert "train.lr = 0.0003, 0.0001 from iteration 4" in html
    assert "train.iterations = 3, 4 from iteration 4" in html and "eval.every = 0, 1 from iteration 4" in html


# ---------------------------------------------------------------------------------- progress and difrl eval


def test_progress_bar_labels_the_last_evaluation():
    from difrl.train.run.progress import progress, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = progress_bar(0, 2, stream=stream)
    for it in bar:
        progress(bar, {"iteration": it + 1, "reward_mean": 0.5}, {"accuracy": 0.25}, ("accuracy",))
    bar.close()
    assert "\r" in stream.getvalue() and "last eval accuracy=0.250" in stream.getvalue()  # tqdm's bar


def test_plain_progress_lines_off_a_terminal_and_eval_prints_a_table(tmp_path, capsys):
    d = tmp_path / "run"
    assert main(["train", DIGITS, *TINY, "train.iterations=3", "eval.every=2", "--out", str(d)]) == 0
    err = capsys.readouterr().err  # pytest's captured stderr: not a terminal
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train:")]
    assert [ln.split(",")[0] for ln in lines] == ["train: iteration 1/3", "train: iteration 2/3", "train: iteration 3/3"]
    assert "last eval accuracy" in lines[0] and "eval now: accuracy" in lines[1] and "last eval accuracy" in lines[2]

    # difrl eval RUN_DIR: a table beside the run's evaluation before training; --json the JSON
    summary = json.loads((d / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    assert main(["eval", str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = table_head(out)
    assert out[head].split() == ["metric", "before", "after", "change"] and out[head + 1].split()[0] == "accuracy"
    # the run's policy evaluated again with the run's seeds is its final evaluation (tests/test_cli_run_dirs.py)
    assert out[head + 1].split()[1:3] == [fmt(before["accuracy"]), fmt(after["accuracy"])]
    assert any(ln.startswith("policy: ") and ln.endswith("policy.safetensors") for ln in out)
    assert main(["eval", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == after["accuracy"]
    # another evaluation than the run's (fewer samples): its metrics alone, no before to compare with
    assert main(["eval", str(d), "eval.per_digit=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[table_head(out)].split() == ["metric", "value"]
    # a metric that is not a number (the diversity of one sample per digit): n/a in the table, null in the JSON
    assert main(["eval", DIGITS, "eval.per_digit=1", "eval.num_steps=3"]) == 0
    assert ["diversity", "n/a"] in [ln.split() for ln in capsys.readouterr().out.splitlines()]


def table_head(lines: list[str]) -> int:
    """The index of `difrl eval`'s table header among the printed lines."""
    return next(i for i, ln in enumerate(lines) if ln.startswith("metric "))


def test_plain_progress_prints_every_so_often():
    from difrl.train.run.progress import PlainProgress, progress, progress_bar

    stream = io.StringIO()
    bar = progress_bar(0, 100, stream=stream)
    assert isinstance(bar, PlainProgress) and bar.every == 5  # about 20 lines over the run
    for it in bar:
        row = {"iteration": it + 1, "reward_mean": 0.5, **({"eval/accuracy": 0.3} if it + 1 == 12 else {})}
        progress(bar, row, {"accuracy": 0.3}, ("accuracy",))
        if it + 1 == 13:
            break  # a loop stopped early (a signal): close shows where it stopped
    bar.close()
    shown = [int(ln.split("/")[0].split()[-1]) for ln in stream.getvalue().splitlines()]
    assert shown == [1, 5, 10, 12, 13]  # the first, every 5th, the evaluation's, where it stopped
    assert not isinstance(progress_bar(0, 3, enabled=False), PlainProgress)  # another process's: a disabled tqdm
