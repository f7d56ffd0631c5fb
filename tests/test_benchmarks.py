"""The benchmark scripts run and report what they claim (timings themselves are never asserted).

    pytest tests/test_benchmarks.py -q
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Exact float comparisons here: a row's ratio to itself (x / x is exactly 1 in IEEE), a standard deviation over one
# seed (0 by definition), counts, and numbers copied from the same file. Means re-derived here from a run's rows are
# float64 sums in another order (rel 1e-9: ~1e-15 per term); other tolerances say why inline.


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
    assert not (tmp_path / "BENCHMARKS.md").exists()  # --quick never publishes
    # a full run writes its block; a second one replaces it instead of appending another
    for _ in range(2):
        bench.main(["--repeats", "3", "--models", "digits", "--batches", "4", "--num-steps", "3"])
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.count(bench.BEGIN) == 1 and "Command: `python benchmarks/bench_rollout.py --repeats 3" in md


def test_bench_quant_rows_and_markdown(tmp_path, monkeypatch):
    bench = _load("bench_quant")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    small = ["--flux-dims", "256", "1024", "--tokens", "32", "--small-tokens", "32", "--batch", "16", "--repeats", "2"]
    res = bench.main(["--quick", *small, "--json", str(tmp_path / "quant.json")])
    fmts = ("bf16", "fp8", "fp8_row", "fp8_block", "mxfp8", "mxfp8_floor", "nvfp4", "nvfp4_single")
    assert [r["format"] for r in res["layers"]] == list(fmts) * 2
    assert [r["format"] for r in res["storage"]] == list(fmts) * 2
    assert [r["format"] for r in res["digits"]] == ["fp32", *fmts]
    err = {(r["layer"], r["format"]): r for r in res["layers"]}
    for layer in ("digits-size", "FLUX-size"):
        g = {f: err[layer, f]["gemm_err"] for f in fmts}
        assert g["bf16"] < g["fp8"] < g["nvfp4"] < 0.2 and err[layer, "nvfp4"]["cosine"] > 0.98
        assert g["bf16"] < g["fp8_row"] < g["nvfp4"]
    mem = {(r["layer"], r["format"]): r for r in res["storage"]}
    assert 0.25 < mem["FLUX-size", "nvfp4"]["x_bf16"] < 0.26  # one E4M3 scale per 16x16 tile
    assert abs(mem["FLUX-size", "nvfp4"]["row_layout_x_bf16"] - 0.28125) < 1e-3  # one per 1x16 row block (+ padding)
    assert mem["FLUX-size", "bf16"]["x_bf16"] == 1.0
    dig = {r["format"]: r for r in res["digits"]}
    assert dig["fp32"]["x_fp32"] == 1.0 and dig["fp32"]["velocity_err"] == 0.0
    assert dig["nvfp4"]["bytes"] < dig["fp8"]["bytes"] < dig["bf16"]["bytes"] < dig["fp32"]["bytes"]
    assert dig["nvfp4"]["quantized"] == "9/13" and all(r["forward_ms"] > 0 for r in res["digits"])
    assert json.loads((tmp_path / "quant.json").read_text()) == res
    assert not (tmp_path / "BENCHMARKS.md").exists()  # --quick never publishes
    for _ in range(2):
        bench.main(small)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.count(bench.BEGIN) == 1 and "Command: `python benchmarks/bench_quant.py --flux-dims" in md
    assert "| nvfp4 |" in md
    nv = err["FLUX-size", "nvfp4"]  # the reading is computed from the run's rows (the last run's, equal here)
    assert f"FLUX-size: NVFP4 {100 * nv['act_err']:.2f}% (activations)" in md


def test_bench_quant_gpu_mode_code_path_on_cpu(tmp_path, monkeypatch, capsys):
    """bench_quant --gpu --quick: the GPU tables' code path on the CPU with tiny shapes (timings not asserted)."""
    import torch

    bench = _load("bench_quant")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--gpu", "--json", str(tmp_path / "g.json")]) is None  # a full run needs a GPU: says so
    assert "bench_quant --gpu: no CUDA GPU on this machine" in capsys.readouterr().out
    combos = ["te:fp8", "torch:fp8", "torch:fp8_row", "torch+fast:fp8_row", "emulate:fp8_row", "emulate:nvfp4"]
    res = bench.main(["--gpu", "--quick", "--combos", *combos, "--json", str(tmp_path / "g.json")])
    gemm = {(r["backend"], r["format"]): r for r in res["gemm"]}
    assert list(gemm) == [("bf16", "bf16")] + [tuple(c.split(":")) for c in combos]
    assert gemm["te", "fp8"]["ms"] is None and "no CUDA GPU" in gemm["te", "fp8"]["note"]
    for key in [("torch", "fp8"), ("torch", "fp8_row"), ("torch+fast", "fp8_row")]:
        r = gemm[key]
        assert r["ms"] > 0 and r["err_vs_emulation"] < 0.01 and r["err_vs_fp32"] < 0.06  # BF16 outputs both sides
        assert "torch._scaled_mm on cpu" in r["note"]
    assert gemm["emulate", "nvfp4"]["err_vs_fp32"] > gemm["emulate", "fp8_row"]["err_vs_fp32"]
    tr = res["transformer"]
    if "not run: diffusers" not in tr[0]["note"]:
        assert tr[0]["backend"] == "bf16" and tr[0]["model"].startswith("SD3 tiny")
        rows = {(r["backend"], r["format"], r["min_dim"]): r for r in tr[1:]}
        assert rows["te", "fp8", 16]["ms"] is None and "no CUDA GPU" in rows["te", "fp8", 16]["note"]
        cut, every = rows["torch", "fp8_row", 16], rows["torch", "fp8_row", 0]
        n_cut, n_all = (int(r["quantized"].split("/")[0]) for r in (cut, every))
        assert 0 < n_cut < n_all  # the preset-like cut keeps the 16x16 attention projections in BF16
        assert all(r["ms"] > 0 and r["rel_err"] < 0.1 for r in (cut, every))
        assert ("torch+fast", "fp8_row", 16) not in rows  # fast accumulation: the GEMM table only
        assert rows["emulate", "nvfp4", 16]["rel_err"] > rows["emulate", "fp8_row", 16]["rel_err"]
    md = bench.gpu_tables(res)
    assert "| tiny | 64x64 | 96x64 | torch | fp8_row |" in md and "### (g2)" in md
    # a combo that fails (e.g. torch.compile on a machine without triton) is a row, not the end of the run
    def broken(*args, **kwargs):
        raise RuntimeError("no triton")

    monkeypatch.setattr(bench, "_swap", broken)
    rows = bench.gpu_gemm_rows(bench.QUICK_GEMM_SHAPES, [("torch", "fp8_row")], torch.device("cpu"), 0, 1)
    assert rows[1]["ms"] is None and rows[1]["note"] == "FAILED: RuntimeError: no triton"
    assert json.loads((tmp_path / "g.json").read_text()) == res
    assert not (tmp_path / "BENCHMARKS.md").exists()  # never published without a GPU


def test_gpu_lowprec_without_a_gpu_says_so_and_exits_0(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine that has one
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_lowprec.py"), "--quick", "--json",
                          str(tmp_path / "gpu.json")], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_lowprec: no CUDA GPU on this machine") and "nothing to time" in lines[0]
    assert not (tmp_path / "gpu.json").exists()


def test_gpu_lowprec_code_path_on_cpu(monkeypatch):
    """The whole timing/parity path on a tiny block on CPU, Transformer Engine stood in for by the emulation run
    on the BF16 block (so 'TE vs emulation' here is only BF16-vs-fp32 noise; on a GPU it is the real parity)."""
    import torch

    gpu = _load("gpu_lowprec")
    real = gpu.quantize_module
    # TE stood in for by the emulation; the torch backend runs for real (torch._scaled_mm on CPU)
    monkeypatch.setattr(gpu, "quantize_module", lambda m, fmt, skip=(), backend="auto":
                        real(m, fmt, skip, 0, "emulate" if backend == "te" else backend))
    rows = gpu.run(tokens=32, warmup=1, repeats=2, device="cpu", hidden=64, heads=4)
    assert [(r["backend"], r["format"]) for r in rows] == [("torch", "bf16"), *gpu.COMBOS]
    assert all(r["ms"] > 0 for r in rows)
    for r in rows[1:]:
        assert r["linears"] == "2/3"  # qkv_mlp and proj_out; the M=1 modulation stays BF16
        assert r["err_vs_fp32"] < 0.3 and r["cos_vs_emulate"] > 0.99
    assert rows[4]["emulate_err_vs_fp32"] > rows[1]["emulate_err_vs_fp32"]  # nvfp4 is coarser than fp8
    assert "| nvfp4 | te | 2/3 |" in gpu.table(rows) and "| fp8_row | torch | 2/3 |" in gpu.table(rows)
    # without the stand-in, TE is not run on a CPU and the row says why
    monkeypatch.setattr(gpu, "quantize_module", real)
    monkeypatch.setattr(gpu, "COMBOS", (("te", "fp8"),))
    rows = gpu.run(tokens=32, warmup=1, repeats=1, device="cpu", hidden=64, heads=4)
    assert rows[1]["ms"] is None and "no CUDA GPU" in rows[1]["note"]
    block = gpu.SingleStreamBlock(64, 4)
    assert block(torch.randn(2, 8, 64), torch.randn(2, 64)).shape == (2, 8, 64)


def test_bench_dts_rows(tmp_path):
    import torch

    bench = _load("bench_dts")
    threads = torch.get_num_threads()  # the script sets its own thread count
    try:
        rows = bench.main(["--quick", "--no-write", "--budgets", "20", "40", "--lams", "1", "--json", str(tmp_path / "d.json")])
    finally:
        torch.set_num_threads(threads)
    search = {(r["method"], r["budget"]): r for r in rows if r["section"] == "search"}
    assert {("DTS*", 20), ("DTS*", 40), ("best-of-N", 20), ("best-of-N", 160)} <= set(search)
    # both are anytime: a larger budget never finds a worse best sample (the same runs, longer prefixes)
    for m in ("DTS*", "best-of-N"):
        assert search[(m, 40)]["reward"] >= search[(m, 20)]["reward"]
    sampling = [r for r in rows if r["section"] == "sampling"]
    assert [r["method"] for r in sampling] == ["base sampler", "DTS lam=1"]
    assert sampling[0]["distinct"] == 16 and 1 <= sampling[1]["distinct"] <= 16
    assert json.loads((tmp_path / "d.json").read_text()) == rows


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_bench_branch_rows(tmp_path):
    bench = _load("bench_branch")
    rows = bench.main(["--quick", "--no-write", "--iterations", "2", "--cost-iterations", "2", "--wide-hidden", "0",
                       "--every", "1", "--methods", "flat GRPO", "BranchGRPO-Mix", "--out", str(tmp_path / "runs")])
    cost = {r["method"]: r for r in rows if r["section"] == "cost_base"}
    assert cost["flat GRPO"]["nfe_rollout"] == 1600 and cost["flat GRPO"]["ratio_to_flat"] == 1.0
    # Mix: the tree's 77 evaluations per prompt, and 32 trained SDE edges (steps 0-1 and the splits 0, 2, 4, 6)
    assert cost["BranchGRPO-Mix"]["nfe_rollout"] == 770 and cost["BranchGRPO-Mix"]["nfe_train"] == 320
    learn = {r["method"]: r for r in rows if r["section"] == "learning"}
    assert learn["BranchGRPO-Mix"]["iterations"] == 5 and learn["flat GRPO"]["iterations"] == 2


def test_video_benches_call_a_difference_only_beyond_the_seed_spread():
    bv, bbv = _load("bench_video"), _load("bench_branch_video")
    row = lambda m, s, seeds=(0, 1, 2): {"seeds": list(seeds), "iterations": 100, "motion_accuracy_final": m,  # noqa: E731
                                         "motion_accuracy_final_std": s}
    rows = {"flat GRPO": row(0.90, 0.03), "tree": row(0.50, 0.03), "close": row(0.86, 0.02), "one": row(0.5, 0.0, (0,))}
    assert "worse beyond the spread over seeds than flat GRPO's (0.500 ± 0.030 vs 0.900 ± 0.030)" in \
        bv.final_sentence("tree", "motion_accuracy", rows)
    assert "within the spread over seeds of flat GRPO's" in bv.final_sentence("close", "motion_accuracy", rows)
    assert "one seed: no claim" in bv.final_sentence("one", "motion_accuracy", rows)
    a, b = {"seeds": [0, 1, 2], "m": (0.90, 0.02)}, {"seeds": [0, 1, 2], "m": (0.50, 0.03)}
    assert bbv.verdict(a, b, "m", ("forest", "tree")).startswith("above tree beyond the seed spread")
    assert bbv.verdict(b, a, "m", ("tree", "forest")).startswith("below forest beyond")
    assert bbv.verdict({"seeds": [0, 1, 2], "m": (0.52, 0.01)}, b, "m", ("x", "tree")).startswith("within the seed spread")


def test_bench_video_methods_pass_the_config_checks_and_the_flat_variants_train_what_they_say():
    from difrl.train.check import check_config
    from difrl.train.config import load_flow_config
    from difrl.train.flow.plan import step_masks

    bv = _load("bench_video")
    assert {"flat GRPO + TempFlow", "flat GRPO, steps 0-3"} <= set(bv.METHODS)
    for name, overrides in bv.METHODS.items():  # what `difrl check` says of each, on the benchmark's config
        assert check_config(bv.CONFIG, overrides, gpus=1).problems == [], name
    flat = load_flow_config(bv.CONFIG, bv.METHODS["flat GRPO"])
    tempflow = load_flow_config(bv.CONFIG, bv.METHODS["flat GRPO + TempFlow"])
    window = load_flow_config(bv.CONFIG, bv.METHODS["flat GRPO, steps 0-3"])
    assert tempflow.rollout.kind == window.rollout.kind == "flat" and tempflow.train.step_weight == "tempflow"
    assert tempflow.steps.mode == flat.steps.mode == "all_but_last" and window.train.step_weight == "none"
    for it in (0, 1, 57, 399):  # the window does not move: SDE and trained on steps 0..3 of 8 in every iteration
        sde, trained, start = step_masks(window, it, 128)
        assert sde.nonzero().flatten().tolist() == [0, 1, 2, 3] and start == 0
        assert trained.shape == (128, 8) and bool((trained == sde).all())
        assert step_masks(tempflow, it, 128)[0].nonzero().flatten().tolist() == list(range(7))


def test_bench_video_says_when_the_load_moved_under_the_equal_wall_clock_columns():
    bv = _load("bench_video")
    steady = {"flat GRPO": {"seconds_per_iter_per_seed": [1.40, 1.45, 1.38]},
              "Sol-RL": {"seconds_per_iter_per_seed": [2.8, 2.7, 2.9]}, "one seed": {"seconds_per_iter_per_seed": [9.0]}}
    assert bv.load_sentence(steady).startswith("Load check: every method's per-seed median")
    # flat GRPO's seeds at 5.9, 5.5 and 1.8 s per iteration: the same work, so the load moved (measured on 2026-12-06)
    moved = bv.load_sentence({**steady, "flat GRPO": {"seconds_per_iter_per_seed": [5.9, 5.5, 1.8]}})
    assert moved.startswith("Load check: the machine's load changed during the run")
    assert moved.endswith("more than 1.25x apart: flat GRPO 5.90, 5.50, 1.80.")



def test_bench_video_measures_the_drift_on_two_methods_of_equal_work(tmp_path, monkeypatch):
    import functools

    bv = _load("bench_video")
    row = lambda sec, nfe: {"seconds_per_iter": sec, "nfe_per_iter": nfe}  # noqa: E731
    # flat GRPO + TempFlow does flat GRPO's work (equal NFEs): its seconds ratio is the drift between two runs
    drift = bv.drift_sentence({"flat GRPO": row(1.40, 1920), "flat GRPO + TempFlow": row(1.54, 1920)})
    assert "ran at 1.10× its seconds per iteration: on this run a seconds ratio that close to 1" in drift
    assert bv.drift_sentence({"flat GRPO": row(1.40, 1920)}) == ""  # a run without the pair says nothing
    assert bv.drift_sentence({"flat GRPO": row(1.40, 1920), "flat GRPO + TempFlow": row(1.54, 1000)}) == ""
    # the block re-rendered from the saved rows of the published run: its command and date kept, a table row per method
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    monkeypatch.setattr(bv, "republish", functools.partial(_load("common").republish, path=md))
    saved = ROOT / "benchmarks" / "results" / "bench_video.json"
    rows = bv.main(["--render-from", str(saved)])
    old = (ROOT / "BENCHMARKS.md").read_text().split(bv.BEGIN, 1)[1].split(bv.END, 1)[0]
    block = md.read_text().split(bv.BEGIN, 1)[1].split(bv.END, 1)[0]
    assert [ln for ln in block.splitlines() if ln.startswith(("Command:", "Date:"))] == \
        [ln for ln in old.splitlines() if ln.startswith(("Command:", "Date:"))]
    assert all(f"| {r['method']} | {r['seconds_per_iter']:.2f} |" in block for r in rows)
    assert ("Drift: flat GRPO + TempFlow" in block) == any(r["method"] == "flat GRPO + TempFlow" for r in rows)
    assert f"--render-from {saved.relative_to(ROOT)}" in block

@pytest.mark.slow  # flat GRPO, then the two flat variants, 2 iterations each on 4 prompts (resumed to the budget)
def test_bench_video_quick_rows_of_the_flat_variants(tmp_path):
    out = tmp_path / "runs"
    names = ["flat GRPO + TempFlow", "flat GRPO, steps 0-3"]
    rows = _quick("bench_video", ["--iterations", "2", "--every", "2", "--methods", *names, "--out", str(out)],
                  tmp_path)
    assert [r["method"] for r in rows] == ["flat GRPO", *names] and rows[0]["seconds_ratio"] == 1.0
    runs = {r["method"]: [json.loads(ln) for ln in
                          (out / r["method"].replace(" ", "_") / "seed0" / "metrics.jsonl").read_text().splitlines()]
            for r in rows}
    flat, tempflow, window = (runs[n] for n in ["flat GRPO", *names])
    # the same rollout NFEs per iteration; the window trains 4 of flat's 7 steps per sample (counts: exact)
    assert all(m["nfe_full"] == flat[0]["nfe_full"] for m in tempflow + window)
    assert all(7 * m["nfe_train"] == 4 * flat[0]["nfe_train"] and m["window_start"] == 0 for m in window)
    assert all(m["nfe_train"] == flat[0]["nfe_train"] for m in tempflow)
    # TempFlow's step weights change the loss of the same first rollout (same seed, same base: same rewards)
    assert tempflow[0]["reward_mean"] == flat[0]["reward_mean"] and tempflow[0]["loss"] != flat[0]["loss"]


def test_bench_solrl_groups_calls_a_difference_only_beyond_the_seed_spread():
    sg = _load("bench_solrl_groups")
    assert sg.verdict((0.95, 0.01), (0.90, 0.01), 3).startswith("better beyond the seed spread")
    assert sg.verdict((0.95, 0.03), (0.90, 0.03), 3).startswith("level, within the seed spread")
    assert sg.verdict((20.0, 1.0), (25.0, 1.0), 3, lower_is_better=True).startswith("better")  # FD: lower is better
    assert sg.verdict((0.95, 0.0), (0.90, 0.0), 1).endswith("(one seed: no claim)")


def test_bench_solrl_closing_sentences_say_what_each_row_isolates():
    b = _load("bench_solrl")

    def row(name, acc, fd, nfe=(1.6e5, 0.0), seeds=(0, 1, 2)):  # a learning row as learning_rows writes it
        config, overrides = b.METHODS[name]
        iters = 300 if name == "plain GRPO" else 150
        return {"section": "learning", "method": name, "config": config, "seeds": list(seeds), "reached": "3/3",
                "overrides": [*overrides, f"train.iterations={iters}", "eval.every=10", "stop.fd_rise=null"],
                "accuracy_mean": acc[0], "accuracy_std": acc[1], "fd_mean": fd[0], "fd_std": fd[1],
                "nfe_full_to_target": nfe[0], "nfe_full_to_target_std": 1.6e4, "nfe_lowprec_to_target": nfe[1]}

    rows = [row("plain GRPO", (0.984, 0.002), (27.3, 1.8), (4.8e5, 0.0)), row("DiffusionNFT", (0.987, 0.002), (18.4, 1.2)),
            row("naive NVFP4", (0.95, 0.002), (18.7, 1.5), (0.0, 1.55e5)),
            row("Sol-RL", (0.987, 0.002), (16.1, 1.1), (1.71e5, 4.1e5))]
    lines = b.cost_reading(rows, 0.25)
    by = {ln.split(":")[0]: ln for ln in lines if ln.startswith("- ") and "isolate" in ln}
    # naive NVFP4 changes one key: its pair isolates it; its accuracy here is set 0.037 lower (beyond 0.002 + 0.002)
    assert by["- naive NVFP4"].startswith("- naive NVFP4: only rollout.precision nvfp4 vs fp32: the pair isolates "
                                          "rollout.precision; final accuracy 0.95 ± 0.002 vs 0.987 ± 0.002, worse beyond")
    assert "final FD 18.7 ± 1.5 vs 18.4 ± 1.2, within the spread" in by["- naive NVFP4"]
    # Sol-RL changes the rollout (the pool and its selection) and the pull toward the base together
    assert by["- Sol-RL"].startswith("- Sol-RL: 3 keys (rollout.kind solrl vs flat, rollout.precision nvfp4 vs fp32, "
                                     "nft.ref_beta 0.3 vs 0.1): the pair does not isolate any one of them")
    assert "final FD 16.1 ± 1.1 vs 18.4 ± 1.2, within the spread" in by["- Sol-RL"]
    # NFEs to the target: 1.1e4 apart, within the two spreads of 1.6e4 (one evaluation of 10 iterations each)
    assert "full-precision NFEs to the target 1.71e+05 ± 1.6e+04 vs 1.6e+05 ± 1.6e+04 (within the spread)" in by["- Sol-RL"]
    assert "train.objective grpo vs nft" in by["- plain GRPO"] and "train.iterations 300 vs 150" in by["- plain GRPO"]
    assert "does not isolate" in by["- plain GRPO"]
    assert "the bench_solrl_groups block (benchmarks/bench_solrl_groups.py)" in lines[-1]
    sol = rows[3]  # the figures the sentences derive are stored in the row, for the JSON (scripts/check_claims.py)
    assert sol["config_differences"]["nft.ref_beta"] == [0.3, 0.1] and sol["config_differences_count"] == 3
    assert sol["fp4_cost"] == 0.25 and sol["total_cost_to_target"] == 1.71e5 + 0.25 * 4.1e5  # the same float ops
    one = b.cost_reading([row("DiffusionNFT", (0.9, 0.0), (18.0, 0.0), seeds=(0,)),
                          row("naive NVFP4", (0.5, 0.0), (18.0, 0.0), seeds=(0,))], 0.25)
    assert one[-1].endswith("final FD 18 ± 0 vs 18 ± 0 (one seed: no claim).")


def test_bench_eb_rows(tmp_path):
    import torch

    from difrl.worlds import sudoku

    bench = _load("bench_eb")
    threads = torch.get_num_threads()  # the script sets its own thread count
    try:
        rows = bench.main(["--model", str(sudoku.BUNDLED_BASE), "--no-write", "--count", "24", "--blanks", "4", "6",
                           "--temperatures", "0", "1", "--seeds", "0", "1", "--gammas", "0.1", "3", "--orders", "entropy",
                           "margin", "--llada-k", "2", "--json", str(tmp_path / "eb.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "eb.json").read_text()) == rows
    first = [r for r in rows if r["section"] == "first_pass"]
    rows = [r for r in rows if r["section"] == "sweep"]
    for blanks in (4, 6):  # the first-pass entropy bins cover every blank
        # float64 sum of count fractions
        assert abs(sum(r["fraction"] for r in first if r["blanks"] == blanks) - 1.0) < 1e-6
    keys = {"blanks", "temperature", "method", "sampler", "gamma", "order", "steps", "seeds", "nfe", "nfe_ratio", "cell_accuracy",
            "cell_accuracy_std", "solve_rate", "solve_rate_std", "cell_loss_points", "solve_loss_points", "tokens_per_pass",
            "first_pass_tokens", "meets_goal", "llada_cells_at_nfe"}
    assert all(keys <= set(r) for r in rows)
    for blanks in (4, 6):
        for temp in (0.0, 1.0):
            g = {r["method"]: r for r in rows if r["blanks"] == blanks and r["temperature"] == temp}
            assert list(g)[:2] == ["LLaDA 1/step", "EB g=0"] and len(g) == 2 + 2 * 2 + 1
            base = g["LLaDA 1/step"]
            # one token per forward: NFE = blanks for both one-token decoders, every puzzle
            assert base["nfe"] == g["EB g=0"]["nfe"] == blanks and base["nfe_ratio"] == 1.0 and base["cell_loss_points"] == 0.0
            assert g["EB g=0"]["max_pass_tokens"] == 1 and g["EB g=0"]["first_pass_tokens"] == 1.0
            assert g[f"LLaDA {blanks // 2} steps"]["nfe"] == blanks // 2
            assert 1 <= g["EB g=3"]["nfe"] <= g["EB g=0.1"]["nfe"] <= blanks  # a larger bound, fewer passes
            assert len(base["seeds"]) == (1 if temp == 0 else 2)
    # the evaluation loop is evaluate_sudoku's: the same numbers at its default seed
    policy = sudoku.load_base()
    mine = bench.evaluate(policy, 6, 24, "llada", sudoku.EVAL_SEED, steps=sudoku.CELLS, temperature=1.0)
    ref, _ = sudoku.evaluate_sudoku(policy, 6, 24, temperature=1.0)
    assert (mine["cell_accuracy"], mine["solve_rate"], mine["nfe"]) == (ref["cell_accuracy"], ref["solve_rate"], ref["nfe"])


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_bench_masked_rows(tmp_path):
    import torch

    bench = _load("bench_masked")
    threads = torch.get_num_threads()  # the runs set their own thread count
    try:
        # 4 iterations evaluated every 2 (--quick's 6 every 3, scaled): still evaluations before, inside and at the end
        # of every run, so the budgets' cells and the final one are read as with 6
        rows = bench.main(["--quick", "--no-write", "--parts", "sudoku,erils", "--runs", str(tmp_path / "runs"),
                           "--iterations", "4", "--every", "2", "--json", str(tmp_path / "m.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "m.json").read_text()) == rows
    est = {r["method"]: r for r in rows if r["part"] == "sudoku"}
    assert list(est) == ["MaskGRPO", "d1", "UniGRPO", "coupled-GRPO"]
    erils = {r["method"]: r for r in rows if r["part"] == "erils"}
    assert list(erils) == list(bench.ERILS)
    for r in rows:
        budgets = r["budgets_s"]
        assert len(budgets) == 3 and budgets == sorted(budgets) and r["s_per_iter"] > 0
        # the last budget is the slowest run's whole length: every method's value there is its final evaluation
        assert r[f"cell_accuracy@{budgets[-1]:.0f}s"] == pytest.approx(r["cell_accuracy_final"], abs=1e-12)
    # every method starts from the same base; the weaker base of the ERILS part is weaker
    assert len({r["cell_accuracy_before"] for r in est.values()}) == 1
    assert len({r["cell_accuracy_before"] for r in erils.values()}) == 1
    assert erils["on-policy only"]["cell_accuracy_before"] < est["MaskGRPO"]["cell_accuracy_before"]


@pytest.mark.slow  # end to end, several seconds: left out by `make test-fast`
def test_bench_eb_digit_tokens_rows(tmp_path):
    import torch

    from difrl.worlds import digit_tokens

    bench = _load("bench_eb")
    threads = torch.get_num_threads()
    try:
        rows = bench.main(["--world", "digit_tokens", "--quick", "--no-write", "--model", str(digit_tokens.BUNDLED_BASE),
                           "--gammas", "0.5", "30", "--json", str(tmp_path / "d.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "d.json").read_text()) == rows
    g = {r["method"]: r for r in rows}
    assert list(g)[:2] == ["LLaDA 1/step", "EB g=0"]
    assert g["LLaDA 1/step"]["nfe"] == g["EB g=0"]["nfe"] == 64 and g["LLaDA 1/step"]["nfe_ratio"] == 1.0
    assert g["EB g=30"]["nfe"] < g["EB g=0.5"]["nfe"] <= 64 and g["LLaDA 8 steps"]["nfe"] == 8
    # the world's own evaluation row is evaluate_digit_tokens at its defaults: recomputed, the same numbers
    from difrl.worlds.digits import DigitsWorld

    own = g["emerge 16 steps (the world's eval)"]
    ref = [digit_tokens.evaluate_digit_tokens(digit_tokens.load_base(), DigitsWorld.load(), own["samples"] // 10, seed=s,
                                              temperature=own["temperature"])[0] for s in own["seeds"]]
    for k in ("accuracy", "fd", "nfe"):
        assert own[k] == pytest.approx(sum(m[k] for m in ref) / len(ref), rel=1e-6), k  # fd: the bench's thread count
    assert len({r["accuracy"] for r in rows}) > 1  # the decoders differ
    assert all(r["meets_goal"] == (r["sampler"] == "eb" and r["nfe_ratio"] >= 3 and r["accuracy_loss_points"] <= 1) for r in rows)


def test_bench_eb_compares_each_eb_row_with_the_strongest_decoder_at_no_more_nfe():
    bench = _load("bench_eb")
    row = lambda m, s, nfe, acc, sd: {"method": m, "sampler": s, "nfe": nfe, "accuracy": acc, "accuracy_std": sd}
    rows = [row("LLaDA 1/step", "llada", 64, 0.82, 0.005), row("EB g=3", "eb", 19.8, 0.83, 0.014),
            row("EB g=30", "eb", 3.0, 0.95, 0.006), row("EB g=10", "eb", 7.8, 0.876, 0.009),
            row("emerge 16", "emerge", 16, 0.953, 0.006), row("LLaDA 8", "llada", 8, 0.853, 0.005)]
    lines = bench.strongest_comparison(rows)
    # EB g=3 spends 19.8: the best non-EB decoder within that is emerge 16 (0.953) -> worse by 12.3 points
    assert "EB g=3 (19.8 NFE, accuracy 0.830) is worse than emerge 16 (16.0 NFE, 0.953): -12.3 points" in lines[1]
    assert "EB g=30 (3.0 NFE): no other decoder spends this little." in lines[2]
    assert "EB g=10 (7.8 NFE): no other decoder" in lines[3]
    rows[3]["nfe"] = 8.0  # now LLaDA 8 (0.853 +- 0.005) is within budget: +2.3 points > spread 1.4 -> better
    assert "EB g=10 (8.0 NFE, accuracy 0.876) is better than LLaDA 8 (8.0 NFE, 0.853): +2.3 points, spread 1.4." in \
        bench.strongest_comparison(rows)[3]


@pytest.mark.slow  # the whole GPU benchmark at tiny dimensions on the CPU: about a minute
def test_bench_gpu_quick_rows(tmp_path):
    import torch
    from diffusers import SD3Transformer2DModel

    from difrl.branching import BranchSchedule, nfe, num_trained_edges

    bench = _load("bench_gpu")
    published = (ROOT / "BENCHMARKS.md").read_text()
    rows = bench.main(["--quick", "--json", str(tmp_path / "gpu.json")])
    assert json.loads((tmp_path / "gpu.json").read_text()) == rows
    assert (ROOT / "BENCHMARKS.md").read_text() == published  # --quick never publishes
    meta = rows[0]
    assert meta["transformer_params"] == sum(p.numel() for p in SD3Transformer2DModel(**bench.SHAPE["quick"]).parameters())
    assert meta["flops_per_transition"] > 0
    pipe = [r for r in rows if r["stage"] == "rollout_vs_pipe"]
    assert len(pipe) == 4 and pipe[0]["x_pipe"] == 1.0 and all("x_pipe" in r for r in pipe)
    t = {r["method"]: r for r in rows if r["stage"] == "trainer"}
    assert list(t) == [m for m in bench.methods("quick")]
    assert all("error" not in r for r in t.values()), t
    # 1 prompt x 4 leaves, 6 steps (the last one ODE): counts from the tree structure, not from the run
    sched, all_sde = BranchSchedule((0, 2)), torch.tensor([True] * 5 + [False])
    window = torch.tensor([True, True, False, False, False, False])  # Mix: SDE in steps 0-1 (and the splits)
    assert t["flat GRPO"]["nfe_rollout"] == 4 * 6 and t["flat GRPO"]["transitions_trained"] == 4 * 5
    assert t["BranchGRPO"]["nfe_rollout"] == nfe(sched, 6, trees=1)
    assert t["BranchGRPO"]["transitions_trained"] == num_trained_edges(sched, 6, all_sde)
    assert t["BranchGRPO-Mix"]["transitions_trained"] == num_trained_edges(sched, 6, window)
    assert t["BranchGRPO + width/depth pruning"]["transitions_trained"] < t["BranchGRPO"]["transitions_trained"]
    assert t["Sol-RL (fp8_row candidates)"]["nfe_lowprec"] == 8 * 3  # 8 candidates x 3 preview steps
    assert t["flat GRPO"]["x_flat"] == 1.0 and all("x_flat" in r for r in t.values())
    for r in t.values():
        assert r["update_tflops"] == pytest.approx(meta["flops_per_transition"] * r["transitions_trained"]
                                                   / r["seconds_update"] / 1e12, rel=1e-9)  # float64, another order


def test_bench_gpu_ratios_are_to_the_baselines_of_the_same_run():
    bench = _load("bench_gpu")
    rows = bench.add_ratios([{"stage": "meta"},
                             {"stage": "rollout_vs_pipe", "method": "pipe(output_type='latent')", "seconds": 2.0},
                             {"stage": "rollout_vs_pipe", "method": "rollout() ode", "seconds": 2.5},
                             {"stage": "trainer", "method": "flat GRPO", "seconds_iter": 8.0},
                             {"stage": "trainer", "method": "BranchGRPO", "seconds_iter": 2.0},
                             {"stage": "trainer", "method": "Sol-RL (fp8_row candidates)", "error": "stage ran past 90 s"}])
    assert [r.get("x_pipe") for r in rows[1:3]] == [1.0, 1.25]
    assert [r.get("x_flat") for r in rows[3:]] == [1.0, 0.25, None]
    assert rows[0]["no_ratio"] == {}
    # no baseline, no ratio, and the meta row says why (computed again after every stage: no stale ratio stays)
    rows = bench.add_ratios([rows[0], rows[2], {"stage": "trainer", "method": "flat GRPO", "status": "FAILED",
                                                "error": "OutOfMemoryError: CUDA out of memory"}, rows[4]])
    assert "x_pipe" not in rows[1] and "x_flat" not in rows[3]
    assert rows[0]["no_ratio"] == {"x_pipe": "No x_pipe ratios: the pipe(output_type='latent') baseline was not "
                                             "measured in this run",
                                   "x_flat": "No x_flat ratios: the flat GRPO baseline FAILED (OutOfMemoryError: "
                                             "CUDA out of memory)"}


def test_bench_gpu_readings_are_computed_from_the_rows():
    bench = _load("bench_gpu")
    rows = [{"stage": "meta", "dtype": "bf16"},
            {"stage": "rollout_vs_pipe", "method": "rollout() flow_sde, 15 transitions stored (the trainer's)", "x_pipe": 1.02},
            {"stage": "trainer", "method": "flat GRPO", "seconds_iter": 10.0, "x_flat": 1.0, "rollout_s_per_forward": 0.01,
             "peak_gib": 20.0},
            {"stage": "trainer", "method": "BranchGRPO", "seconds_iter": 5.0, "x_flat": 0.5},
            {"stage": "trainer", "method": "BranchGRPO-Mix", "seconds_iter": 2.0, "x_flat": 0.2},
            {"stage": "trainer", "method": "Sol-RL (fp8_row candidates)", "candidate_s_per_forward": 0.006},
            {"stage": "trainer", "method": "flat GRPO + gradient checkpointing", "seconds_iter": 13.0, "peak_gib": 12.5,
             "seconds_first_iter": 14.0}]
    text = "\n".join(bench.readings(rows))
    assert "1.020x pipe() on the same pipeline (target <= 1.03: met)" in text
    assert "BranchGRPO: 0.50x flat GRPO's" in text and "(target <= 0.45: missed)" in text
    assert "BranchGRPO-Mix: 0.20x" in text and "(target <= 0.25: met)" in text
    assert "fp8_row candidate stage cost 0.60x a bf16 rollout per forward (target <= 0.75: met)" in text
    assert "gradient checkpointing: 1.30x the" in text and "peak memory 12.5 vs 20.0 GiB" in text
    assert "pruning" not in text  # no row, no sentence
    # a failed flat GRPO claims nothing and is no baseline; a stage not reached yet is named in the block
    rows[2] = {"stage": "trainer", "method": "flat GRPO", "status": "FAILED", "error": "a | b"}
    assert "x flat GRPO's" not in "\n".join(bench.readings(rows))
    rows[0].update(device="cpu", torch="2", diffusers="0", date="d", steps=16, prompts=2, leaves=16,
                   stages=["flat GRPO", "BranchGRPO", "BranchGRPO-Mix"], finished=["flat GRPO"])
    block = "\n".join(bench.report(rows))
    assert "| flat GRPO | FAILED: a / b |" in block and "1 stage(s) did not finish" in block
    assert ("Not reached when this block was written (the run was still going or was cut off): BranchGRPO, "
            "BranchGRPO-Mix.") in block


@pytest.mark.slow  # the GPU benchmark at tiny dimensions on the CPU with two stages made to fail: under a minute
def test_bench_gpu_quick_goes_on_after_a_failing_stage(tmp_path, monkeypatch):
    """A forced error in the second stage (flat GRPO, the x_flat baseline) and a forced timeout in a later one (its
    alarm firing inside the trainer): every stage still has its row, and the JSON was rewritten after each stage."""
    bench = _load("bench_gpu")
    md, out = (ROOT / "BENCHMARKS.md").read_text(), tmp_path / "gpu.json"
    written = []
    publish = bench.publish

    def spy(args, *a, **k):  # the JSON as it stood after each write
        publish(args, *a, **k)
        written.append(json.loads(out.read_text()))

    monkeypatch.setattr(bench, "publish", spy)
    rows = bench.main(["--quick", "--fail-stage", "flat GRPO", "--fail-stage", "BranchGRPO-Mix:timeout",
                       "--json", str(out)])
    assert json.loads(out.read_text()) == rows and (ROOT / "BENCHMARKS.md").read_text() == md  # --quick: the JSON only
    meta, stages = rows[0], rows[0]["stages"]
    assert stages[1] == "flat GRPO" and meta["finished"] == stages
    assert [w[0]["finished"] for w in written] == [stages[:i] for i in range(1, len(stages) + 1)] + [stages]
    pipe = [r for r in rows if r["stage"] == "rollout_vs_pipe"]
    assert len(pipe) == 4 and pipe[0]["x_pipe"] == 1.0 and all("x_pipe" in r and "error" not in r for r in pipe)
    t = {r["method"]: r for r in rows if r["stage"] == "trainer"}
    assert list(t) == stages[1:]  # one row per trainer stage, in order, the failed ones included
    flat, mix = t.pop("flat GRPO"), t.pop("BranchGRPO-Mix")
    assert flat["status"] == "FAILED" and flat["error_type"] == "RuntimeError" and not flat["timed_out"]
    assert flat["error"] == "RuntimeError: forced failure of 'flat GRPO' (--fail-stage)"
    assert mix["status"] == "FAILED" and mix["timed_out"] and "seconds_iter" not in mix
    assert mix["error"].startswith("timed out: the stage budget of 0.05 s ran out (StageTimeout")
    assert all("error" not in r and "seconds_iter" in r and "x_flat" not in r for r in t.values()), t
    assert list(meta["no_ratio"]) == ["x_flat"]
    assert "flat GRPO baseline FAILED (RuntimeError" in meta["no_ratio"]["x_flat"]
    block = "\n".join(bench.report(rows))
    assert "| flat GRPO | FAILED: RuntimeError: forced failure of 'flat GRPO' (--fail-stage) |" in block
    assert "2 stage(s) did not finish" in block and "No x_flat ratios: the flat GRPO baseline FAILED" in block
    assert "x flat GRPO's seconds" not in block and "Not reached" not in block  # no claim without its baseline


def test_bench_gpu_recognises_its_timeout_through_wrappers(tmp_path):
    """The stage's StageTimeout is found through the exception chain (torch.compile's BackendCompilerFailed raised
    `from None` keeps it as __context__); difrl's reward stage drops it from the chain, so there the alarm's own flag
    says it fired. Anything else keeps its type and one line of its message."""
    import torch
    from torch._dynamo.exc import BackendCompilerFailed

    from difrl.rewards import RewardError, score_all
    from difrl.train.reward_stage import score_rewards

    bench = _load("bench_gpu")

    def raised(fn):
        try:
            fn()
        except Exception as e:
            return e

    def in_compile():
        try:
            raise bench.StageTimeout("the stage budget of 90 s ran out")
        except bench.StageTimeout as e:  # as torch/_dynamo/output_graph.py wraps a backend's exception
            raise BackendCompilerFailed(lambda gm, inputs: gm, e, None) from None

    def twice_wrapped():
        try:
            in_compile()
        except BackendCompilerFailed as e:
            raise RuntimeError("compiling the block failed") from e

    for exc in (raised(in_compile), raised(twice_wrapped)):
        assert bench.timeout_in_chain(exc) is not None
        row = bench.failure_row("trainer", "flat GRPO + compile", exc, 90)
        assert row == {"stage": "trainer", "method": "flat GRPO + compile", "status": "FAILED", "timed_out": True,
                       "error_type": type(exc).__name__, "error": "timed out: the stage budget of 90 s ran out "
                                                                  f"(StageTimeout, surfaced as {type(exc).__name__})"}

    def slow(images, prompts, metadata):
        raise bench.StageTimeout("the stage budget of 55 s ran out")

    exc = raised(lambda: score_rewards(lambda: score_all({"slow": slow}, torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}],
                                                         torch.arange(2), torch.arange(2)),
                                       2, "stop", lambda: None, "iteration 1", tmp_path))
    # the reward layer keeps the reward's own exception as the cause, so the timeout is found through it
    assert isinstance(exc, RewardError) and "raised StageTimeout" in str(exc)
    assert isinstance(bench.timeout_in_chain(exc), bench.StageTimeout)
    for fired in (False, True):
        assert bench.failure_row("trainer", "flat GRPO", exc, 55, fired=fired)["error"] == (
            "timed out: the stage budget of 55 s ran out (StageTimeout, surfaced as RewardError)")

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n  GPU 0 has 1.5 GiB free. "
                                      + "x" * 300)
    row = bench.failure_row("trainer", "flat GRPO", oom, 55)
    assert not row["timed_out"] and row["error_type"] == "OutOfMemoryError" and len(row["error"]) == 240
    assert row["error"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.5")


def test_bench_gpu_run_stage_records_failures_and_goes_on():
    """run_stage on given stage functions: an error, a timeout the stage swallowed (its rows are dropped: not measured
    within the budget), a stage with no time left before the limit; the alarm handler is put back each time."""
    import signal
    import time

    bench = _load("bench_gpu")
    before, rows, far = signal.getsignal(signal.SIGALRM), [], time.monotonic() + 100

    def config_error(out):
        raise ValueError("config key 'train.micro_batch': must be positive")

    def swallows(out):
        try:
            time.sleep(2)
        except bench.StageTimeout:
            pass
        out.append({"stage": "trainer", "method": "swallows", "seconds_iter": 2.0})

    def fine(out):
        out.append({"stage": "trainer", "method": "fine", "seconds_iter": 1.0})

    bench.run_stage(rows, "trainer", "config", config_error, 30, far, "cpu")
    bench.run_stage(rows, "trainer", "swallows", swallows, 0.1, far, "cpu")
    bench.run_stage(rows, "trainer", "fine", fine, 30, far, "cpu")
    bench.run_stage(rows, "trainer", "late", fine, 30, time.monotonic() + 1, "cpu")
    assert [(r["method"], r.get("status"), r.get("timed_out")) for r in rows] == [
        ("config", "FAILED", False), ("swallows", "FAILED", True), ("fine", None, None), ("late", "SKIPPED", None)]
    assert rows[0]["error"] == "ValueError: config key 'train.micro_batch': must be positive"
    assert rows[1]["error"] == "timed out: the stage budget of 0.1 s ran out (StageTimeout)"
    assert rows[3]["error"].startswith("not started: ") and rows[3]["error"].endswith("s left before the time limit")
    assert signal.getsignal(signal.SIGALRM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_bench_gpu_budget_fits_gpu_checks_time_limit():
    """gpu_check.sh runs bench_gpu.py under `timeout $LIMIT` and passes the same LIMIT; every stage has a budget and
    start-up + stages fit under it with the end's reserve; the device machine's command limit is 600 s."""
    import re

    bench = _load("bench_gpu")
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limit = int(re.search(r"^LIMIT=(\d+)$", script, re.M).group(1))
    assert limit == bench.TIME_LIMIT_S and limit + 30 <= 600
    assert 'timeout "$LIMIT" python3' in script and 'extra=(--time-limit "$LIMIT")' in script
    for size in ("full", "quick"):
        stages = [bench.ROLLOUT_STAGE, *bench.methods(size)]
        assert list(bench.BUDGET_S[size]) == ["start-up", *stages]
        assert sum(bench.stage_budgets(size, stages).values()) <= limit - bench.END_RESERVE_S
    full = bench.stage_budgets("full", [bench.ROLLOUT_STAGE, *bench.methods("full")])
    assert bench.budget_line(full, limit) == ("time budget: start-up 45 s + 8 stages (45 + 55 + 35 + 35 + 35 + 90 + 50 + "
                                              "90 = 435 s) = 480 s, within the 540 s time limit (60 s to spare, 15 s "
                                              "of it for the end)")
    assert "OVER the 540 s" in bench.budget_line(bench.stage_budgets("full", list(full)[1:], every=120), limit)


# ---- smoke tests of the --quick runs: the rows' values, not only that they ran ---------------------------------

def _quick(name: str, argv: list[str], tmp_path) -> list[dict]:
    """`benchmarks/<name>.py --quick ... --json` in this process; the rows it returns equal its JSON and
    BENCHMARKS.md is left alone. torch's thread count is restored (the scripts set their own)."""
    import torch

    bench = _load(name)
    md = (ROOT / "BENCHMARKS.md").read_text()
    threads = torch.get_num_threads()
    try:
        rows = bench.main(["--quick", *argv, "--json", str(tmp_path / f"{name}.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads(json.dumps(rows))
    assert (ROOT / "BENCHMARKS.md").read_text() == md  # --quick never publishes
    return rows


@pytest.mark.slow  # one server process, 24 clients, 2 rewards x 5 encodings (~2 min on 2 cores)
def test_bench_reward_server_quick_rows(tmp_path):
    rows = _quick("bench_reward_server", [], tmp_path)
    rtt = rows[0]
    assert rtt["part"] == "RTT" and rtt["samples"] == 10
    a = {r["encoding"]: r for r in rows if r["part"] == "A"}
    assert set(a) == {"raw", "raw32", "png", "jpeg", "all"} and a["all"]["clients"] == 24
    for enc, r in a.items():  # every request answered once, every item back once, every score = the in-process one
        assert r["answered"] == r["requests"] == r["http_attempts"] - r["busy_503"], enc
        assert r["items_answered"] == r["items"] == r["requests"] * 2, enc
        assert r["items_lost"] == r["items_duplicated"] == r["items_foreign"] == r["item_errors"] == 0, enc
        # the server scores the same decoded images in other batches than the in-process call: fp32 reordering
        assert r["scores_mismatched"] == 0 and r["max_abs_diff"] <= 1e-5 and r["problems"] == [], enc
    assert sum(a[e]["requests"] for e in ("raw", "raw32", "png", "jpeg")) == a["all"]["requests"] == 48
    b = [r for r in rows if r["part"] == "B"]
    assert {(r["reward"], r["encoding"], r["clients"]) for r in b} == {
        (rw, enc, c) for rw in ("clip_score", "brightness")
        for enc, c in (("in-process", 1), ("raw", 4), ("raw32", 4), ("png", 4), ("jpeg", 4), ("raw", 1))}
    for r in b:
        assert r["scores_mismatched"] == 0 and r["repeats"] == 2 and r["latency_samples"] == 16, r
        if r["encoding"] == "in-process":
            assert r["ratio_mean"] == r["ratio_min"] == r["ratio_max"] == 1.0 and r["bytes_per_image"] is None
        else:  # 512 x 512 x 3 pixels: 1 byte each with raw, 4 with raw32, plus a few hundred bytes of msgpack
            per_pixel = {"raw": 1, "raw32": 4}.get(r["encoding"])
            if per_pixel:
                assert 0 < r["bytes_per_image"] - per_pixel * 512 * 512 * 3 < 512, r
            assert r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"]
    png = next(r for r in b if r["encoding"] == "png")
    jpeg = next(r for r in b if r["encoding"] == "jpeg")
    assert jpeg["bytes_per_image"] < png["bytes_per_image"] < 512 * 512 * 3  # both compress these smooth images


@pytest.mark.slow  # every built-in reward's throughput, then 1 seed x 2 digits iterations serial and overlapped
def test_bench_rewards_quick_rows(tmp_path):
    # 2 iterations: the first (warm-up) and one timed, enough for a ratio per seed and for the two modes' metrics to
    # be compared at every iteration; one torch thread, as each pytest worker runs (two would only fight the other)
    rows = _quick("bench_rewards", ["--repeats", "1", "--seeds", "1", "--iterations", "2", "--threads", "1"], tmp_path)
    tp = {r["reward"].split(" ")[0]: r for r in rows if r["part"] == "throughput"}
    assert set(tp) == {"clip_score", "pickscore", "aesthetic", "hpsv2", "ocr", "jpeg_compressibility", "geneval",
                       "digit_prob", "video"}
    for name, r in tp.items():
        assert r["samples_per_s"] > 0 and r["one_at_a_time_per_s"] > 0, name
        # the speed-up is the ratio of the two rates, which the row rounds to 0.1
        sps, one = r["samples_per_s"], r["one_at_a_time_per_s"]
        assert (sps - 0.05) / (one + 0.05) - 0.005 <= r["batched_speedup"] <= (sps + 0.05) / max(one - 0.05, 1e-9) + 0.005
    assert tp["clip_score"]["batch"] == 16 and tp["ocr"]["batch"] == 4 and tp["video"]["batch"] == 2
    ov = [r for r in rows if r["part"] == "overlap"]
    assert ov and all(r["metrics_identical"] is True for r in ov)  # overlapped scoring changes no number
    for r in ov:
        assert r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"]


def _solrl_learning_rows(rows: list[dict], out, iterations: int) -> dict[str, dict]:
    """bench_solrl's learning rows by method, each checked against its run's own files (one seed)."""
    learn = {r["method"]: r for r in rows if r["section"] == "learning"}
    for name, r in learn.items():
        run = out / name.replace(" ", "_") / "seed0"
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        assert r["iterations"] == iterations and r["seeds"] == [0] and r["accuracy_std"] == 0.0
        assert r["accuracy_mean"] == summary["eval_after"]["accuracy"] and r["fd_mean"] == summary["eval_after"]["fd"]
        assert r["nfe_full"] == sum(m["nfe_full"] for m in metrics)
        assert r["nfe_lowprec"] == sum(m["nfe_lowprec"] for m in metrics)
    return learn


@pytest.mark.slow  # NVFP4 rank agreement on 2 prompts, then 2 methods x 2 iterations (~1 min)
def test_bench_solrl_quick_rows(tmp_path):
    out = tmp_path / "runs"
    rows = _quick("bench_solrl", ["--no-write", "--formats", "nvfp4", "--prompts", "2", "--pool", "6",
                                  "--grpo-iterations", "2", "--nft-iterations", "2", "--every", "1",
                                  "--methods", "plain GRPO", "Sol-RL", "--out", str(out),
                                  "--threads", "1"], tmp_path)  # one torch thread, as each pytest worker runs
    agree = {(r["format"], r["steps"]): r for r in rows if r["section"] == "agreement"}
    assert set(agree) == {("fp32", 6), ("nvfp4", 6), ("nvfp4", 10)}
    for r in agree.values():
        assert r["prompts"] == 2 and r["seeds_per_prompt"] == 6 and -1 <= r["spearman_min"] <= r["spearman_median"] <= 1
        assert r["reward_mae"] > 0  # fewer steps or NVFP4 weights move the rewards
    learn = _solrl_learning_rows(rows, out, 2)
    assert set(learn) == {"plain GRPO", "Sol-RL"}
    assert all(r["nfe_full"] > 0 for r in learn.values())
    assert learn["plain GRPO"]["nfe_lowprec"] == 0 and learn["Sol-RL"]["nfe_lowprec"] > 0
    assert learn["plain GRPO"]["target_accuracy"] == learn["plain GRPO"]["accuracy_mean"]
    assert learn["plain GRPO"]["nfe_full_to_target_ratio"] == 1.0  # the baseline reaches itself at its own budget


@pytest.mark.slow  # NVFP4 rank agreement on 2 prompts, then DiffusionNFT and naive NVFP4 for 1 iteration each
def test_bench_solrl_quick_rows_of_the_diffusionnft_methods(tmp_path):
    # the methods that train configs/digits.yaml with DiffusionNFT's 6 sigmas: with its micro-batch counted in
    # transitions (144 = 16 samples x 9 steps) they stopped with a traceback (issue 39); micro_batch=auto fits them
    out = tmp_path / "runs"
    rows = _quick("bench_solrl", ["--no-write", "--formats", "nvfp4", "--prompts", "2", "--pool", "4",
                                  "--nft-iterations", "1", "--every", "1", "--methods", "DiffusionNFT", "naive NVFP4",
                                  "--out", str(out), "--threads", "1"], tmp_path)  # as each pytest worker runs
    learn = _solrl_learning_rows(rows, out, 1)
    assert set(learn) == {"DiffusionNFT", "naive NVFP4"}
    for name in learn:  # 160 samples trained in the 2 updates of configs/digits.yaml, NFT's loss logged
        first = json.loads((out / name.replace(" ", "_") / "seed0" / "metrics.jsonl").read_text().splitlines()[0])
        assert first["trained_samples"] == 160 and first["nft_loss_pos"] is not None
    assert learn["DiffusionNFT"]["nfe_lowprec"] == 0 < learn["DiffusionNFT"]["nfe_full"]
    assert learn["naive NVFP4"]["nfe_full"] == 0 < learn["naive NVFP4"]["nfe_lowprec"]  # trained on the copy's samples
    assert learn["DiffusionNFT"]["target_accuracy"] is None  # no plain GRPO run: no target
    for name in learn:  # --threads (default 1) reaches the training runs, not only the rank-agreement section
        assert "threads: 1\n" in (out / name.replace(" ", "_") / "seed0" / "config.yaml").read_text()
    # the closing sentences read the runs' own configs: the two rows differ in the rollout's format alone
    assert any(ln.startswith("- naive NVFP4: only rollout.precision nvfp4 vs fp32") for ln in _load("bench_solrl").cost_reading(rows, 0.25))


@pytest.mark.slow  # 2 methods x 2 digits iterations under an NVFP4 rollout mismatch (~1 min)
def test_bench_correct_quick_rows(tmp_path):
    out = tmp_path / "runs"
    methods = ["on-policy fp32 (no mismatch)", "token TIS (cap 2)"]
    # 2 iterations (evaluated after the last, as 3 with --every 3 were): the NVFP4 copy made at iteration 0 differs
    # from the trained policy in both, so the corrector's diagnostics exist; one torch thread, as each pytest worker runs
    rows = _quick("bench_correct", ["--no-write", "--iterations", "2", "--every", "2", "--scenarios", "mean",
                                    "--methods", *methods, "--out", str(out), "--threads", "1"], tmp_path)
    assert [r["method"] for r in rows] == methods and all(r["iterations"] == 2 and r["seeds"] == [0] for r in rows)
    on, tis = rows
    assert on["mismatch"] == "none" and tis["mismatch"] == "rollout.precision=nvfp4 rollout.sync_every=4"
    for r, d in ((on, "on-policy_fp32"), (tis, "token_TIS")):  # the row's numbers are the run's own files
        run = out / "mean" / d / "seed0"
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        assert r["accuracy_mean"] == summary["eval_after"]["accuracy"] and r["accuracy_std"] == 0.0
        assert r["fd_mean"] == summary["eval_after"]["fd"] and r["per_seed"][0]["accuracy"] == r["accuracy_mean"]
        assert r["reward_last10_mean"] == pytest.approx(sum(m["reward_mean"] for m in metrics) / len(metrics), rel=1e-9)
    assert on["kl_k3_mean"] is None  # no corrector, no diagnostics
    k3 = [m["correct/kl_k3"] for m in map(json.loads, (out / "mean" / "token_TIS" / "seed0" / "metrics.jsonl")
                                          .read_text().splitlines())]
    assert tis["kl_k3_mean"] == pytest.approx(sum(k3) / len(k3), rel=1e-9) and tis["kl_k3_mean"] > 0  # NVFP4 differs
    assert 0 < tis["ess_frac_mean"] <= 1


def test_bench_plan_table_and_sentences_come_from_the_rows():
    """bench_plan's block (its rows are difrl plan's at real size, minutes each: tests/test_planner.py runs the planner
    on the tiny pipeline): every table cell and sentence is computed from the rows."""
    bench = _load("bench_plan")
    base = {"peak_phase": "update", "params_gib": 5.5, "grads_gib": 5.5, "optimizer_gib": 11.1, "activations_gib": 3.0,
            "reference_gib": 2.8, "ema_gib": 5.5, "frozen_gib": 9.3, "rollout_collectives": 10, "rollout_collective_gib": 2.0,
            "update_collectives": 4, "update_collective_gib": 1.0}
    rows = [{**base, "case": "A", "gpus": g, "peak_gib": p, "setup_peak_gib": s, "fits_80": p <= 72, "fits_141": p <= 126.9}
            for g, p, s in ((1, 300.0, 50.0), (8, 60.0, 35.0), (16, 40.0, 45.0))]
    table = bench.table(rows)
    assert len(table) == 2 + 3 and "| A | 8 | 60.0 (update) | 35.0 |" in table[3] and table[3].endswith("| yes | yes |")
    said = bench.sentences(rows)
    assert said[0] == "- A: fits 80 GiB per GPU from 8 GPU(s) on (of 1, 8, 16 simulated)."
    assert said[1] == "- Setup's peak is above the iteration's in: A on 16."
    assert len(bench.collectives_table(rows)) == 2 + 2  # the one-GPU row has no collectives


def test_bench_plan_families_are_their_own_block():
    """--families runs the families added after the first four (each case in exactly one of the two blocks), at the
    1 and 8 GPUs issue 47 asks for, into markers of its own (a full run of one block leaves the other)."""
    bench = _load("bench_plan")
    family = [c[0] for c in bench.CASES if c[0].startswith(bench.FAMILY_PREFIXES)]
    first = [c[0] for c in bench.CASES if not c[0].startswith(bench.FAMILY_PREFIXES)]
    assert family and first and len(family) + len(first) == len(bench.CASES)
    assert all(n.startswith(("FLUX.1", "SD3.5-Large", "Wan 2.1", "LLaDA")) for n in first), first
    assert bench.FAMILY_GPUS == (1, 8) and {bench.FAMILY_BEGIN, bench.FAMILY_END}.isdisjoint({bench.BEGIN, bench.END})


# ---- benchmarks/bench_methods.py ---------------------------------------------------------------------------------

def _nfe_clock(r: dict) -> float:
    """A deterministic stand-in for a row's training seconds: its network evaluations / 1000 (rollout + update), so
    the equal-wall-clock bookkeeping is checked without a clock (a cheaper method is the one with fewer NFEs)."""
    return 1e-3 * (r.get("nfe_full", 0) + r.get("nfe_lowprec", 0) + r["nfe_train"])


@pytest.mark.slow  # three short digits runs (~30 s on 2 cores)
def test_bench_methods_quick_rows_and_equal_wall_clock(tmp_path, monkeypatch):
    """--quick's rows: every method a row (the refused ones "not applicable" with the refusal's words), the budget
    Flow-GRPO's training seconds, every run read at its last evaluation inside the budget, the cheaper tree resumed
    past it, and the resumed run's iterations those of one run of the same length without a resume."""
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import train

    bench = _load("bench_methods")
    monkeypatch.setattr(bench.common, "train_seconds", _nfe_clock)  # budget_run / at_budget read it at call time
    md = (ROOT / "BENCHMARKS.md").read_text()
    out = tmp_path / "runs"
    rows = bench.main(["--quick", "--iterations", "2", "--every", "1", "--methods", "best tree",
                       "--out", str(out), "--json", str(tmp_path / "m.json")])
    assert (ROOT / "BENCHMARKS.md").read_text() == md  # --quick never publishes
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(rows))
    by = {r["method"]: r for r in rows}
    assert list(by) == ["Flow-GRPO", "best tree"] and {r["world"] for r in rows} == {"digits"}
    assert all(r["applicable"] and r["n_seeds"] == 1 and r["seeds"] == [0] for r in rows)
    for r in rows:
        assert set(bench.WORLDS["digits"]["metrics"]) <= {k[:-5] for k in r if k.endswith("_mean")}
        assert r["accuracy_std"] is None  # one seed: no sample std (n - 1 needs two)
    flow = by["Flow-GRPO"]
    flow_rows = bench.common.read_rows(out / "digits" / "Flow-GRPO" / "seed0")
    assert flow["budget_seconds"] == pytest.approx(sum(_nfe_clock(r) for r in flow_rows), rel=1e-12)  # float sums
    assert flow["iterations_run"] == [2] and flow["iterations_at_budget"] == [2] and flow["resumed"] == [False]
    # the tree (Mix: 385 + 160 NFE per iteration vs flat's 800 + 720) is cheaper: resumed to the first evaluation past
    # the budget, and read at the last one inside it
    tree = by["best tree"]
    assert tree["resumed"] == [True] and tree["iterations_run"][0] > 2
    tree_rows = bench.common.read_rows(out / "digits" / "best_tree" / "seed0")
    cum = [sum(_nfe_clock(r) for r in tree_rows[:i]) for i in range(len(tree_rows) + 1)]  # seconds after i iterations
    it = tree["iterations_at_budget"][0]
    budget = flow["budget_seconds"]
    assert tree["seconds_at_budget"][0] == pytest.approx(cum[it], rel=1e-12) and cum[it] <= budget < cum[it + 1]
    assert cum[-1] > budget  # it ran past the budget (one evaluation to spare), so the read-out is the last inside
    for r in rows:
        assert r["seconds_at_budget"][0] <= budget * (1 + 1e-4)  # at_budget's slack for summation order
    # resume is exact: the resumed run's iterations equal one run of the same length without a resume (same ops on
    # one thread, the same counter-based draws: bitwise)
    fresh = tmp_path / "fresh"
    train(load_flow_config(*bench.run_overrides("digits", "best tree", 0, tree["iterations_run"][0], 1, True)),
          out_dir=fresh)
    keys = ("reward_mean", "reward_std", "loss", "nfe_full", "nfe_train")
    assert [{k: r[k] for k in keys} for r in bench.common.read_rows(fresh)] == [{k: r[k] for k in keys}
                                                                                for r in tree_rows]


def test_bench_methods_refusals_are_not_applicable_rows():
    """A method a world refuses is a row saying why, in the config's words (no run needed)."""
    bench = _load("bench_methods")
    draft = bench.refusal("moving_digits", "DRaFT-K")
    assert "'frame_digit' is not differentiable" in draft and str(ROOT) not in draft
    assert "auxiliary rewards, and there are none" in bench.refusal("moving_digits", "GARDO")
    assert all(bench.refusal("digits", m) is None for m in bench.METHODS)  # digits takes every method
    row = {"world": "moving_digits", "method": "ReFL", "variant": None, "applicable": False,
           "reason": bench.refusal("moving_digits", "ReFL")}
    assert bench.method_sentence(row, {}) == ("- ReFL: not applicable on moving_digits: reward 'frame_digit' is not "
                                              "differentiable (it declares no differentiable score: text recognition, "
                                              "detection and verifiable rewards pass through non-differentiable "
                                              "steps), so train.objective=refl cannot backpropagate it.")


def test_bench_methods_calls_a_difference_only_beyond_the_seed_spread():
    """The sentences and the "Which method when" summary come from the rows: better / worse only where the means
    differ by more than the two sample standard deviations together; FD lower is better; one seed: no claim."""
    bench = _load("bench_methods")

    def row(method, acc, fd, div=2.2, judge=0.9, n=3):
        r = {"world": "digits", "method": method, "variant": None, "applicable": True, "n_seeds": n, "seeds": list(range(n)),
             "budget_seconds": 56.0, "real_diversity": 2.3}
        for k, (m, s) in {"accuracy": acc, "fd": fd, "diversity": (div, 0.01), "judge_accuracy": (judge, 0.01)}.items():
            r[f"{k}_mean"], r[f"{k}_std"] = m, (s if n > 1 else None)
        return r

    base = row("Flow-GRPO", (0.90, 0.01), (30.0, 1.0))
    awm = row("AWM", (0.95, 0.01), (35.0, 1.0))        # accuracy +0.05 > 0.02: better; FD +5 > 2: worse
    dpo = row("DPO", (0.91, 0.01), (29.0, 1.0), div=2.0)  # +0.01 <= 0.02 and -1 <= 2: level; diversity 2.0 < 0.95 x 2.3
    assert bench.method_sentence(awm, base) == (
        "- AWM: against Flow-GRPO at equal wall-clock, better on accuracy (0.950 ± 0.010 vs 0.900 ± 0.010); worse on "
        "FD (35.0 ± 1.0 vs 30.0 ± 1.0); within the spread over seeds on diversity, judge accuracy.")
    assert "lower on diversity (2.000 ± 0.010 vs 2.200 ± 0.010)" in bench.method_sentence(dpo, base)
    assert "within the spread over seeds on accuracy, FD, judge accuracy" in bench.method_sentence(dpo, base)
    one = row("GARDO", (0.99, 0.0), (10.0, 0.0), n=1)
    assert bench.method_sentence(one, base).endswith("(one seed: no spread over seeds, so no better / worse claim).")
    summary = bench.which_method_when([base, awm, dpo])
    assert summary[0].startswith("- **digits** (budget 56 s of training, 3 seeds): best accuracy: AWM (0.950 ± 0.010, "
                                 "beyond the spread of every other); best FD: DPO (29.0 ± 1.0, level within the spread "
                                 "with Flow-GRPO)")
    assert summary[1] == "  - better than Flow-GRPO beyond the spread over seeds: AWM (accuracy)."
    assert summary[2] == "  - worse than Flow-GRPO beyond the spread over seeds: AWM (FD)."
    assert summary[3] == "  - diversity below 0.95x the real data's (2.30): DPO."
    assert summary[4] == ("  - the demo's goal (accuracy >= 0.99, FD <= 20, diversity >= 0.95x real) at this budget: "
                          "none (accuracy >= 0.99: none; FD <= 20: none; diversity >= 0.95x real: Flow-GRPO, AWM).")
    failed = {**row("DGPO", (0.0, 0.0), (0.0, 0.0)), "error": "RuntimeError: nan loss"}
    assert bench.method_sentence(failed, base) == "- DGPO: FAILED on digits (no measurement): RuntimeError: nan loss."
    assert "  - FAILED (no measurement; the error in its row): DGPO." in bench.which_method_when([base, awm, failed])
    na = {"world": "digits", "method": "ReFL", "variant": None, "applicable": False, "reason": "x is invalid: why; fix"}
    for r in (base, awm):
        r["seconds_per_iter"], r["seconds_ratio"], r["iterations_at_budget"] = 0.2, 1.0, [300, 300, 300]
    t = bench.table([base, awm, na, failed])
    assert len(t) == 2 + 4 and t[4] == "| ReFL | not applicable: why |" + " |" * 6 and "FAILED" in t[5]
    assert t[3].startswith("| AWM | 0.20 | 1.00× | 300, 300, 300 | 0.950 ± 0.010 | 35.0 ± 1.0 |")
    assert bench.which_method_when([base, na])[0] == ("- **digits** (budget 56 s of training, 3 seeds): only Flow-GRPO "
                                                      "measured, nothing to rank.")


def test_saved_results_name_no_path_of_the_machine_they_ran_on(tmp_path):
    # a result records paths relative to the repository (common.repo_path), not the checkout it ran in
    # ("/work/wt-branch41/configs/moving_digits.yaml" named another engineer's worktree)
    def strings(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x

    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        absolute = {s for s in strings(json.loads(path.read_text())) if s.startswith("/")}
        assert not absolute, (path.name, sorted(absolute)[:3])
    common = _load("common")
    assert common.repo_path(ROOT / "configs" / "moving_digits.yaml") == "configs/moving_digits.yaml"
    assert common.repo_path(Path("configs/digits.yaml")) == "configs/digits.yaml"  # as given on the command line
    assert common.repo_path(tmp_path / "x.yaml") == str(tmp_path / "x.yaml")  # outside the repository: as it is


def test_benchmarks_print_the_sample_std_and_one_rule_for_beyond_the_spread(tmp_path, monkeypatch):
    # "±" is the sample standard deviation (n - 1) through one helper of benchmarks/common.py, and a difference is
    # "beyond the spread" by common.beyond_spread alone: no script computes either on its own
    import functools
    import re

    common = _load("common")
    m, s = common.mean_std([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0)  # the sample std of 1, 2, 3 is exactly 1 (the population one: 0.816)
    assert common.sample_std([0.7]) == 0.0 and common.pm(0.7314, 0.0123, 3) == "0.731 ± 0.012 (n=3)"
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        src = path.read_text()
        if path.name != "common.py":
            assert not re.search(r"statistics\.(p?stdev|pvariance|variance)\(", src), path.name
        # the rule by hand, e.g. `gap > spread` / `abs(ma - mb) <= sa + sb`: only beyond_spread states it
        assert not re.search(r"abs\(\w+ - \w+\) <?[<>]=? ?\w+ \+ \w+|gap [<>] -?spread", src) or path.name == "common.py", \
            path.name
    # bench_correct's block re-rendered from the full run's saved per-seed values: sample stds, n printed, the run's
    # own command, date and machine kept, the JSON rewritten to the same numbers
    bench = _load("bench_correct")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    monkeypatch.setattr(bench, "republish", functools.partial(common.republish, path=md))
    saved = json.loads((ROOT / "benchmarks" / "results" / "bench_correct.json").read_text())
    (tmp_path / "rows.json").write_text(json.dumps(saved))
    rows = bench.main(["--render-from", str(tmp_path / "rows.json")])
    block = md.read_text().split(bench.BEGIN, 1)[1].split(bench.END, 1)[0]
    assert "Command: `python benchmarks/bench_correct.py --json benchmarks/results/bench_correct.json`" in block
    assert "Date: 2026-12-03 10:21 UTC" in block and "seeds [0, 1, 2] (n=3)" in block
    first = rows[0]
    acc = [p["accuracy"] for p in first["per_seed"]]
    assert first["accuracy_std"] == pytest.approx(common.sample_std(acc), rel=1e-12)  # same formula: rounding only
    assert f"{first['accuracy_mean']:.3f} ± {first['accuracy_std']:.3f}" in block
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
