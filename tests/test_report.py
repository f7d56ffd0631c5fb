"""The HTML run report (difrl/report/: data, charts, render) on tiny real runs (digits, Sudoku), on unfinished and empty run
directories, and, where Chromium is installed, rendered headless (apt-get install chromium; skipped otherwise).

    .venv/bin/python -m pytest tests/test_report.py -q
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from difrl.report import flatten, write_report

# 8 samples per iteration, 4 steps, 3 iterations with an evaluation after each of the first two (seconds)
DIGITS = ["seed=3", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=6",
          "train.grad_accum=2", "train.iterations=3", "train.lr=1e-3", "eval.every=1", "eval.per_digit=3",
          "eval.num_steps=3"]
SUDOKU = ["seed=3", "threads=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=4",
          "train.inner_updates=2", "train.iterations=2", "train.lr=1e-3", "eval.count=16", "eval.every=1"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    out = tmp_path_factory.mktemp("report") / "digits"
    train(load_flow_config(None, DIGITS), out_dir=out)
    return out


@pytest.fixture(scope="module")
def sudoku_run(tmp_path_factory) -> Path:
    from difrl.train.masked.trainer import train
    from difrl.train.masked.config import load_masked_config

    out = tmp_path_factory.mktemp("report") / "sudoku"
    train(load_masked_config(None, SUDOKU), out_dir=out)
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "*.safetensors", "report.html"))
    return dst


# ------------------------------------------------------------------------- reading the page back


class Page(HTMLParser):
    """What the tests look at: charts, images, table cells, the config block, every src/href."""

    def __init__(self, text: str):
        super().__init__()
        self.svgs: dict[str, dict] = {}
        self.imgs: list[dict] = []
        self.refs: list[tuple[str, str, str]] = []
        self.tags: dict[str, int] = {}
        self.cells: list[dict] = []  # {"table", "row": tr attrs, **td attrs, "text"}
        self.pre: list[str] = []
        self.text: list[str] = []
        self._svg = self._table = self._tr = self._td = None
        self._in_pre = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for k in ("src", "href", "xlink:href", "action", "poster", "data"):
            if a.get(k) is not None:
                self.refs.append((tag, k, a[k]))
        if tag == "svg":
            self._svg = {"series": a.get("data-series"), "points": int(a.get("data-points", -1)), "polyline": [],
                         "band": False, "circles": 0}
            if a.get("data-series"):
                self.svgs[a["data-series"]] = self._svg
        elif self._svg is not None and tag == "polyline":
            self._svg["polyline"].append(a["points"].split())
        elif self._svg is not None and tag == "polygon" and "band" in a.get("class", ""):
            self._svg["band"] = True
        elif self._svg is not None and tag == "circle":
            self._svg["circles"] += 1
        elif tag == "img":
            self.imgs.append(a)
        elif tag == "table":
            self._table = a.get("id")
        elif tag == "tr":
            self._tr = a
        elif tag in ("td", "th"):
            self._td = {"table": self._table, "row": self._tr, "cell": tag, **a, "text": ""}
        elif tag == "pre":
            self._in_pre = True
            self.pre.append("")

    def handle_endtag(self, tag):
        if tag == "svg":
            self._svg = None
        elif tag in ("td", "th") and self._td is not None:
            self.cells.append(self._td)
            self._td = None
        elif tag == "pre":
            self._in_pre = False

    def handle_data(self, data):
        self.text.append(data)
        if self._td is not None:
            self._td["text"] += data
        if self._in_pre:
            self.pre[-1] += data

    def cell(self, table: str, key: str, tag: str) -> dict:
        found = [c for c in self.cells if c["table"] == table and (c["row"] or {}).get("data-key") == key
                 and c.get("data-tag") == tag]
        assert len(found) == 1, (table, key, tag, found)
        return found[0]


def render(run_dir: Path) -> tuple[Path, str, Page]:
    path = write_report(run_dir)
    assert path == run_dir / "report.html" and path.is_file()
    text = path.read_text(encoding="utf-8")
    return path, text, Page(text)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def assert_self_contained(text: str, page: Page) -> None:
    for tag, attr, value in page.refs:
        assert value.startswith(("data:", "#")), f"<{tag} {attr}={value[:80]!r}> is not embedded"
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    assert "@import" not in text and "url(" not in text and "@font-face" not in text


def assert_embedded(page: Page, run_dir: Path, rel: str, mime: str) -> None:
    imgs = [i for i in page.imgs if i.get("data-file") == rel]
    assert len(imgs) == 1, f"{rel} embedded {len(imgs)} times"
    prefix = f"data:{mime};base64,"
    assert imgs[0]["src"].startswith(prefix)
    assert base64.b64decode(imgs[0]["src"][len(prefix):]) == (run_dir / rel).read_bytes(), rel


def assert_chart(page: Page, series: str, n: int, band: bool = False) -> None:
    svg = page.svgs.get(series)
    assert svg is not None, f"no chart for {series}: {sorted(page.svgs)}"
    assert svg["points"] == n and len(svg["polyline"]) == 1 and len(svg["polyline"][0]) == n, (series, svg, n)
    assert svg["circles"] == n  # one marker (with its hover title) per point at these sizes
    assert svg["band"] == band, series


def eval_iterations(rows: list[dict], summary: dict, key: str) -> tuple[list[int], list[float]]:
    """The points the report should plot for an evaluation metric: before at 0, every eval/<key> row, after."""
    pts = {0: summary["eval_before"][key]}
    pts.update({r["iteration"]: r[f"eval/{key}"] for r in rows if f"eval/{key}" in r})
    pts[summary["iterations"]] = summary["eval_after"][key]
    its = sorted(pts)
    return its, [pts[i] for i in its]


# ------------------------------------------------------------------------- finished runs


def test_digits_report(digits_run):
    path, text, page = render(digits_run)
    rows, summary = metric_rows(digits_run), json.loads((digits_run / "summary.json").read_text())
    assert len(rows) == 3
    assert_self_contained(text, page)
    # the config, verbatim, in a collapsible block
    assert "details" in page.tags and page.pre == [(digits_run / "config.yaml").read_text()]
    assert str(digits_run.resolve()) in "".join(page.text)
    # curves: the train reward (with its ±std band) and every reward/<name>, one point per iteration
    assert_chart(page, "reward_mean", len(rows), band=True)
    reward_keys = {k for r in rows for k in r if k.startswith("reward/")}
    assert "reward/digit_prob" in reward_keys
    for k in reward_keys:
        assert_chart(page, k, len(rows))
    # every eval metric: plotted when it changes (before, the two in-run evaluations, after), listed otherwise
    eval_keys = {k[5:] for r in rows for k in r if k.startswith("eval/")}
    assert {"accuracy", "fd", "judge_accuracy", "diversity"} <= eval_keys
    for k in eval_keys:
        its, ys = eval_iterations(rows, summary, k)
        assert its == [0, 1, 2, 3]
        if len(set(ys)) > 1 or k in summary["headline"]:
            assert_chart(page, f"eval/{k}", len(its))
        else:
            assert f"eval/{k}" not in page.svgs and k in "".join(page.text)
    # the before / after table holds summary.json's values, to the last bit
    for tag, ev in (("before", summary["eval_before"]), ("after", summary["eval_after"])):
        for k, v in flatten(ev).items():  # nested provenance as outer.inner rows
            cell = page.cell("before-after", k, tag)
            if isinstance(v, (int, float)):  # exact: the page writes repr(v), which parses back to the same double
                assert float(cell["data-value"]) == v, (k, tag)
            else:
                assert cell["text"] == str(v)
    assert {k for k in summary["headline"]} <= {(c["row"] or {}).get("data-key") for c in page.cells
                                                if (c["row"] or {}).get("class") == "headline"}
    # every evaluation has a row (eval.json's when the trainer writes it, else summary + metrics)
    all_rows = {(c["row"]["data-tag"], c["row"]["data-iteration"]) for c in page.cells if c["table"] == "all-evals"
                and c["row"] and "data-tag" in c["row"]}
    assert all_rows == {("before", "0"), ("eval", "1"), ("eval", "2"), ("after", "3")}
    # every sample grid and the trainer's curve, embedded byte for byte
    grids = sorted((digits_run / "samples").glob("*.png"))
    assert [p.name for p in grids] == ["after-iter-000003.png", "before-iter-000000.png", "eval-iter-000001.png",
                                       "eval-iter-000002.png"]
    for p in grids:
        assert_embedded(page, digits_run, f"samples/{p.name}", "image/png")
    assert_embedded(page, digits_run, "reward_curve.png", "image/png")
    order = [i["data-file"] for i in page.imgs if i["data-file"].startswith("samples/")]
    assert order == ["samples/before-iter-000000.png", "samples/eval-iter-000001.png", "samples/eval-iter-000002.png",
                     "samples/after-iter-000003.png"]
    # written again (the end of a run, then `difrl report`): same place, no temporary files left behind
    assert write_report(digits_run) == path
    assert not [p for p in digits_run.iterdir() if p.name.endswith(".tmp")]


def test_sudoku_report(sudoku_run):
    _, text, page = render(sudoku_run)
    rows, summary = metric_rows(sudoku_run), json.loads((sudoku_run / "summary.json").read_text())
    assert_self_contained(text, page)
    assert_chart(page, "reward_mean", len(rows), band=True)
    assert_chart(page, "reward/sudoku_cells", len(rows))
    for k in summary["headline"]:  # cell_accuracy, solve_rate: always drawn
        its, _ = eval_iterations(rows, summary, k)
        assert_chart(page, f"eval/{k}", len(its))
    for tag, ev in (("before", summary["eval_before"]), ("after", summary["eval_after"])):
        for k in ("cell_accuracy", "solve_rate", "num_puzzles"):
            assert float(page.cell("before-after", k, tag)["data-value"]) == ev[k]
    if (sudoku_run / "eval.json").exists():  # every recorded evaluation is a row of the table, values exact
        evals = json.loads((sudoku_run / "eval.json").read_text())
        for e in evals:
            cells = [c for c in page.cells if c["table"] == "all-evals" and c["row"]
                     and c["row"].get("data-tag") == e["tag"] and c["row"].get("data-iteration") == str(e["iteration"])]
            got = {c["data-tag"]: float(c["data-value"]) for c in cells if "data-value" in c and "data-tag" in c}
            assert got["cell_accuracy"] == e["cell_accuracy"] and got["solve_rate"] == e["solve_rate"]
    # Sudoku saves no sample images today: the report says so instead of failing
    samples = sorted((sudoku_run / "samples").glob("*.png")) if (sudoku_run / "samples").is_dir() else []
    for p in samples:
        assert_embedded(page, sudoku_run, f"samples/{p.name}", "image/png")
    if not samples:
        assert "samples/: no sample images" in "".join(page.text)


# ------------------------------------------------------------------------- unfinished and odd run directories


def test_unfinished_run_still_renders(digits_run, tmp_path):
    d = copy_run(digits_run, tmp_path / "stopped")
    for name in ("summary.json", "eval.json", "reward_curve.png"):
        (d / name).unlink(missing_ok=True)
    for p in (d / "samples").glob("after-*"):
        p.unlink()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 4, "reward_me')  # a crash mid-write
    _, text, page = render(d)
    assert_self_contained(text, page)
    words = "".join(page.text)
    for what in ("summary.json", "eval.json", "reward_curve.png", "1 unreadable line"):
        assert what in words, what
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert_chart(page, "reward_mean", len(rows), band=True)
    assert_chart(page, "eval/fd", 2)  # the in-run evaluations only: no before / after recorded
    assert 'id="before-after"' not in text and "No evaluation before or after training" in words
    assert [i["data-file"] for i in page.imgs] == ["samples/before-iter-000000.png", "samples/eval-iter-000001.png",
                                                   "samples/eval-iter-000002.png"]


def test_empty_run_dir_renders(tmp_path):
    _, text, page = render(tmp_path)
    assert_self_contained(text, page)
    words = "".join(page.text)
    for what in ("config.yaml", "metrics.jsonl", "summary.json", "Nothing to plot"):
        assert what in words, what
    assert not page.svgs and not page.imgs
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "no-such-run")


def test_eval_json_provenance_gif_and_escaping(digits_run, tmp_path):
    """eval.json rows with nested provenance are flattened into the table; before/after come from it when
    summary.json is missing; GIFs (video worlds) are embedded; every string is escaped."""
    from PIL import Image

    d = copy_run(digits_run, tmp_path / "video")
    (d / "summary.json").unlink()
    prov = {"fd": 12.5, "extractor": "inception <script>alert(1)</script>", "per_frame": True}
    evals = [{"tag": "before", "iteration": 0, "accuracy": 0.25, "fid": {**prov, "fd": 20.0}},
             {"tag": "eval", "iteration": 1, "accuracy": 0.5, "fid": prov},
             {"tag": "after", "iteration": 3, "accuracy": 0.75, "fid": {**prov, "fd": 10.0}}]
    (d / "eval.json").write_text(json.dumps(evals))
    frames = [Image.new("RGB", (32, 24), (40 * i, 255 - 40 * i, 90)) for i in range(4)]
    frames[0].save(d / "samples" / "eval-iter-000002.gif", save_all=True, append_images=frames[1:], duration=125,
                   loop=0)
    _, text, page = render(d)
    assert_self_contained(text, page)
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert_embedded(page, d, "samples/eval-iter-000002.gif", "image/gif")
    assert float(page.cell("before-after", "fid.fd", "before")["data-value"]) == 20.0
    assert float(page.cell("before-after", "accuracy", "after")["data-value"]) == 0.75
    fd = [float(c["data-value"]) for c in page.cells if c["table"] == "all-evals" and c.get("data-tag") == "fid.fd"]
    assert fd == [20.0, 12.5, 10.0]
    assert any("fid.extractor: inception <script>" in c["text"] for c in page.cells if c["table"] == "all-evals")
    assert_chart(page, "eval/fid.fd", 3)
    assert_chart(page, "eval/accuracy", 4)  # eval.json's three plus metrics.jsonl's evaluation at iteration 2


def test_run_data_is_read_before_any_html(digits_run, tmp_path):
    """difrl.report.data alone reads a run directory (the page is built from this, no HTML inside): samples in
    page order, the trainer's curve, the other run files, and every "not here" line in the order they print."""
    from difrl.report.data import load_run

    data = load_run(digits_run)
    assert [p.name for p in data.samples] == ["before-iter-000000.png", "eval-iter-000001.png",
                                              "eval-iter-000002.png", "after-iter-000003.png"]
    assert data.samples_found == 4 and data.reward_curve == digits_run / "reward_curve.png"
    assert data.last_written == max((digits_run / n).stat().st_mtime for n in ("metrics.jsonl", "config.yaml"))
    assert [r["iteration"] for r in data.rows] == [r["iteration"] for r in metric_rows(digits_run)]
    assert not any("<" in m for m in data.missing)
    d = copy_run(digits_run, tmp_path / "bare")
    (d / "reward_curve.png").unlink()
    shutil.rmtree(d / "samples")
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "latest").write_text("iter-000003\n")
    bare = load_run(d)
    assert bare.samples == [] and bare.samples_found == 0 and bare.reward_curve is None
    assert [m.split(":")[0] for m in bare.missing] == ["reward_curve.png", "samples/"]
    assert bare.other_files == [("checkpoints", "/", " (latest: iter-000003)")]
    words = "".join(render(d)[2].text)
    assert "Not here:" in words and "No samples saved." in words and "(latest: iter-000003)" in words


def test_too_large_sample_is_listed_not_embedded(digits_run, tmp_path, monkeypatch):
    import difrl.report.data

    d = copy_run(digits_run, tmp_path / "big")
    big = d / "samples" / "eval-iter-000002.png"
    monkeypatch.setattr(difrl.report.data, "MAX_EMBED_BYTES", big.stat().st_size - 1)
    for p in (d / "samples").glob("*.png"):
        if p != big:  # only this one is over the limit
            p.write_bytes(p.read_bytes()[:64])
    _, text, page = render(d)
    assert_self_contained(text, page)
    assert "samples/eval-iter-000002.png" not in [i["data-file"] for i in page.imgs]
    assert [i["data-file"] for i in page.imgs if i["data-file"].startswith("samples/")] == [
        "samples/before-iter-000000.png", "samples/eval-iter-000001.png", "samples/after-iter-000003.png"]
    assert "samples/eval-iter-000002.png: 0 MiB, too large to embed" in "".join(page.text)


def test_report_file_and_command(digits_run, tmp_path):
    """`python -m difrl.report RUN_DIR` writes the same page as write_report, readable by others (0644), with no
    temporary file left; a second out= path gets its own file."""
    d = copy_run(digits_run, tmp_path / "cmd")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "difrl.report", str(d)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"report: {d / 'report.html'}"
    mode = 0o666 & ~_umask()  # what a plain open() gives a new file (0644 under the usual umask 022)
    assert (d / "report.html").stat().st_mode & 0o777 == mode
    assert 'data-series="reward_mean"' in (d / "report.html").read_text(encoding="utf-8")
    out = write_report(d, tmp_path / "elsewhere.html")
    assert out == tmp_path / "elsewhere.html" and out.stat().st_mode & 0o777 == mode
    assert not [p for p in list(d.iterdir()) + list(tmp_path.iterdir()) if p.name.endswith(".tmp")]
    bad = subprocess.run([sys.executable, "-m", "difrl.report"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "usage: python -m difrl.report RUN_DIR" in bad.stdout
    # a directory difrl train did not write gets the error and no page (main() is what `-m difrl.report` runs)
    from difrl.report import main

    assert main([str(tmp_path / "empty")]) == 2 and not (tmp_path / "empty").exists()
    (tmp_path / "bare").mkdir()
    assert main([str(tmp_path / "bare")]) == 2 and not (tmp_path / "bare" / "report.html").exists()


# ------------------------------------------------------------------------- rendered by headless Chromium


def chromium() -> str | None:
    for name in (os.environ.get("DIFRL_CHROMIUM"), "chromium", "chromium-browser", "google-chrome",
                 "google-chrome-stable", "chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--hide-scrollbars", "--mute-audio",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_report_renders_in_headless_chromium(digits_run, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("Chromium not installed: apt-get install chromium (see docs/guides/evaluation.md, 'Run report')")
    from PIL import Image

    path, _, page = render(digits_run)
    url = path.resolve().as_uri()
    shot = tmp_path / "report.png"
    res = run_chromium(binary, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,6000", url)
    assert shot.is_file(), f"no screenshot: {res.returncode}\n{res.stderr[-2000:]}"
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 6000)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "the screenshot is (nearly) blank"

    def near(rgb, tol=12):
        return sum(n for n, c in colours if all(abs(a - b) <= tol for a, b in zip(c, rgb)))

    assert near((31, 119, 180)) > 300, "no reward curve drawn (its blue)"
    assert near((214, 39, 40)) > 300, "no evaluation curve drawn (its red)"
    black = 0  # the sample grids' black background, shown at least at their own size
    for p in (digits_run / "samples").glob("*.png"):
        black += sum(n for n, c in Image.open(p).convert("RGB").getcolors(1 << 20) if c == (0, 0, 0))
    assert black > 1000 and near((0, 0, 0), tol=0) >= black, "the sample grids are not shown"
    top = img.crop((0, 0, 1200, 1400))  # header, config and the first curves
    assert len(top.getcolors(maxcolors=1 << 20)) > 50
    # the rendered DOM holds every chart and every embedded image
    dom = run_chromium(binary, tmp_path / "profile2", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = Page(dom.stdout)
    assert set(rendered.svgs) == set(page.svgs) and rendered.svgs["reward_mean"]["points"] == 3
    assert [i["data-file"] for i in rendered.imgs] == [i["data-file"] for i in page.imgs]
    assert all(i["src"].startswith("data:image/") for i in rendered.imgs)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
