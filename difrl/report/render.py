"""The report's HTML page: tables, embedded images and the page around them, from a run directory.

    from difrl.report.render import build_report
    text = build_report("runs/digits")        # the whole page as one string (difrl.report.write_report writes it)
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
from pathlib import Path

from difrl.report.charts import chart_figure, constants_line, esc, fmt
from difrl.report.data import (
    MIME,
    RunData,
    all_evals,
    before_after,
    diagnostic_series,
    eval_series,
    flatten,
    headline,
    is_num,
    load_run,
    reward_series,
    sample_caption,
)

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


# ---------------------------------------------------------------------------------- tables


def cell(v, tag: str | None = None) -> str:
    t = f' data-tag="{esc(tag)}"' if tag else ""
    if is_num(v):
        raw = repr(float(v)) if isinstance(v, float) else str(v)
        return f'<td class="num"{t} data-value="{esc(raw)}">{esc(fmt(v))}</td>'
    if v is None:
        return f'<td{t}></td>'
    text = v if isinstance(v, str) else json.dumps(v)
    return f'<td{t}>{esc(text)}</td>'


def before_after_table(data: RunData) -> str:
    before, after, after_it = before_after(data)
    if before is None and after is None:
        return '<p class="small">No evaluation before or after training recorded.</p>'
    b, a, head = flatten(before or {}), flatten(after or {}), headline(data)
    keys = list(dict.fromkeys([k for k in head if k in b or k in a] + list(b) + list(a)))
    after_label = "after" + (f" (iteration {after_it})" if after_it is not None else "")
    out = ['<table class="evals" id="before-after"><thead><tr><th>metric</th><th>before (iteration 0)</th>'
           f"<th>{esc(after_label)}</th><th>change</th></tr></thead><tbody>"]
    for k in keys:
        cls = ' class="headline"' if k in head else ""
        bv, av = b.get(k), a.get(k)
        change = "<td></td>"
        if is_num(bv) and is_num(av) and bv != av:
            d = av - bv
            change = f'<td class="num">{"+" if d > 0 else ""}{esc(fmt(d))}</td>'
        bcell = cell(bv, "before") if before is not None else "<td></td>"
        acell = cell(av, "after") if after is not None else "<td></td>"
        out.append(f'<tr data-key="{esc(k)}"{cls}><td>{esc(k)}</td>{bcell}{acell}{change}</tr>')
    out.append("</tbody></table>")
    if after is None:
        out.append('<p class="small">No evaluation after training: the run has not finished.</p>')
    return "".join(out)


def evals_table(data: RunData) -> str:
    rows, source = all_evals(data)
    if not rows:
        return ""
    head = headline(data)
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("tag", "iteration")))
    numeric = [k for k in keys if any(is_num(r.get(k)) for r in rows)]
    numeric = [k for k in head if k in numeric] + [k for k in numeric if k not in head]
    other = [k for k in keys if k not in numeric]
    out = [f"<h3>Every evaluation <span class=\"small\">(from {esc(source)})</span></h3>",
           '<div class="scroll"><table class="evals" id="all-evals"><thead><tr><th>tag</th><th>iteration</th>',
           *(f"<th>{esc(k)}</th>" for k in numeric), "<th>provenance</th>" if other else "", "</tr></thead><tbody>"]
    for r in rows:
        prov = "; ".join(f"{k}: {r[k] if isinstance(r[k], str) else json.dumps(r[k])}" for k in other if k in r)
        out.append(f'<tr data-tag="{esc(r.get("tag", ""))}" data-iteration="{esc(r.get("iteration", ""))}">'
                   f"<td>{esc(r.get('tag', ''))}</td>{cell(r.get('iteration'))}"
                   + "".join(cell(r.get(k), k) for k in numeric)
                   + (f'<td class="small">{esc(prov)}</td>' if other else "") + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


# ---------------------------------------------------------------------------------- images


def _image_size(raw: bytes) -> tuple[int, int] | None:
    if raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) >= 24:
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    if raw[:6] in (b"GIF87a", b"GIF89a") and len(raw) >= 10:
        return int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little")
    return None


def img_tag(path: Path, rel: str, alt: str) -> str:
    raw = path.read_bytes()
    size = _image_size(raw)
    cls, dims = "", ""
    if size and min(size) > 0:
        k = max(1, 300 // max(size))  # small grids (8x8 digits): an integer upscale, crisp pixels
        cls = ' class="pixel"' if max(size) < 400 else ""
        dims = f' width="{size[0] * k}" height="{size[1] * k}"'
    uri = f"data:{MIME[path.suffix.lower()]};base64,{base64.b64encode(raw).decode('ascii')}"
    return f'<img{cls}{dims} src="{uri}" alt="{esc(alt)}" data-file="{esc(rel)}">'


def samples_section(data: RunData) -> str:
    if not data.samples_found:
        return '<p class="small">No samples saved.</p>'
    out = ['<div class="samples">']
    for p in data.samples:
        rel = p.relative_to(data.dir).as_posix()
        cap = f"{sample_caption(p)} <span class=\"small\">({esc(rel)})</span>"
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
    # a setting a resume changed (config.yaml's history: {iteration, key, old, new}) is each value it had, each
    # with the iteration it took effect (the first after the resume's checkpoint): config.yaml holds the last one
    values: dict[str, list] = {}
    for h in cfg.get("history") or []:
        if isinstance(h, dict) and {"iteration", "key", "new"} <= set(h):
            values.setdefault(h["key"], [(None, h.get("old"))]).append((int(h["iteration"]) + 1, h["new"]))

    def shown(v) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    def setting(k: str) -> str:
        if k not in values:
            return f"{k} = {shown(flat[k])}"
        return f"{k} = " + ", ".join(shown(v) + (f" from iteration {it}" if it else "") for it, v in values[k])

    items = [setting(k) for k in keys if k in flat and flat[k] is not None]
    rw = cfg.get("reward", {}).get("weights") if isinstance(cfg.get("reward"), dict) else None
    if isinstance(rw, dict):
        items.append("reward.weights = " + json.dumps(rw))
    items += [setting(k) for k in values if k not in keys or k not in flat or flat[k] is None]  # other changed ones
    return f'<p class="small">{esc("; ".join(items))}</p>' if items else ""


def _files_line(data: RunData) -> str:
    have = [f"<code>{esc(name)}{slash}</code>{esc(extra)}" for name, slash, extra in data.other_files]
    return f'<p class="small">Also in the run directory: {", ".join(have)}.</p>' if have else ""


def build_report(run_dir: str | Path) -> str:
    """The report's HTML text (write_report writes it)."""
    data = load_run(run_dir)
    run_dir = data.dir
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    last = data.last_written
    written = _dt.datetime.fromtimestamp(last).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z") if last else "?"
    summary = data.summary or {}
    its = summary.get("iterations", data.rows[-1]["iteration"] if data.rows else None)
    state = "finished" if data.summary is not None else "unfinished (no summary.json)"
    if summary.get("stopped_early"):
        state = f"stopped early: {summary['stopped_early']}"

    body = [f"<h1>difrl run report: {esc(run_dir.resolve().name)}</h1>",
            f'<p class="meta">Run directory <code>{esc(run_dir.resolve())}</code><br>'
            f"Report written {esc(now)}; run files last written {esc(written)}<br>"
            f"Iterations: {esc(its if its is not None else '?')}; {esc(state)}"
            + (f"; headline metrics: {esc(', '.join(headline(data)))}" if headline(data) else "") + "</p>"]

    # config
    body.append('<h2 id="config">Config</h2>')
    if data.config_text is not None:
        body.append(_config_digest(data.config_text))
        body.append(f"<details><summary>config.yaml</summary><pre>{esc(data.config_text)}</pre></details>")
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
    if data.reward_curve is not None:
        body.append('<h3>reward_curve.png <span class="small">(written by the trainer)</span></h3>'
                    f"<figure>{img_tag(data.reward_curve, 'reward_curve.png', 'reward and eval curve')}</figure>")
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

    # samples
    body.append('<h2 id="samples">Samples</h2>')
    body.append(samples_section(data))
    body.append(_files_line(data))

    if data.missing:
        body.insert(2, '<div class="missing" id="missing"><b>Not here:</b><ul>'
                    + "".join(f"<li>{esc(m)}</li>" for m in data.missing) + "</ul></div>")

    return page(f"difrl report: {run_dir.resolve().name}", body)


def page(title: str, body: list[str], css: str = "") -> str:
    """The self-contained HTML document around `body`'s parts (empty ones skipped), styled by CSS and `css`:
    the report's and difrl compare's."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{CSS}{css}</style></head>\n<body>\n"
            + "\n".join(b for b in body if b) + "\n</body></html>\n")
