"""The benchmark scripts run and report what they claim (timings themselves are never asserted).

    pytest tests/test_benchmarks.py -q
"""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_rollout_rows_and_markdown(tmp_path, monkeypatch):
    bench = _load("bench_rollout")
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # write BENCHMARKS.md into tmp, not the checkout
    rows = bench.main(["--quick", "--repeats", "3", "--models", "digits", "--batches", "4", "--num-steps", "3",
                       "--json", str(tmp_path / "rows.json")])
    methods = [r["method"] for r in rows]
    assert methods[0] == "plain ODE loop (baseline)" and rows[0]["ratio"] == 1.0
    assert {"rollout flow_sde + log-probs", "rollout dance_sde + log-probs", "rollout cps + log-probs"} <= set(methods)
    assert all(r["median_ms"] > 0 and r["batch"] == 4 for r in rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert bench.BEGIN in md and "Command: `python benchmarks/bench_rollout.py --quick" in md
    # a second run replaces its block instead of appending another
    bench.main(["--repeats", "3", "--models", "digits", "--batches", "4", "--num-steps", "3"])
    assert (tmp_path / "BENCHMARKS.md").read_text().count(bench.BEGIN) == 1
