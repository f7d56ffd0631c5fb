"""`difrl compare` (difrl/report/compare.py, compare_page.py) on three tiny real digits runs (two seeds of one config,
one with another learning rate) and a tiny Sudoku run (another world), plus broken run directories.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_compare.py -q
"""

from __future__ import annotations

import json
import math
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from difrl.cli import main as difrl_main
from difrl.report.compare import load_compared, overlay, shared_metrics

# 3 iterations of 8 samples, 4 steps, an evaluation after each (the fixture of tests/test_report.py, one thread)
DIGITS = ["threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
          "train.grad_accum=2", "train.iterations=3", "eval.every=1", "eval.per_digit=3", "eval.num_steps=3"]
RUNS = {"grpo-a": ["seed=3", "train.lr=1e-3"], "grpo-b": ["seed=4", "train.lr=1e-3"], "fast-lr": ["seed=3", "train.lr=3e-3"]}
SUDOKU = ["seed=3", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4",
          "train.inner_updates=2", "train.iterations=2", "train.lr=1e-3", "eval.count=16", "eval.every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    root = tmp_path_factory.mktemp("compare")
    for name, keys in RUNS.items():
        train(load_flow_config(None, DIGITS + keys), out_dir=root / name)
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def sudoku_run(tmp_path_factory) -> Path:
    from difrl.train.masked.trainer import train
    from difrl.train.masked.config import load_masked_config

    out = tmp_path_factory.mktemp("compare") / "sudoku"
    train(load_masked_config(None, SUDOKU), out_dir=out)
    return out


class Page(HTMLParser):
    """The charts (metric, x axis -> the runs' polylines) and the final table's group cells."""

    def __init__(self, text: str):
        super().__init__()
        self.charts: dict[tuple[str, str], list[str]] = {}
        self.group_cells: dict[str, dict] = {}
        self._chart = None
        self._group_row = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "chart":
            self._chart = self.charts.setdefault((a["data-series"], a["data-x"]), [])
            assert int(a["data-runs"]) >= 2
        elif tag == "polyline" and self._chart is not None:
            self._chart.append(a["data-run"])
        elif tag == "tr":
            self._group_row = a.get("class") == "group"
        elif tag == "td" and self._group_row and "data-mean" in a:
            self.group_cells[a["data-tag"]] = a

    def handle_endtag(self, tag):
        if tag == "svg":
            self._chart = None


def compare(capsys, *args) -> tuple[int, str, str]:
    rc = difrl_main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_page(runs, tmp_path, capsys):
    out = tmp_path / "cmp.html"
    rc, stdout, err = compare(capsys, *runs.values(), "--out", out)
    assert rc == 0 and str(out) in stdout and err == "", err
    text = out.read_text(encoding="utf-8")
    assert "<script" not in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    compared = load_compared(list(runs.values()))
    # each run labelled by its directory and the keys that differ (train.lr, then seed), seed-only twins grouped
    labels = {r.name: r.label for r in compared}
    assert labels == {"grpo-a": "grpo-a (train.lr=0.001, seed=3)", "grpo-b": "grpo-b (train.lr=0.001, seed=4)",
                      "fast-lr": "fast-lr (train.lr=0.003, seed=3)"}
    assert [r.group for r in compared] == [0, 0, 1]
    for label in labels.values():
        assert label in text
    # one overlaid chart per metric and x axis: the train reward and every shared evaluation metric, a line per run
    shared, constant, only = shared_metrics(compared)
    assert {"accuracy", "fd"} <= set(shared) and not only  # the headline metrics are drawn even when flat
    assert "real_diversity" in constant  # the real data's: the same in every evaluation of every run
    page = Page(text)
    for metric in ["reward_mean", *shared]:
        for x in ("iteration", "seconds"):
            assert page.charts[(metric, x)] == list(labels.values()), (metric, x)
    assert set(page.charts) == {(m, x) for m in ["reward_mean", *shared] for x in ("iteration", "seconds")}
    # the final table: the seed group's mean and sample std (n - 1) of summary.json's eval_after, by hand
    finals = {name: json.loads((d / "summary.json").read_text())["eval_after"] for name, d in runs.items()}
    for k in ("accuracy", "fd", "diversity"):
        a, b = finals["grpo-a"][k], finals["grpo-b"][k]
        cell = page.group_cells[k]
        assert cell["data-n"] == "2"
        # rel 1e-12: fmean / stdev round differently from (a + b) / 2 and |a - b| / sqrt(2) in the last bits only
        assert float(cell["data-mean"]) == pytest.approx((a + b) / 2, rel=1e-12)
        assert float(cell["data-std"]) == pytest.approx(abs(a - b) / math.sqrt(2), rel=1e-12, abs=1e-15)
    assert "n = 2 runs (seeds 3, 4)" in text


def test_seconds_axis_is_the_running_sum(runs):
    compared = load_compared([runs["grpo-a"], runs["fast-lr"]])
    for r in compared:
        rows = [json.loads(ln) for ln in (r.data.dir / "metrics.jsonl").read_text().splitlines()]
        clock = [sum(row["seconds"] for row in rows[:i + 1]) for i in range(len(rows))]
        assert all(row["seconds"] >= row["seconds_eval"] for row in rows if "seconds_eval" in row)  # eval inside
        (reward,) = [s for s in overlay(compared, "reward_mean", "seconds") if s.name == r.label]
        # rel 1e-12: the same additions in the same order; only the float formatting differs
        assert reward.xs == pytest.approx(clock, rel=1e-12)
        (acc,) = [s for s in overlay(compared, "accuracy", "seconds") if s.name == r.label]
        assert acc.xs == pytest.approx([0.0, *clock], rel=1e-12)  # before training at 0, one evaluation per row


def test_unfinished_run_uses_its_last_evaluation(runs, tmp_path, capsys):
    run = shutil.copytree(runs["grpo-a"], tmp_path / "stopped", ignore=shutil.ignore_patterns("checkpoints", "*.html"))
    (run / "summary.json").unlink()
    evals = json.loads((run / "eval.json").read_text())
    (run / "eval.json").write_text(json.dumps([e for e in evals if e["tag"] != "after"]))
    rc, _, _ = compare(capsys, run, runs["grpo-b"], "--out", tmp_path / "c.html", "--x", "iteration")
    assert rc == 0
    text = (tmp_path / "c.html").read_text()
    assert "last evaluation (eval): the run has not finished, iteration 2" in text
    assert 'data-x="seconds"' not in text


def test_different_worlds_compare_the_reward(runs, sudoku_run, tmp_path, capsys):
    rc, _, err = compare(capsys, runs["grpo-a"], sudoku_run, "--out", tmp_path / "w.html")
    assert rc == 0
    assert "No evaluation metric is shared by every run" in err and "solve_rate" in err and "accuracy" in err
    page = Page((tmp_path / "w.html").read_text())
    assert set(page.charts) == {("reward_mean", "iteration"), ("reward_mean", "seconds")}
    assert "model.kind=digits" in page.charts[("reward_mean", "iteration")][0]


def test_bad_run_directories(runs, tmp_path, capsys):
    good = runs["grpo-a"]
    no_metrics = shutil.copytree(good, tmp_path / "no-metrics", ignore=shutil.ignore_patterns("checkpoints", "metrics.jsonl"))
    no_config = shutil.copytree(good, tmp_path / "no-config", ignore=shutil.ignore_patterns("checkpoints", "config.yaml"))
    empty = shutil.copytree(good, tmp_path / "empty", ignore=shutil.ignore_patterns("checkpoints"))
    (empty / "metrics.jsonl").write_text("")
    cases = [((good, no_metrics), [str(no_metrics), "not a difrl run directory", "no metrics.jsonl"]),
             ((good, no_config), [str(no_config), "no config.yaml"]),
             ((good, tmp_path / "absent"), [str(tmp_path / "absent"), "no such run directory"]),
             ((empty, good), [str(empty / "metrics.jsonl"), "holds no iteration"]),
             ((good,), ["two run directories or more", "difrl report"]),
             ((good, good), [str(good), "given twice"])]
    for dirs, said in cases:
        out = tmp_path / "never.html"
        rc, _, err = compare(capsys, *dirs, "--out", out)
        assert rc == 2 and err.startswith("difrl compare: error: "), (dirs, rc, err)
        assert all(s in err for s in said), (said, err)
        assert not out.exists()
