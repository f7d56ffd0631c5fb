"""Reading a run directory into what the report shows: the parsed files and the series drawn from them.

    from difrl.report.data import load_run, reward_series, eval_series
    data = load_run("runs/digits")            # RunData: config text, metrics rows, summary, evals, "not here" lines
    series, constant = eval_series(data)      # eval metrics that change (drawn) and those that never do (listed)

No HTML here (difrl.report.render turns this into the page); only the standard library.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_EMBED_BYTES = 32 * 2**20  # one image or GIF above this is listed, not embedded
MIME = {".png": "image/png", ".gif": "image/gif", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
REWARD_COLOR, EVAL_COLOR, DIAG_COLOR = "#1f77b4", "#d62728", "#555555"


# ---------------------------------------------------------------------------------- reading the run directory


@dataclass
class RunData:
    dir: Path
    config_text: str | None = None
    rows: list[dict] = field(default_factory=list)
    summary: dict | None = None
    evals: list[dict] | None = None
    last_written: float | None = None  # newest mtime of metrics.jsonl / config.yaml (seconds since the epoch)
    reward_curve: Path | None = None  # the trainer's reward_curve.png, when written
    samples: list[Path] = field(default_factory=list)  # the sample images/GIFs to embed, in page order
    samples_found: int = 0  # every sample file found, the too-large ones included
    other_files: list[tuple[str, str, str]] = field(default_factory=list)  # (name, "/" if a directory, extra note)
    missing: list[str] = field(default_factory=list)  # the "not here" lines, plain text


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts (provenance, e.g. {"fid": {"fd": 3.1, "extractor": "inception"}}) -> {"fid.fd": 3.1,
    "fid.extractor": "inception"}; other values kept as they are."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _read_json(path: Path, data: RunData, why_missing: str):
    if not path.exists():
        data.missing.append(f"{path.name}: {why_missing}")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        data.missing.append(f"{path.name}: could not be read ({e})")
        return None


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    data = RunData(run_dir)
    cfg = run_dir / "config.yaml"
    if cfg.exists():
        data.config_text = cfg.read_text(errors="replace")
    else:
        data.missing.append("config.yaml: not written (the run did not start)")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        bad = 0
        for line in metrics.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and is_num(row.get("iteration")):
                data.rows.append(row)
            else:
                bad += 1
        if bad:
            data.missing.append(f"metrics.jsonl: {bad} unreadable line(s) skipped (a crash while writing?)")
        if not data.rows:
            data.missing.append("metrics.jsonl: no iterations logged yet, so no curves")
    else:
        data.missing.append("metrics.jsonl: not written, so no curves")
    summary = _read_json(run_dir / "summary.json", data,
                         "not written: the run stopped early or is still running (before/after come from eval.json)")
    data.summary = summary if isinstance(summary, dict) else None
    evals = _read_json(run_dir / "eval.json", data, "not written (the evaluation list comes from summary.json and "
                       "metrics.jsonl)")
    data.evals = [e for e in evals if isinstance(e, dict)] if isinstance(evals, list) else None
    data.last_written = max((p.stat().st_mtime for p in (metrics, cfg) if p.exists()), default=None)
    curve_png = run_dir / "reward_curve.png"
    if curve_png.exists():
        data.reward_curve = curve_png
    else:
        data.missing.append("reward_curve.png: not written (it is drawn when the run finishes)")
    _read_samples(data)
    for name in ("policy.safetensors", "lora", "checkpoints"):
        p = run_dir / name
        if p.exists():
            extra = ""
            if name == "checkpoints" and (p / "latest").exists():
                extra = f" (latest: {(p / 'latest').read_text().strip()})"
            data.other_files.append((name, "/" if p.is_dir() else "", extra))
    return data


def before_after(data: RunData) -> tuple[dict | None, dict | None, int | None]:
    """(eval before, eval after, the after's iteration): summary.json's, else eval.json's "before"/"after" rows."""
    before = after = after_it = None
    if data.summary is not None:
        before, after = data.summary.get("eval_before"), data.summary.get("eval_after")
        after_it = data.summary.get("iterations")
    if data.evals:
        for e in data.evals:
            if e.get("tag") == "before" and before is None:
                before = {k: v for k, v in e.items() if k not in ("tag", "iteration")}
            if e.get("tag") == "after" and (after is None or data.summary is None):
                after = {k: v for k, v in e.items() if k not in ("tag", "iteration")}
                after_it = e.get("iteration", after_it)
    if after is not None and not is_num(after_it):
        after_it = data.rows[-1]["iteration"] if data.rows else None
    return (before if isinstance(before, dict) else None, after if isinstance(after, dict) else None,
            int(after_it) if is_num(after_it) else None)


def headline(data: RunData) -> list[str]:
    h = (data.summary or {}).get("headline") or []
    return [str(k) for k in h] if isinstance(h, list) else []


# ---------------------------------------------------------------------------------- series


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    color: str
    band: tuple[list[float], list[float]] | None = None  # (low, high) per point
    markers: bool = False
    dash: str = ""  # an SVG stroke-dasharray ("" = solid): difrl compare's seeds of one config share a color


def reward_series(rows: list[dict]) -> list[Series]:
    out = []
    pts = [(r["iteration"], r["reward_mean"], r.get("reward_std")) for r in rows if is_num(r.get("reward_mean"))]
    if pts:
        band = None
        if all(is_num(s) for _, _, s in pts):
            band = ([m - s for _, m, s in pts], [m + s for _, m, s in pts])
        out.append(Series("reward_mean", [p[0] for p in pts], [p[1] for p in pts], REWARD_COLOR, band))
    names = list(dict.fromkeys(k for r in rows for k in r if k.startswith("reward/")))
    for k in names:
        pts = [(r["iteration"], r[k]) for r in rows if is_num(r.get(k))]
        if pts:
            out.append(Series(k, [p[0] for p in pts], [p[1] for p in pts], REWARD_COLOR))
    return out


def eval_points(data: RunData) -> dict[str, dict[int, float]]:
    """metric -> {iteration: value} over every evaluation: before (iteration 0), each eval.json row and each
    metrics.jsonl eval/<key> column, after; nested provenance flattened."""
    pts: dict[str, dict[int, float]] = {}

    def add(it, ev: dict) -> None:
        if not is_num(it):
            return
        for k, v in flatten(ev).items():
            if k not in ("tag", "iteration") and is_num(v):
                pts.setdefault(k, {})[int(it)] = v

    before, after, after_it = before_after(data)
    if before is not None:
        add(0, before)
    for e in data.evals or []:
        add(e.get("iteration"), e)
    for r in data.rows:
        add(r["iteration"], {k[5:]: v for k, v in r.items() if k.startswith("eval/")})
    if after is not None:
        add(after_it, after)
    return pts


def eval_series(data: RunData) -> tuple[list[Series], dict[str, float]]:
    """The eval metrics that change (headline first) as series, and those that never do as {key: value}."""
    pts, head = eval_points(data), headline(data)
    order = [k for k in head if k in pts] + [k for k in pts if k not in head]
    series, constant = [], {}
    for k in order:
        its = sorted(pts[k])
        ys = [pts[k][i] for i in its]
        if len(set(ys)) == 1 and k not in head:
            constant[k] = ys[0]
        else:
            series.append(Series(f"eval/{k}", its, ys, EVAL_COLOR, markers=True))
    return series, constant


SKIP_DIAG = ("iteration", "reward_mean", "reward_std")


def diagnostic_series(rows: list[dict]) -> tuple[list[Series], dict[str, float]]:
    names = list(dict.fromkeys(k for r in rows for k, v in r.items()
                               if is_num(v) and k not in SKIP_DIAG and not k.startswith(("reward/", "eval/"))))
    series, constant = [], {}
    for k in names:
        pts = [(r["iteration"], r[k]) for r in rows if is_num(r.get(k))]
        ys = [p[1] for p in pts]
        if len(set(ys)) == 1:
            constant[k] = ys[0]
        else:
            series.append(Series(k, [p[0] for p in pts], ys, DIAG_COLOR))
    return series, constant



def all_evals(data: RunData) -> tuple[list[dict], str]:
    """Every evaluation as flat dicts with "tag" and "iteration", and where they came from."""
    if data.evals:
        return [flatten(e) for e in data.evals], "eval.json"
    rows = []
    before, after, after_it = before_after(data)
    if before is not None:
        rows.append({"tag": "before", "iteration": 0, **flatten(before)})
    for r in data.rows:
        ev = {k[5:]: v for k, v in r.items() if k.startswith("eval/")}
        if ev:
            rows.append({"tag": "eval", "iteration": r["iteration"], **ev})
    if after is not None:
        rows.append({"tag": "after", "iteration": after_it, **flatten(after)})
    return rows, "summary.json and the eval/ columns of metrics.jsonl"


# ---------------------------------------------------------------------------------- samples


def sample_files(run_dir: Path) -> list[Path]:
    """samples/ images and GIFs, before first, then by iteration, after last."""
    d = run_dir / "samples"
    if not d.is_dir():
        return []
    files = [p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in MIME]

    def key(p: Path):
        stem = p.stem.lower()
        nums = re.findall(r"\d+", stem)
        phase = 0 if stem.startswith("before") else 2 if stem.startswith("after") else 1
        return phase, int(nums[-1]) if nums else -1, str(p)

    return sorted(files, key=key)


def sample_caption(p: Path) -> str:
    stem = p.stem.lower()
    nums = re.findall(r"\d+", stem)
    it = f"iteration {int(nums[-1])}" if nums else ""
    if stem.startswith("before"):
        what = "before training"
    elif stem.startswith("after"):
        what = "after training"
    elif stem.startswith("eval"):
        what = "evaluation"
    else:
        what = "samples"
    return ", ".join(x for x in (what, it) if x)


def _read_samples(data: RunData) -> None:
    files = sample_files(data.dir)
    data.samples_found = len(files)
    if not files:
        data.missing.append("samples/: no sample images or GIFs (this world saves none, or the run stopped before "
                            "its first evaluation)")
    for p in files:
        size = p.stat().st_size
        if size > MAX_EMBED_BYTES:
            rel = p.relative_to(data.dir).as_posix()
            data.missing.append(f"{rel}: {size / 2**20:.0f} MiB, too large to embed (open it next to this report)")
        else:
            data.samples.append(p)
