"""`difrl compare`: several runs in one self-contained HTML page, their curves overlaid and their final evaluations
in one table.

    difrl compare runs/grpo-s1 runs/grpo-s2 runs/nft-s1 [--out compare.html] [--x iteration|seconds|both]

    from difrl.report.compare_page import write_compare
    write_compare(["runs/a", "runs/b"], "compare.html")   # -> the path; CompareError / FileNotFoundError if bad

The page is built like `difrl report`'s (difrl.report.render.page, inline SVG from difrl.report.charts, no
scripts, no external URLs): the runs and the config keys in which they differ; the train reward's mean and every
evaluation metric the runs share, each as one chart with a line per run, against iterations and against
wall-clock seconds; the final evaluations in one table, with each group's mean and sample standard deviation
(n - 1) where runs share a config but not a seed (difrl.report.compare: labels, groups, the time axis).
Runs with no evaluation metric in common (different worlds) are still compared on the train reward, with a
note saying so on the page and on stderr.
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path

from difrl.report.charts import esc, fmt, svg_lines
from difrl.report.compare import (
    REWARD,
    TABLE_EXTRA,
    ComparedRun,
    final_table,
    groups,
    load_compared,
    overlay,
    shared_metrics,
)
from difrl.report.render import cell, page
from difrl.utils.io import atomic_write_text

COMPARE_CSS = """
.legend{list-style:none;padding:0;margin:4px 0 10px;display:flex;flex-wrap:wrap;gap:4px 18px;font-size:12px}
.legend svg{vertical-align:middle;margin-right:4px}
tr.group td{background:#f7f7fb;font-style:italic}
"""


def _swatch(r: ComparedRun) -> str:
    dash = f' stroke-dasharray="{r.dash}"' if r.dash else ""
    return (f'<svg width="28" height="8" aria-hidden="true"><line x1="0" y1="4" x2="28" y2="4" stroke="{r.color}" '
            f'stroke-width="2"{dash}/></svg>')


def _legend(runs: list[ComparedRun]) -> str:
    return ('<ul class="legend">' + "".join(f'<li data-run="{esc(r.label)}">{_swatch(r)}{esc(r.label)}</li>'
                                             for r in runs) + "</ul>")


def _runs_table(runs: list[ComparedRun]) -> str:
    out = [('<table id="runs"><thead><tr><th></th><th>run</th><th>directory</th><th>group</th><th>seed</th>'
            "<th>iterations</th><th>seconds</th><th>state</th></tr></thead><tbody>")]
    for r in runs:
        last = int(r.data.rows[-1]["iteration"])
        state = "finished" if r.data.summary is not None else "unfinished (no summary.json)"
        out.append(f'<tr data-run="{esc(r.label)}"><td>{_swatch(r)}</td><td>{esc(r.label)}</td>'
                   f"<td><code>{esc(r.data.dir.resolve())}</code></td>{cell(r.group + 1)}{cell(r.config.get('seed'))}"
                   f"{cell(last)}{cell(r.clock[last] if r.clock else None)}<td>{esc(state)}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _config_table(runs: list[ComparedRun]) -> str:
    keys = list(runs[0].differs)
    if not keys:
        return '<p class="small">The configs are identical (the run directory and resume bookkeeping aside).</p>'
    out = ['<div class="scroll"><table id="config-differences"><thead><tr><th>config key</th>',
           *(f"<th>{esc(r.name)}</th>" for r in runs), "</tr></thead><tbody>"]
    for k in keys:
        out.append(f'<tr data-key="{esc(k)}"><td><code>{esc(k)}</code></td>'
                   + "".join(cell(r.differs[k]) for r in runs) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _charts(runs: list[ComparedRun], metrics: list[str], x: str) -> str:
    figs, name = [], {r.label: r.name for r in runs}
    for m in [REWARD, *metrics]:
        series = overlay(runs, m, x)
        if not series:
            continue
        title = "train reward (mean over the iteration's samples)" if m == REWARD else f"eval/{m}"
        figs.append(f'<figure class="curve">{svg_lines(series, m, x)}'
                    f"<figcaption><b>{esc(title)}</b> against {esc(x)}; last: "
                    + "; ".join(f"{esc(name[s.name])} {esc(fmt(s.ys[-1]))}" for s in series) + "</figcaption></figure>")
    return _legend(runs) + '<div class="charts">' + "".join(figs) + "</div>"


def _final_table(runs: list[ComparedRun], keys: list[str]) -> str:
    rows, stats = final_table(runs, keys)
    cols = [*keys, *TABLE_EXTRA]
    by_group = {s["group"]: s for s in stats}
    out = ['<div class="scroll"><table class="evals" id="final"><thead><tr><th>run</th><th>evaluation</th>',
           *(f"<th>{esc(k)}</th>" for k in cols), "</tr></thead><tbody>"]
    row_of = {id(r): row for r, row in zip(runs, rows)}
    for members in groups(runs):
        for r in members:
            row = row_of[id(r)]
            it = row["_eval_iteration"]
            where = row["_source"] + (f", iteration {it}" if it is not None else "")
            out.append(f'<tr data-run="{esc(r.label)}"><td>{_swatch(r)} {esc(r.label)}</td>'
                       f'<td class="small">{esc(where)}</td>' + "".join(cell(row[k], k) for k in cols) + "</tr>")
        s = by_group.get(members[0].group)
        if s is None:
            continue
        seeds = ", ".join(str(v) for v in s["seeds"])
        out.append(f'<tr class="group" data-group="{s["group"] + 1}"><td>group {s["group"] + 1}: mean ± std (n-1), '
                   f"n = {len(members)} runs (seeds {esc(seeds)})</td><td></td>")
        for k in cols:
            mean, std, n = s["columns"][k]
            if mean is None:
                out.append("<td></td>")
                continue
            text = fmt(mean) + (f" ± {fmt(std)}" if std is not None else "")
            std_attr = f' data-std="{std!r}"' if std is not None else ""
            out.append(f'<td class="num" data-tag="{esc(k)}" data-mean="{mean!r}"{std_attr} data-n="{n}">'
                       f"{esc(text)}</td>")
        out.append("</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _notes(runs: list[ComparedRun], shared: list[str], constant: dict, only: dict) -> list[str]:
    notes = []
    if not shared and not constant:
        have = "; ".join(f"{r.name}: {', '.join(sorted(k for k, names in only.items() if r.name in names)) or 'none'}"
                         for r in runs)
        notes.append(f"No evaluation metric is shared by every run (runs of different worlds?), so only the train "
                     f"reward is compared. Evaluation metrics per run: {have}.")
    elif only:
        notes.append("Not drawn, in some runs only: " + "; ".join(f"{k} ({', '.join(n)})" for k, n in only.items()))
    for r in runs:
        if r.clock is None:
            notes.append(f"{r.name}: metrics.jsonl has rows without `seconds`, so it is left off the seconds axes.")
        notes.extend(f"{r.name}: {m}" for m in r.data.missing if m.startswith(("metrics.jsonl", "summary.json")))
    return notes


def build_compare(run_dirs: list[str | Path], x_axes: tuple[str, ...] = ("iteration", "seconds")
                  ) -> tuple[str, list[str]]:
    """(the page's HTML, the notes it shows: printed by the command too)."""
    runs = load_compared(run_dirs)
    shared, constant, only = shared_metrics(runs)
    notes = _notes(runs, shared, constant, only)
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    body = [f"<h1>difrl compare: {len(runs)} runs</h1>",
            (f'<p class="meta">Written {esc(now)}. Runs are labelled by their directory and the config keys in '
             "which they differ; runs whose configs differ only in <code>seed</code> form a group (one color, a dash "
             "per seed). Seconds: the running sum of metrics.jsonl's per-iteration <code>seconds</code>, evaluations "
             "during training included.</p>")]
    if notes:
        body.append('<div class="missing" id="notes"><b>Notes:</b><ul>'
                    + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul></div>")
    body += ['<h2 id="runs-h">Runs</h2>', _runs_table(runs),
             '<h2 id="config">Config differences</h2>', _config_table(runs)]
    for x in x_axes:
        body += [f'<h2 id="curves-{x}">Curves against {"iterations" if x == "iteration" else "wall-clock seconds"}</h2>',
                 _charts(runs, shared, x)]
    if constant:
        body.append('<p class="small">Equal at every evaluation of every run: '
                    + ", ".join(f"<code>{esc(k)}</code> {esc(fmt(v))}" for k, v in constant.items()) + "</p>")
    final_keys = shared + list(constant)
    body += ['<h2 id="final-evaluation">Final evaluation</h2>', _final_table(runs, final_keys)]
    return page(f"difrl compare: {', '.join(r.name for r in runs)}", body, COMPARE_CSS), notes


def write_compare(run_dirs: list[str | Path], out: str | Path, x_axes: tuple[str, ...] = ("iteration", "seconds")
                  ) -> tuple[Path, list[str]]:
    text, notes = build_compare(run_dirs, x_axes)
    out = Path(out)
    atomic_write_text(out, text)
    return out, notes


def add_arguments(p) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="two run directories or more")
    p.add_argument("--out", default="compare.html", help="the HTML file to write (default: ./compare.html)")
    p.add_argument("--x", choices=("iteration", "seconds", "both"), default="both",
                   help="the curves' x axis: iterations, cumulative wall-clock seconds, or both (default)")


def main(args) -> int:
    """`difrl compare`: CompareError / FileNotFoundError propagate (difrl.cli prints them, exit status 2)."""
    x_axes = ("iteration", "seconds") if args.x == "both" else (args.x,)
    out, notes = write_compare(args.run_dirs, args.out, x_axes)
    for n in notes:
        print(f"difrl compare: note: {n}", file=sys.stderr)
    print(f"compare: {out}")
    return 0
