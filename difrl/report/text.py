"""An evaluation as a plain-text table for the terminal (`difrl eval`; `--json` prints the JSON instead).

    print(eval_text(metrics, run_dir, comparable=True, headline=("accuracy",)))   # before / after / change
    print(eval_table(metrics))                                                   # one column: the metrics

A run directory's evaluation is shown beside the run's own evaluation before training (summary.json's, else the
"before" row of eval.json) when it measured the same thing (`comparable`: the command kept the run's settings,
no other prompts, reference or protocol); otherwise, or for a config's model, the metrics alone. Numbers are the
rows (nested provenance flattened to `outer.inner`, headline metrics first); text values (the policy evaluated,
the prompt file, a grid's path) are listed under the table. Only the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

from difrl.report.charts import fmt
from difrl.report.data import flatten, is_num


def run_before(run_dir: Path) -> dict | None:
    """The run's evaluation before training: summary.json's eval_before, else eval.json's "before" row, else None."""
    run_dir = Path(run_dir)
    try:
        if (run_dir / "summary.json").is_file():
            before = json.loads((run_dir / "summary.json").read_text()).get("eval_before")
            if isinstance(before, dict):
                return before
        if (run_dir / "eval.json").is_file():
            for row in json.loads((run_dir / "eval.json").read_text()):
                if isinstance(row, dict) and row.get("tag") == "before":
                    return {k: v for k, v in row.items() if k not in ("tag", "iteration")}
    except (OSError, ValueError):  # a damaged file: the table without the before column
        return None
    return None


def eval_table(after: dict, before: dict | None = None, headline=(), labels=("before", "after")) -> str:
    """`after`'s numeric metrics as aligned rows (with `before` and the change when given; a null, i.e. a metric
    that was not a number, as n/a), then its other values as `key: value` lines."""
    a, b = flatten(after), flatten(before or {})
    numeric = [k for k in a if is_num(a[k]) or a[k] is None or (before is not None and is_num(b.get(k)))]
    keys = [k for k in headline if k in numeric] + [k for k in numeric if k not in headline]
    cols = [labels[0], labels[1], "change"] if before is not None else ["value"]
    rows = []
    for k in keys:
        if before is None:
            rows.append([k, _cell(a, k)])
            continue
        bv, av = b.get(k), a.get(k)
        change = av - bv if is_num(av) and is_num(bv) else None
        rows.append([k, _cell(b, k), _cell(a, k), "" if change is None else ("+" if change > 0 else "") + fmt(change)])
    lines = []
    if rows:
        widths = [max(len(r[i]) for r in [["metric", *cols], *rows]) for i in range(len(cols) + 1)]
        for r in [["metric", *cols], *rows]:
            lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip())
    lines += [f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in a.items() if k not in numeric]
    return "\n".join(lines)


def _cell(metrics: dict, key: str) -> str:
    """A table cell: blank where the key is absent, n/a where it is null (a metric that was not a number)."""
    return "" if key not in metrics else "n/a" if metrics[key] is None else fmt(metrics[key])


def eval_text(metrics: dict, run_dir: Path | None = None, comparable: bool = False, headline=()) -> str:
    """What `difrl eval` prints: the table, beside the run's evaluation before training when `comparable`."""
    # provenance `difrl eval` records as null where it does not apply (a bundled world has no prompt file or
    # resolution); any other null is a metric that was not a number, shown as n/a
    metrics = {k: v for k, v in metrics.items() if not (v is None and k in ("eval_prompts", "resolution"))}
    before = run_before(run_dir) if run_dir is not None and comparable else None
    if before is None:
        return eval_table(metrics, headline=headline)
    note = (f"before: {run_dir}'s evaluation before training; after: this evaluation of {metrics.get('policy', '?')}")
    return eval_table(metrics, before, headline, ("before", "after")) + "\n" + note
