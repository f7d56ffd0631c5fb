"""A self-contained HTML report of a run directory: config, curves, evaluation table and samples.

    from difrl.report import write_report
    path = write_report("runs/digits")        # -> runs/digits/report.html (returns the path)
    python -m difrl.report runs/digits        # the same from a shell

The page needs nothing but the file: the curves are inline SVG drawn here (no JavaScript, no
plotting library), images and GIFs are embedded as base64 data URIs, and there are no external
URLs, scripts or fonts, so it opens from disk, offline, or as an e-mail attachment. It reads what
the trainers write (README "Run directory"):

- `config.yaml`: shown verbatim in a collapsible block;
- `metrics.jsonl`: the train reward (mean, with a ±std band) and every `reward/<name>` over
  iterations, every evaluation metric (before, each `eval/<key>` row, after; metrics that never
  change are listed rather than drawn) and, collapsed, every other numeric column (loss, KL,
  clipping, seconds, ...);
- `summary.json` / `eval.json`: the before / after table and every recorded evaluation, nested
  provenance dicts flattened to `outer.inner` keys;
- `reward_curve.png` and `samples/*.png|gif|jpg|webp`: embedded, in order before, evaluations, after.

A file that is missing (a run stopped early has no summary.json, a masked world no samples) is named
in a "not here" line and the rest still renders; an unreadable line of metrics.jsonl (a crash
mid-write) is skipped and counted. Only the standard library is needed (PyYAML, if installed, adds a
one-line digest of the config).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPORT_NAME = "report.html"
MAX_EMBED_BYTES = 32 * 2**20  # one image or GIF above this is listed, not embedded
MIME = {".png": "image/png", ".gif": "image/gif", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
REWARD_COLOR, EVAL_COLOR, DIAG_COLOR = "#1f77b4", "#d62728", "#555555"

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#222;
 background:#fff;margin:0 auto;max-width:1200px;padding:16px 24px}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
h3{font-size:15px;margin:16px 0 6px}
.meta{color:#555}.meta code{color:#222}
.missing{background:#fff6e0;border:1px solid #f0d48a;padding:6px 10px;margin:10px 0}
.missing ul{margin:2px 0;padding-left:20px}
pre{background:#f6f8fa;padding:10px;overflow:auto;font-size:12px;max-height:600px}
details>summary{cursor:pointer;font-weight:600}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:10px 16px}
figure{margin:0}figcaption{font-size:12px;color:#444}
svg.chart{width:100%;height:auto;background:#fff;border:1px solid #e4e4e4}
svg.chart .grid{stroke:#eee}svg.chart .axis{stroke:#999}svg.chart text{font-size:10px;fill:#555}
svg.chart .line{fill:none;stroke-width:2}svg.chart .band{stroke:none;opacity:.2}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr.headline td:first-child{font-weight:700}
.small{font-size:12px;color:#555}.scroll{overflow-x:auto}
.samples{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.samples img{max-width:100%;height:auto;border:1px solid #ddd}
img.pixel{image-rendering:pixelated}
"""


# ---------------------------------------------------------------------------------- reading the run directory


@dataclass
class RunData:
    dir: Path
    config_text: str | None = None
    rows: list[dict] = field(default_factory=list)
    summary: dict | None = None
    evals: list[dict] | None = None
    missing: list[str] = field(default_factory=list)  # the "not here" lines, plain text


def _is_num(v) -> bool:
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
            if isinstance(row, dict) and _is_num(row.get("iteration")):
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
    if after is not None and not _is_num(after_it):
        after_it = data.rows[-1]["iteration"] if data.rows else None
    return (before if isinstance(before, dict) else None, after if isinstance(after, dict) else None,
            int(after_it) if _is_num(after_it) else None)


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


def reward_series(rows: list[dict]) -> list[Series]:
    out = []
    pts = [(r["iteration"], r["reward_mean"], r.get("reward_std")) for r in rows if _is_num(r.get("reward_mean"))]
    if pts:
        band = None
        if all(_is_num(s) for _, _, s in pts):
            band = ([m - s for _, m, s in pts], [m + s for _, m, s in pts])
        out.append(Series("reward_mean", [p[0] for p in pts], [p[1] for p in pts], REWARD_COLOR, band))
    names = list(dict.fromkeys(k for r in rows for k in r if k.startswith("reward/")))
    for k in names:
        pts = [(r["iteration"], r[k]) for r in rows if _is_num(r.get(k))]
        if pts:
            out.append(Series(k, [p[0] for p in pts], [p[1] for p in pts], REWARD_COLOR))
    return out


def eval_points(data: RunData) -> dict[str, dict[int, float]]:
    """metric -> {iteration: value} over every evaluation: before (iteration 0), each eval.json row and each
    metrics.jsonl eval/<key> column, after; nested provenance flattened."""
    pts: dict[str, dict[int, float]] = {}

    def add(it, ev: dict) -> None:
        if not _is_num(it):
            return
        for k, v in flatten(ev).items():
            if k not in ("tag", "iteration") and _is_num(v):
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
                               if _is_num(v) and k not in SKIP_DIAG and not k.startswith(("reward/", "eval/"))))
    series, constant = [], {}
    for k in names:
        pts = [(r["iteration"], r[k]) for r in rows if _is_num(r.get(k))]
        ys = [p[1] for p in pts]
        if len(set(ys)) == 1:
            constant[k] = ys[0]
        else:
            series.append(Series(k, [p[0] for p in pts], ys, DIAG_COLOR))
    return series, constant


# ---------------------------------------------------------------------------------- drawing


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def fmt(v) -> str:
    """A table / caption number: integers as they are, floats to 4 decimals (4 significant digits when tiny or huge)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4f}" if 1e-3 <= abs(v) < 1e5 else f"{v:.4g}"


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int) -> tuple[float, float, list[float]]:
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo, target)
    a, b = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    n = int(round((b - a) / step))
    return a, b, [a + i * step for i in range(n + 1)]


def _tick_label(v: float, step: float) -> str:
    if abs(v) < step * 1e-6:
        v = 0.0
    if step >= 1e5 or step < 1e-4:
        return f"{v:.3g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    scaled = step * 10**decimals
    if abs(scaled - round(scaled)) > 1e-6:  # 2.5, 0.25: one more digit
        decimals += 1
    return f"{v:.{decimals}f}"


def svg_chart(s: Series, width: int = 420, height: int = 200) -> str:
    """One series as an inline SVG line chart (axes, ticks, optional band and markers with hover titles)."""
    L, R, T, B = 58, 12, 10, 28
    ys_all = list(s.ys) + (list(s.band[0]) + list(s.band[1]) if s.band else [])
    y0, y1, yt = _ticks(min(ys_all), max(ys_all), 4)
    xlo, xhi = min(s.xs), max(s.xs)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    x0, x1, xt = _ticks(xlo, xhi, 5)
    if all(float(x).is_integer() for x in s.xs):
        xt = [t for t in xt if float(t).is_integer()]
    pw, ph = width - L - R, height - T - B

    def px(x):
        return L + (x - x0) / (x1 - x0) * pw

    def py(y):
        return T + (y1 - y) / (y1 - y0) * ph

    ystep, xstep = yt[1] - yt[0] if len(yt) > 1 else 1.0, xt[1] - xt[0] if len(xt) > 1 else 1.0
    parts = [f'<svg class="chart" data-series="{_e(s.name)}" data-points="{len(s.xs)}" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" aria-label="{_e(s.name)} over iterations">',
             f"<title>{_e(s.name)}</title>"]
    for t in yt:
        parts.append(f'<line class="grid" x1="{L}" x2="{L + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}"/>'
                     f'<text x="{L - 4}" y="{py(t) + 3:.1f}" text-anchor="end">{_e(_tick_label(t, ystep))}</text>')
    for t in xt:
        parts.append(f'<line class="axis" x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{T + ph}" y2="{T + ph + 4}"/>'
                     f'<text x="{px(t):.1f}" y="{T + ph + 15}" text-anchor="middle">{_e(_tick_label(t, xstep))}</text>')
    parts.append(f'<line class="axis" x1="{L}" x2="{L + pw}" y1="{T + ph}" y2="{T + ph}"/>'
                 f'<line class="axis" x1="{L}" x2="{L}" y1="{T}" y2="{T + ph}"/>'
                 f'<text x="{L + pw}" y="{height - 2}" text-anchor="end">iteration</text>')
    if s.band:
        up = [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.band[1])]
        down = [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(reversed(s.xs), reversed(s.band[0]))]
        parts.append(f'<polygon class="band" fill="{s.color}" points="{" ".join(up + down)}"/>')
    pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.ys))
    parts.append(f'<polyline class="line" stroke="{s.color}" points="{pts}"/>')
    if s.markers or len(s.xs) <= 60:
        r = 3.5 if s.markers else 2
        for x, y in zip(s.xs, s.ys):
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{r}" fill="{s.color}">'
                         f"<title>iteration {_e(fmt(x))}: {_e(fmt(y))}</title></circle>")
    parts.append("</svg>")
    return "".join(parts)


def chart_figure(s: Series) -> str:
    last = s.ys[-1]
    cap = f"<b>{_e(s.name)}</b>: last {_e(fmt(last))}"
    if len(s.ys) > 1:
        cap += f" (first {_e(fmt(s.ys[0]))}, min {_e(fmt(min(s.ys)))}, max {_e(fmt(max(s.ys)))}; {len(s.ys)} points)"
    if s.band:
        cap += "; band: ± reward_std"
    return f'<figure class="curve">{svg_chart(s)}<figcaption>{cap}</figcaption></figure>'


def constants_line(constant: dict, what: str) -> str:
    if not constant:
        return ""
    items = ", ".join(f"<code>{_e(k)}</code> {_e(fmt(v))}" for k, v in constant.items())
    return f'<p class="small">{_e(what)}: {items}</p>'


# ---------------------------------------------------------------------------------- tables


def _cell(v, tag: str | None = None) -> str:
    t = f' data-tag="{_e(tag)}"' if tag else ""
    if _is_num(v):
        raw = repr(float(v)) if isinstance(v, float) else str(v)
        return f'<td class="num"{t} data-value="{_e(raw)}">{_e(fmt(v))}</td>'
    if v is None:
        return f'<td{t}></td>'
    text = v if isinstance(v, str) else json.dumps(v)
    return f'<td{t}>{_e(text)}</td>'


def before_after_table(data: RunData) -> str:
    before, after, after_it = before_after(data)
    if before is None and after is None:
        return '<p class="small">No evaluation before or after training recorded.</p>'
    b, a, head = flatten(before or {}), flatten(after or {}), headline(data)
    keys = list(dict.fromkeys([k for k in head if k in b or k in a] + list(b) + list(a)))
    after_label = "after" + (f" (iteration {after_it})" if after_it is not None else "")
    out = ['<table class="evals" id="before-after"><thead><tr><th>metric</th><th>before (iteration 0)</th>'
           f"<th>{_e(after_label)}</th><th>change</th></tr></thead><tbody>"]
    for k in keys:
        cls = ' class="headline"' if k in head else ""
        bv, av = b.get(k), a.get(k)
        change = "<td></td>"
        if _is_num(bv) and _is_num(av) and bv != av:
            d = av - bv
            change = f'<td class="num">{"+" if d > 0 else ""}{_e(fmt(d))}</td>'
        bcell = _cell(bv, "before") if before is not None else "<td></td>"
        acell = _cell(av, "after") if after is not None else "<td></td>"
        out.append(f'<tr data-key="{_e(k)}"{cls}><td>{_e(k)}</td>{bcell}{acell}{change}</tr>')
    out.append("</tbody></table>")
    if after is None:
        out.append('<p class="small">No evaluation after training: the run has not finished.</p>')
    return "".join(out)


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


def evals_table(data: RunData) -> str:
    rows, source = all_evals(data)
    if not rows:
        return ""
    head = headline(data)
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("tag", "iteration")))
    numeric = [k for k in keys if any(_is_num(r.get(k)) for r in rows)]
    numeric = [k for k in head if k in numeric] + [k for k in numeric if k not in head]
    other = [k for k in keys if k not in numeric]
    out = [f"<h3>Every evaluation <span class=\"small\">(from {_e(source)})</span></h3>",
           '<div class="scroll"><table class="evals" id="all-evals"><thead><tr><th>tag</th><th>iteration</th>',
           *(f"<th>{_e(k)}</th>" for k in numeric), "<th>provenance</th>" if other else "", "</tr></thead><tbody>"]
    for r in rows:
        prov = "; ".join(f"{k}: {r[k] if isinstance(r[k], str) else json.dumps(r[k])}" for k in other if k in r)
        out.append(f'<tr data-tag="{_e(r.get("tag", ""))}" data-iteration="{_e(r.get("iteration", ""))}">'
                   f"<td>{_e(r.get('tag', ''))}</td>{_cell(r.get('iteration'))}"
                   + "".join(_cell(r.get(k), k) for k in numeric)
                   + (f'<td class="small">{_e(prov)}</td>' if other else "") + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


# ---------------------------------------------------------------------------------- images


def _image_size(raw: bytes) -> tuple[int, int] | None:
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) >= 24:
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        return int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little")
    return None


def data_uri(path: Path) -> str:
    return f"data:{MIME[path.suffix.lower()]};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def img_tag(path: Path, rel: str, alt: str) -> str:
    raw = path.read_bytes()
    size = _image_size(raw)
    cls, dims = "", ""
    if size and min(size) > 0:
        k = max(1, 300 // max(size))  # small grids (8x8 digits): an integer upscale, crisp pixels
        cls = ' class="pixel"' if max(size) < 400 else ""
        dims = f' width="{size[0] * k}" height="{size[1] * k}"'
    uri = f"data:{MIME[path.suffix.lower()]};base64,{base64.b64encode(raw).decode('ascii')}"
    return f'<img{cls}{dims} src="{uri}" alt="{_e(alt)}" data-file="{_e(rel)}">'


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


def samples_section(data: RunData) -> str:
    files = sample_files(data.dir)
    if not files:
        data.missing.append("samples/: no sample images or GIFs (this world saves none, or the run stopped before "
                            "its first evaluation)")
        return '<p class="small">No samples saved.</p>'
    out = ['<div class="samples">']
    for p in files:
        rel = p.relative_to(data.dir).as_posix()
        size = p.stat().st_size
        if size > MAX_EMBED_BYTES:
            data.missing.append(f"{rel}: {size / 2**20:.0f} MiB, too large to embed (open it next to this report)")
            continue
        cap = f"{sample_caption(p)} <span class=\"small\">({_e(rel)})</span>"
        img = img_tag(p, rel, sample_caption(p))
        out.append(f'<figure class="sample">{img}<figcaption>{cap}</figcaption></figure>')
    out.append("</div>")
    return "".join(out)


# ---------------------------------------------------------------------------------- the page


def _config_digest(text: str) -> str:
    try:
        import yaml

        cfg = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - a digest is optional
        return ""
    if not isinstance(cfg, dict):
        return ""
    flat = flatten(cfg)
    keys = ["model.kind", "model.path", "seed", "train.iterations", "train.lr", "train.kl_beta", "train.lora.enabled",
            "sampler.kind", "sampler.num_steps", "estimator.kind", "rollout.prompts_per_iter", "rollout.group_size",
            "reward.weights"]
    items = [f"{k} = {json.dumps(flat[k]) if not isinstance(flat[k], str) else flat[k]}" for k in keys
             if k in flat and flat[k] is not None]
    rw = cfg.get("reward", {}).get("weights") if isinstance(cfg.get("reward"), dict) else None
    if isinstance(rw, dict):
        items.append("reward.weights = " + json.dumps(rw))
    return f'<p class="small">{_e("; ".join(items))}</p>' if items else ""


def _files_line(run_dir: Path) -> str:
    have = []
    for name in ("policy.safetensors", "lora", "checkpoints"):
        p = run_dir / name
        if p.exists():
            extra = ""
            if name == "checkpoints" and (p / "latest").exists():
                extra = f" (latest: {(p / 'latest').read_text().strip()})"
            have.append(f"<code>{_e(name)}{'/' if p.is_dir() else ''}</code>{_e(extra)}")
    return f'<p class="small">Also in the run directory: {", ".join(have)}.</p>' if have else ""


def build_report(run_dir: str | Path) -> str:
    """The report's HTML text (write_report writes it)."""
    data = load_run(run_dir)
    run_dir = data.dir
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    last = max((p.stat().st_mtime for p in (run_dir / "metrics.jsonl", run_dir / "config.yaml") if p.exists()),
               default=None)
    written = _dt.datetime.fromtimestamp(last).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if last else "?"
    summary = data.summary or {}
    its = summary.get("iterations", data.rows[-1]["iteration"] if data.rows else None)
    state = "finished" if data.summary is not None else "unfinished (no summary.json)"
    if summary.get("stopped_early"):
        state = f"stopped early: {summary['stopped_early']}"

    body = [f"<h1>difrl run report: {_e(run_dir.resolve().name)}</h1>",
            f'<p class="meta">Run directory <code>{_e(run_dir.resolve())}</code><br>'
            f"Report written {_e(now)}; run files last written {_e(written)}<br>"
            f"Iterations: {_e(its if its is not None else '?')}; {_e(state)}"
            + (f"; headline metrics: {_e(', '.join(headline(data)))}" if headline(data) else "") + "</p>"]

    # config
    body.append('<h2 id="config">Config</h2>')
    if data.config_text is not None:
        body.append(_config_digest(data.config_text))
        body.append(f"<details><summary>config.yaml</summary><pre>{_e(data.config_text)}</pre></details>")
    else:
        body.append('<p class="small">No config.yaml.</p>')

    # curves
    body.append('<h2 id="curves">Curves</h2>')
    rewards = reward_series(data.rows)
    evals, eval_const = eval_series(data)
    diag, diag_const = diagnostic_series(data.rows)
    if rewards:
        body.append("<h3>Train reward</h3>")
        body.append('<div class="charts">' + "".join(chart_figure(s) for s in rewards) + "</div>")
    if evals or eval_const:
        body.append("<h3>Evaluation metrics <span class=\"small\">(before = iteration 0, each evaluation, after)"
                    "</span></h3>")
        body.append('<div class="charts">' + "".join(chart_figure(s) for s in evals) + "</div>")
        body.append(constants_line(eval_const, "unchanged at every evaluation"))
    curve_png = run_dir / "reward_curve.png"
    if curve_png.exists():
        body.append('<h3>reward_curve.png <span class="small">(written by the trainer)</span></h3>'
                    f"<figure>{img_tag(curve_png, 'reward_curve.png', 'reward and eval curve')}</figure>")
    else:
        data.missing.append("reward_curve.png: not written (it is drawn when the run finishes)")
    if diag or diag_const:
        body.append(f"<details><summary>Training diagnostics ({len(diag)} curves)</summary>"
                    '<div class="charts">' + "".join(chart_figure(s) for s in diag) + "</div>"
                    + constants_line(diag_const, "constant over the run") + "</details>")
    if not (rewards or evals or diag):
        body.append('<p class="small">Nothing to plot yet.</p>')

    # evaluations
    body.append('<h2 id="evaluation">Evaluation</h2>')
    body.append(before_after_table(data))
    body.append(evals_table(data))

    # samples (this may add "not here" lines)
    samples = samples_section(data)
    body.append('<h2 id="samples">Samples</h2>')
    body.append(samples)
    body.append(_files_line(run_dir))

    if data.missing:
        body.insert(2, '<div class="missing" id="missing"><b>Not here:</b><ul>'
                    + "".join(f"<li>{_e(m)}</li>" for m in data.missing) + "</ul></div>")

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>difrl report: {_e(run_dir.resolve().name)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write run_dir/report.html (or `out`) atomically and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    out = Path(out) if out is not None else run_dir / REPORT_NAME
    text = build_report(run_dir)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m difrl.report RUN_DIR   (writes RUN_DIR/report.html)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    print(f"report: {write_report(argv[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
