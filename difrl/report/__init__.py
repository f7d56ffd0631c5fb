"""A self-contained HTML report of a run directory: config, curves, evaluation table and samples.

    from difrl.report import write_report
    path = write_report("runs/digits")        # -> runs/digits/report.html (returns the path)
    python -m difrl.report runs/digits        # the same from a shell (or `difrl report runs/digits`)

The page needs nothing but the file: the curves are inline SVG drawn here (no JavaScript, no
plotting library), images and GIFs are embedded as base64 data URIs, and there are no external
URLs, scripts or fonts, so it opens from disk, offline, or as an e-mail attachment. It reads what
the trainers write (docs/concepts.md, "The run directory and its life"):

- `config.yaml`: shown verbatim in a collapsible block, under a one-line digest of the main settings in which a
  setting a resume changed (its `history`) shows each value with the iteration it took effect from;
- `metrics.jsonl`: the train reward (mean, with a ±std band) and every `reward/<name>` over
  iterations, every evaluation metric (before, each `eval/<key>` row, after; metrics that never
  change are listed rather than drawn) and, collapsed, every other numeric column (loss, KL,
  clipping, seconds, ...);
- `summary.json` / `eval.json`: the before / after table and every recorded evaluation, nested
  provenance dicts flattened to `outer.inner` keys;
- `reward_curve.png` and `samples/*.png|gif|jpg|webp`: embedded, in order before, evaluations, after.

A file that is missing (a run stopped early has no summary.json, a masked world no samples) is named
in a "not here" line and the rest still renders; an unreadable line of metrics.jsonl (a crash
mid-write) is skipped and counted. Beyond the standard library it needs only difrl.utils (the
atomic writer); PyYAML, if installed, adds a one-line digest of the config.

The package's seams: `data` reads the run directory (RunData, the series and evaluation rows drawn
from it, no HTML), `charts` draws one series as inline SVG, `render` builds the page; this module
writes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from difrl.report.data import RunData, flatten, load_run
from difrl.report.render import build_report
from difrl.utils.io import atomic_write_text

__all__ = ["REPORT_NAME", "RunData", "build_report", "flatten", "load_run", "main", "write_report"]

REPORT_NAME = "report.html"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write run_dir/report.html (or `out`) atomically and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    out = Path(out) if out is not None else run_dir / REPORT_NAME
    atomic_write_text(out, build_report(run_dir))  # readable as a plain open() would leave it (a page to share)
    return out


def checked_run_dir(path: str | Path) -> Path:
    """`path` as a run directory, or FileNotFoundError naming what is missing: the entry points (`difrl report`,
    `python -m difrl.report`) refuse a directory difrl train did not write (write_report itself renders whatever
    is there, so an unfinished or bare directory still gets a page)."""
    run = Path(path)
    if not run.is_dir() or not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} is not a difrl run directory (no config.yaml; difrl train writes one there)")
    return run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m difrl.report RUN_DIR   (writes RUN_DIR/report.html)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        run = checked_run_dir(argv[0])
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(f"report: {write_report(run)}")
    return 0
