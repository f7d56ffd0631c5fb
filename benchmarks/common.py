"""Shared by the benchmark scripts: the machine line, the BENCHMARKS.md block writer (and its re-render from saved
rows, republish), the statistics over seeds (sample_std, mean_std, pm, beyond_spread: one definition each), and the
equal-wall-clock bookkeeping of bench_video.py and bench_methods.py (budget_run, at_budget).

    from common import publish, standard_args     # benchmarks/ on sys.path, as the scripts put it
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {cores} cores available{gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def stamp(command: str) -> list[str]:
    """The command / date / machine lines every table starts with."""
    return [f"Command: `{command}`  ", f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
            f"Machine: {machine()}"]


def command_line(script: str, argv: list[str] | None) -> str:
    import sys

    args = argv if argv is not None else sys.argv[1:]
    return " ".join([f"python benchmarks/{script}", *args])


def write_block(path: Path, begin: str, end: str, body: list[str]) -> None:
    """Put `body` between the `begin`/`end` markers of `path` (replacing an earlier block, or appending); atomic, so
    a benchmark killed while it writes leaves the file whole."""
    from difrl.utils.io import atomic_write_text

    block = "\n".join([begin, *body, end])
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table says the command that produced it.\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_text(path, text)


class _Quick(argparse.Action):
    """--quick also means --no-write: only a full run may replace the published block in BENCHMARKS.md."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.quick, namespace.no_write = True, True


def standard_args(ap, quick_help: str) -> None:
    """The options every benchmark takes: --quick (a reduced run that never writes BENCHMARKS.md), --json PATH
    (its rows), --no-write."""
    ap.add_argument("--quick", action=_Quick, nargs=0, default=False,
                    help=quick_help + " (never writes BENCHMARKS.md: only a full run publishes)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")


def publish(args, begin: str, end: str, title: str, script: str, argv: list[str] | None, lines: list[str],
            rows: list[dict], echo: bool = True) -> None:
    """Print the block (title, command / date / machine, `lines`; unless `echo` is False), write the rows to --json,
    and put the block between `begin`/`end` in BENCHMARKS.md unless --no-write."""
    body = [f"## {title}", "", *stamp(command_line(script, argv)), "", *lines]
    if echo:
        print("\n".join(body))
    write_json(args.json, rows)
    if not args.no_write:
        write_block(Path(__file__).resolve().parent.parent / "BENCHMARKS.md", begin, end, body)


def repo_path(p) -> str:
    """A path for a result to record: relative to the repository when it lies inside it (a saved result must not
    name the checkout it ran in), a relative one as given, any other as it is."""
    p = Path(p)
    root = Path(__file__).resolve().parent.parent
    if p.is_absolute() and p.resolve().is_relative_to(root):
        return str(p.resolve().relative_to(root))
    return str(p)


def republish(begin: str, end: str, lines: list[str], source: Path, script: str, path: Path | None = None) -> list[str]:
    """Re-render a published block from its full run's saved rows (`--render-from`): the block keeps its title and its
    Command / Date / Machine lines (the run that measured it) and takes `lines` (the tables and sentences rendered by
    today's code, e.g. sample standard deviations) plus one line saying when and from which file. Returns the block."""
    path = path or Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{script} --render-from: no published block {begin} in {path} to re-render")
    old = text.split(begin, 1)[1].split(end, 1)[0].strip("\n").splitlines()
    head = old[:next(i for i, ln in enumerate(old) if ln.startswith("Machine:")) + 1]
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    body = [*head, "", *lines, "", f"Re-rendered {when} from the rows that run saved, {repo_path(source)} "
            f"(`python benchmarks/{script} --render-from {repo_path(source)}`): the measurements are the run's."]
    write_block(path, begin, end, body)
    return body


def cell(v, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    """A table cell: `scale * v` formatted with `spec`, or "-" where nothing was measured (None)."""
    return "-" if v is None else f"{scale * v:{spec}}{suffix}"


def threads_override(threads: int | None) -> list[str]:
    """The training runs' `threads` override for a benchmark's --threads: [] when not given (0 or None), so the runs
    take the config's default (OMP_NUM_THREADS when set, else every core this process may use:
    difrl.train.scaffold.default_threads)."""
    return [f"threads={threads}"] if threads else []


def write_json(path: Path | None, rows: list[dict]) -> None:
    """The rows as JSON at `path` (atomic: a benchmark killed while it writes leaves the previous file whole)."""
    from difrl.utils.io import atomic_write_text

    if path is not None:
        atomic_write_text(path, json.dumps(rows, indent=1))


def same_config(cfg, run_dir: Path) -> bool:
    """A finished run of exactly this config is in run_dir (so --reuse may skip it)."""
    import tempfile

    from difrl.config import save_config

    if not (run_dir / "summary.json").exists() or not (run_dir / "config.yaml").exists():
        return False
    with tempfile.TemporaryDirectory() as d:
        cfg_out = cfg.out
        cfg.out = None
        save_config(cfg, Path(d) / "c.yaml")
        cfg.out = cfg_out
        mine = (Path(d) / "c.yaml").read_text()
    theirs = (run_dir / "config.yaml").read_text()
    if "checkpoint_format: auto" in mine:  # a run's config.yaml records what auto resolved to (difrl.train.run.rundir)
        for resolved in ("gathered", "sharded"):
            theirs = theirs.replace(f"checkpoint_format: {resolved}", "checkpoint_format: auto")
    strip = lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith(("out:", "resume:")))
    return strip(mine) == strip(theirs)


def sample_std(xs) -> float:
    """The sample standard deviation (n - 1) of values over seeds (or repeats): the "± s" of every benchmark table;
    0.0 for a single value (no spread measured: the tables print n beside it)."""
    xs = list(xs)
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_std(xs: list[float]) -> tuple[float, float]:
    """(mean, sample std) over seeds: the "m ± s" of the benchmark tables."""
    return statistics.mean(xs), sample_std(xs)


def pm(m: float, s: float, n: int, spec: str = ".3f") -> str:
    """"m ± s (n=3)": a mean, its sample standard deviation and the number of seeds behind them."""
    return f"{m:{spec}} ± {s:{spec}} (n={n})"


SPREAD_NOTE = ("± is the sample standard deviation (n - 1) over the seeds; \"beyond the spread\" means the two means "
               "differ by more than the sum of their two sample standard deviations (docs/guides/benchmarks.md).")


# ---------------------------------------------------------------------------------- equal wall-clock (bench_video,
# bench_methods): runs of the flow trainer read at a budget of training seconds, the cheaper ones resumed to it


def train_seconds(r: dict) -> float:
    """A metrics row's training seconds: the iteration's, its evaluation excluded."""
    return r["seconds"] - r.get("seconds_eval", 0.0)


def read_rows(d: Path) -> list[dict]:
    """A run directory's metrics.jsonl rows."""
    return [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def budget_run(config: Path, overrides: list[str], d: Path, iterations: int, every: int, metrics: tuple[str, ...],
               budget: float | None = None) -> dict:
    """`iterations` of the flow trainer (`config` + `overrides`) in `d`; then, if `budget` training seconds are not
    spent, the same run resumed (resume=, exact: iteration k is the same whatever the total) to the first evaluation
    past it, so a cheaper method gets the budget's wall-clock. Returns its metric rows, the summary at `iterations`
    and every evaluation as (cumulative training seconds, iteration, {metric: value} for `metrics`)."""
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    summary = train(load_flow_config(config, overrides), out_dir=d, overwrite=True)
    ends = {iterations: summary["eval_after"]}  # the last iteration's evaluation is the summary's, not a row's
    rows = read_rows(d)
    spent = sum(train_seconds(r) for r in rows)
    if budget is not None and spent < budget:
        per_iter = statistics.median(train_seconds(r) for r in rows)
        longer = iterations + every * (math.ceil((budget - spent) / per_iter / every) + 1)  # one evaluation to spare
        longer_summary = train(load_flow_config(config, [*overrides, f"train.iterations={longer}", f"resume={d}"]),
                               out_dir=d)
        ends[longer_summary["iterations"]] = longer_summary["eval_after"]
        rows = read_rows(d)
    t, evals = 0.0, [(0.0, 0, {k: summary["eval_before"][k] for k in metrics})]
    for r in rows:
        t += train_seconds(r)
        if "eval/accuracy" in r:
            evals.append((t, r["iteration"], {k: r[f"eval/{k}"] for k in metrics}))
        elif r["iteration"] in ends:
            evals.append((t, r["iteration"], {k: ends[r["iteration"]][k] for k in metrics}))
    return {"rows": rows, "summary": summary, "evals": evals, "iterations": rows[-1]["iteration"]}


def at_budget(run: dict, budget: float, metrics: tuple[str, ...]) -> dict:
    """The last evaluation (before, every `every`, at the end) of `run` (budget_run's) within `budget` cumulative
    training seconds (1e-4 relative slack: the budget's own run, summed in another order, reads its last one)."""
    t, it, ev = [e for e in run["evals"] if e[0] <= budget * 1.0001][-1]
    return {"seconds": t, "iteration": it, **{k: ev[k] for k in metrics}}


def beyond_spread(ma: float, sa: float, mb: float, sb: float) -> bool:
    """Two means over seeds differ beyond their spreads (|ma - mb| > sa + sb, sa and sb their sample standard
    deviations, sample_std): the only difference a benchmark calls better or worse, and the one meaning of "beyond
    the spread" in every generated sentence (SPREAD_NOTE; docs/guides/benchmarks.md states it)."""
    return abs(ma - mb) > sa + sb
