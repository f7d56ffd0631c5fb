"""Several run directories side by side: what `difrl compare` reads, labels, groups and draws (no HTML here).

    from difrl.report.compare import load_compared, shared_metrics, overlay, final_table
    runs = load_compared(["runs/a", "runs/b", "runs/c"])   # ComparedRun each: label, group, color; CompareError
    shared, constant, only = shared_metrics(runs)         # eval metrics every run has (drawn), unchanged, not shared
    overlay(runs, "accuracy", "seconds")                  # one Series per run, x = cumulative seconds
    rows, groups = final_table(runs, shared)              # final evaluations, and each group's mean / std (n-1)

A run is labelled by its directory name plus the config keys in which it differs from the others
(config.yaml, nested keys flattened to `a.b`; the command's bookkeeping, BOOKKEEPING, is never compared).
Runs whose configs are equal once `seed` is left out form a group: one color, one dash per seed, and a row
with the group's mean and sample standard deviation (n - 1) in the final table.

Time axis: metrics.jsonl's `seconds` is the wall-clock of one iteration, its evaluation included (the trainers
time from the iteration's start to the row's end, so `seconds_eval` is part of it); the run's clock at iteration
i is the running sum of `seconds` up to i (0 at iteration 0, where the evaluation before training sits: its own
time is not logged, nor the final evaluation's). An evaluation at iteration i is drawn at that clock.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from difrl.report.data import (
    RunData,
    Series,
    all_evals,
    before_after,
    eval_points,
    flatten,
    headline,
    is_num,
    load_run,
)

# the command's own keys, not the run's (difrl.train.run.rundir.BOOKKEEPING: resume never compares them either)
BOOKKEEPING = ("out", "resume", "resume_override", "resume_unverified", "history")
NOT_GROUPED = ("seed",)  # runs equal but for these are one group (seeds of one config)
LABEL_KEYS = 3  # config keys spelled out in a label; the rest are counted ("+2 more") and in the config table
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
          "#bcbd22")
DASHES = ("", "6 3", "2 2", "8 3 2 3", "1 3")  # the i-th seed of a group
REWARD = "reward_mean"
X_AXES = ("iteration", "seconds")


class CompareError(ValueError):
    """What is wrong with the runs given to difrl compare, and where (the CLI prints it, exit status 2)."""


@dataclass
class ComparedRun:
    data: RunData
    name: str  # the directory's name (with its parent's when two runs share a name)
    config: dict  # config.yaml flattened, bookkeeping left out
    differs: dict = field(default_factory=dict)  # key -> this run's value, for the keys where the runs differ
    label: str = ""
    group: int = 0  # runs with equal configs but for the seed share a group (numbered in order of appearance)
    color: str = COLORS[0]
    dash: str = ""
    clock: dict[int, float] | None = None  # iteration -> cumulative seconds; None if a row has no `seconds`


def _show(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _config(run: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CompareError(f"{run / 'config.yaml'}: not readable YAML ({e})") from e
    if not isinstance(cfg, dict):
        raise CompareError(f"{run / 'config.yaml'}: not a mapping of config keys (difrl train writes one)")
    return {k: v for k, v in flatten(cfg).items() if k.split(".")[0] not in BOOKKEEPING}


def _checked(path: str | Path) -> Path:
    run = Path(path)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run directory")
    for name, why in (("config.yaml", "difrl train writes one when a run starts"),
                      ("metrics.jsonl", "difrl train writes one row per iteration")):
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run} is not a difrl run directory (no {name}; {why})")
    return run


def _clock(rows: list[dict]) -> dict[int, float] | None:
    if not all(is_num(r.get("seconds")) for r in rows):
        return None
    clock, t = {0: 0.0}, 0.0
    for r in sorted(rows, key=lambda r: r["iteration"]):
        t += r["seconds"]
        clock[int(r["iteration"])] = t
    return clock


def _names(dirs: list[Path]) -> list[str]:
    """Directory names, made unique with as many parent names as it takes (runs/a/digits, runs/b/digits)."""
    for depth in range(1, max(len(d.resolve().parts) for d in dirs) + 1):
        names = ["/".join(d.resolve().parts[-depth:]) for d in dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in dirs]


def load_compared(dirs: list[str | Path]) -> list[ComparedRun]:
    """The runs, labelled, grouped and colored; CompareError / FileNotFoundError naming the directory at fault."""
    if len(dirs) < 2:
        raise CompareError("compare needs two run directories or more (one run: difrl report RUN_DIR)")
    paths = [_checked(d) for d in dirs]
    seen: dict[Path, Path] = {}
    for p in paths:
        if p.resolve() in seen:
            raise CompareError(f"{p} is given twice (as {seen[p.resolve()]} too)")
        seen[p.resolve()] = p
    runs = []
    for p, name in zip(paths, _names(paths)):
        data = load_run(p)
        if not data.rows:
            raise CompareError(f"{p / 'metrics.jsonl'} holds no iteration (empty or unreadable): the run has not "
                               "finished its first iteration, so there is no curve to compare")
        runs.append(ComparedRun(data, name, _config(p), clock=_clock(data.rows)))
    _label(runs)
    _group(runs)
    return runs


def _label(runs: list[ComparedRun]) -> None:
    keys = list(dict.fromkeys(k for r in runs for k in r.config))
    differ = [k for k in keys if len({_show(r.config[k]) if k in r.config else None for r in runs}) > 1]
    everywhere = [k for k in differ if all(k in r.config for r in runs) and k not in NOT_GROUPED]
    differ = everywhere + [k for k in differ if k not in everywhere and k not in NOT_GROUPED] + [
        k for k in differ if k in NOT_GROUPED]  # keys every config has first (model.kind before a world's own), seed last
    for r in runs:
        r.differs = {k: r.config.get(k, "(not set)") for k in differ}
        shown = [f"{k}={_show(v)}" for k, v in list(r.differs.items())[:LABEL_KEYS]]
        if len(differ) > LABEL_KEYS:
            shown.append(f"+{len(differ) - LABEL_KEYS} more")
        r.label = r.name + (f" ({', '.join(shown)})" if shown else "")


def _group(runs: list[ComparedRun]) -> None:
    ids: dict[str, int] = {}
    seen: dict[int, int] = {}  # group -> its runs so far (the i-th gets the i-th dash)
    for r in runs:
        key = json.dumps({k: v for k, v in r.config.items() if k not in NOT_GROUPED}, sort_keys=True, default=str)
        r.group = ids.setdefault(key, len(ids))
        i = seen[r.group] = seen.get(r.group, -1) + 1
        r.color, r.dash = COLORS[r.group % len(COLORS)], DASHES[i % len(DASHES)]


def groups(runs: list[ComparedRun]) -> list[list[ComparedRun]]:
    out: dict[int, list[ComparedRun]] = {}
    for r in runs:
        out.setdefault(r.group, []).append(r)
    return list(out.values())


# ---------------------------------------------------------------------------------- curves


def shared_metrics(runs: list[ComparedRun]) -> tuple[list[str], dict[str, float], dict[str, list[str]]]:
    """(eval metrics every run has, drawn: the first run's headline metrics first, then those that change; those
    equal at every evaluation of every run: {key: value}; metrics only some runs have: {key: [run names]})."""
    pts = [eval_points(r.data) for r in runs]
    head = headline(runs[0].data)
    keys = list(dict.fromkeys([k for k in head if k in pts[0]] + list(pts[0])))
    shared = [k for k in keys if all(k in p for p in pts)]
    constant = {}
    for k in list(shared):
        values = {v for p in pts for v in p[k].values()}
        if len(values) == 1 and k not in head:  # a headline metric is drawn even when flat (as difrl report does)
            constant[k] = values.pop()
            shared.remove(k)
    every = list(dict.fromkeys(k for p in pts for k in p))
    only = {k: [r.name for r, p in zip(runs, pts) if k in p] for k in every if not all(k in p for p in pts)}
    return shared, constant, only


def _at(run: ComparedRun, points: dict[int, float], x: str) -> tuple[list[float], list[float]]:
    its = sorted(points)
    if x == "iteration":
        return [float(i) for i in its], [points[i] for i in its]
    its = [i for i in its if run.clock is not None and i in run.clock]
    return [run.clock[i] for i in its], [points[i] for i in its]


def overlay(runs: list[ComparedRun], metric: str, x: str) -> list[Series]:
    """One Series per run (named by its label) of `metric` (REWARD: the train reward's mean per iteration; else
    an evaluation metric) against x = "iteration" or "seconds" (a run without `seconds` is left out)."""
    out = []
    for r in runs:
        if metric == REWARD:
            points = {int(row["iteration"]): row[REWARD] for row in r.data.rows if is_num(row.get(REWARD))}
        else:
            points = eval_points(r.data).get(metric, {})
        xs, ys = _at(r, points, x)
        if xs:
            out.append(Series(r.label, xs, ys, r.color, markers=metric != REWARD, dash=r.dash))
    return out


# ---------------------------------------------------------------------------------- final table


def final_eval(data: RunData) -> tuple[dict, int | None, str]:
    """(metrics, iteration, where from) of a run's final evaluation: summary.json's / eval.json's "after", else
    the last evaluation recorded (an unfinished run), else nothing."""
    _, after, after_it = before_after(data)
    if after is not None:
        return flatten(after), after_it, "after"
    rows, _ = all_evals(data)
    done = [r for r in rows if r.get("tag") != "before"]
    if not done:
        return {}, None, "no evaluation after training yet"
    last = done[-1]
    return ({k: v for k, v in last.items() if k not in ("tag", "iteration")}, last.get("iteration"),
            f"last evaluation ({last.get('tag')}): the run has not finished")


def final_row(run: ComparedRun, keys: list[str]) -> dict:
    """The table's numbers for one run: its final evaluation's `keys`, the last train reward, iterations, clock."""
    ev, it, source = final_eval(run.data)
    last = run.data.rows[-1]
    row = {k: ev.get(k) for k in keys}
    row.update({"iterations": int(last["iteration"]), "seconds": run.clock[int(last["iteration"])] if run.clock else None,
                "reward_mean (last iteration)": last.get(REWARD), "_source": source, "_eval_iteration": it})
    return row


def mean_std(values: list[float]) -> tuple[float | None, float | None, int]:
    """(mean, sample standard deviation with n - 1, n) of the numbers given; std None below two."""
    xs = [v for v in values if is_num(v)]
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None, len(xs)


TABLE_EXTRA = ("reward_mean (last iteration)", "iterations", "seconds")


def final_table(runs: list[ComparedRun], keys: list[str]) -> tuple[list[dict], list[dict]]:
    """(one row per run, one per group of two runs or more: {column: (mean, std, n)}, "seeds": [...])."""
    rows = [final_row(r, keys) for r in runs]
    by_run = {id(r): row for r, row in zip(runs, rows)}
    stats = []
    for members in groups(runs):
        if len(members) < 2:
            continue
        cols = {k: mean_std([by_run[id(r)][k] for r in members]) for k in [*keys, *TABLE_EXTRA]}
        stats.append({"group": members[0].group, "runs": [r.name for r in members], "color": members[0].color,
                      "seeds": [r.config.get("seed") for r in members], "columns": cols})
    return rows, stats
