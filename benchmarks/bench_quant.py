"""Low-precision formats on CPU: quantization error, real storage, and the digits rollout copy (difrl.quant).

    .venv/bin/python benchmarks/bench_quant.py            # full run (~2-3 min on 2 cores), updates BENCHMARKS.md
    .venv/bin/python benchmarks/bench_quant.py --quick --json /tmp/quant.json --no-write

Three tables, every format of ``difrl.quant.FORMATS`` (bf16, fp8, fp8_block, mxfp8, mxfp8_floor, nvfp4,
nvfp4_single), all with the pure-torch emulation that CI runs. It is written from Transformer Engine's documented
forward recipes (specs/lowprec-and-correctors.md §2-3) but has never been run against Transformer Engine (no GPU
was used); tests/test_quant.py compares it with torchao's quantizers bit for bit (see README "Low precision"):

(a) error of one linear layer, digits-size (in 128, out 512, 256 tokens) and FLUX-size (the MLP's first
    projection: weight [12288, 3072], activations [1024 tokens (--quick: 256), 3072]); N(0,1) activations,
    N(0, 1/in) weights, seed 0. Relative Frobenius error of the quantized activations, of the quantized
    weight, and of the emulated GEMM ``qdq(x) @ dequant(W_q).T`` against the fp32 GEMM; cosine of the outputs.
(b) measured bytes of the quantized weight (``Quantized.nbytes``: packed codes + every scale) against BF16,
    with difrl's weight layout (one scale per 16x16 / 128x128 tile) and with a scale per 1x16 / 1x32 / 1x128
    row block (the layout TE keeps for the GEMM's rowwise operand).
(c) the bundled digits generator copied through ``RolloutCopy`` with ``QUANT_PRESETS['digits']`` (the 9
    MLP and adaLN linears quantized; embedders and the output projection stay fp32): bytes of the copy,
    relative error and cosine of the velocity on a batch against the fp32 model, and the emulated forward time
    against the fp32 forward (median over round-robin repeats). The emulation quantizes the activations in
    plain torch on every call, so it is slower than fp32 on CPU: that is its cost, not a claim about a GPU
    (benchmarks/gpu_lowprec.py times the real kernels).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, standard_args, write_block  # noqa: E402

from difrl.models.digits import DigitsPolicy, digit_prompt
from difrl.quant import FORMATS, QUANT_PRESETS, RolloutCopy, qdq, quantize, relative_error, storage_bytes

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_quant:start -->", "<!-- bench_quant:end -->"
ROW_BLOCK = {"bf16": "-", "fp8": "tensor", "fp8_block": "1x128", "mxfp8": "1x32", "mxfp8_floor": "1x32", "nvfp4": "1x16",
             "nvfp4_single": "1x16"}
WEIGHT_BLOCK = {"bf16": "-", "fp8": "tensor", "fp8_block": "128x128", "mxfp8": "1x32", "mxfp8_floor": "1x32",
                "nvfp4": "16x16", "nvfp4_single": "16x16"}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@torch.no_grad()
def layer_rows(name: str, d_in: int, d_out: int, tokens: int) -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    y = x @ w.T
    err_rows, mem_rows = [], []
    bf16_bytes = w.numel() * 2
    for fmt in FORMATS:
        t0 = time.perf_counter()
        x_hat, w_hat = qdq(x, fmt, "activation"), qdq(w, fmt, "weight")
        y_hat = x_hat @ w_hat.T
        err_rows.append({"layer": name, "weight": [d_out, d_in], "tokens": tokens, "format": fmt,
                         "act_err": relative_error(x, x_hat), "weight_err": relative_error(w, w_hat),
                         "gemm_err": relative_error(y, y_hat), "cosine": cosine(y, y_hat)})
        q_w, q_row = quantize(w, fmt, "weight"), quantize(w, fmt, "activation")
        mem_rows.append({"layer": name, "weight": [d_out, d_in], "format": fmt, "bytes": q_w.nbytes,
                         "bytes_per_elem": q_w.nbytes / w.numel(), "x_bf16": q_w.nbytes / bf16_bytes,
                         "row_layout_bytes": q_row.nbytes, "row_layout_x_bf16": q_row.nbytes / bf16_bytes})
        del x_hat, w_hat, y_hat, q_w, q_row
        print(f"{name:12s} {fmt:9s} act {100 * err_rows[-1]['act_err']:6.2f}%  W {100 * err_rows[-1]['weight_err']:6.2f}%  "
              f"GEMM {100 * err_rows[-1]['gemm_err']:6.2f}%  cos {err_rows[-1]['cosine']:.5f}  "
              f"{mem_rows[-1]['x_bf16']:.3f}x bf16  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return err_rows, mem_rows


@torch.no_grad()
def digits_rows(batch: int, repeats: int, warmup: int = 3) -> list[dict]:
    policy = DigitsPolicy.from_checkpoint()
    ref = policy.module.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *policy.latent_shape, generator=g)
    sigma = torch.rand(batch, generator=g)
    cond = policy.encode([digit_prompt(i % 10) for i in range(batch)])
    v_ref = policy.velocity(x, sigma, cond)
    fp32_bytes = storage_bytes(ref)
    bf16_bytes = sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                     for t in list(ref.parameters()) + list(ref.buffers()))
    copies = {fmt: RolloutCopy(ref, fmt, **QUANT_PRESETS["digits"]) for fmt in FORMATS}

    def forward(module):
        def run():
            policy.module = module
            try:
                return policy.velocity(x, sigma, cond)
            finally:
                policy.module = ref
        return run

    methods = {"fp32": forward(ref)} | {fmt: forward(c.module) for fmt, c in copies.items()}
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in methods}
    for _ in range(repeats):  # round-robin: drift hits every method alike
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["fp32"])
    rows = []
    for name in methods:
        v = methods[name]()
        nbytes = fp32_bytes if name == "fp32" else storage_bytes(copies[name].module)
        med = statistics.median(times[name])
        rows.append({"model": "digits (bundled)", "format": name, "batch": batch,
                     "quantized": "-" if name == "fp32" else f"{len(copies[name].report.quantized)}/{len(copies[name].report.rows)}",
                     "bytes": nbytes, "x_fp32": nbytes / fp32_bytes, "x_bf16": nbytes / bf16_bytes,
                     "velocity_err": relative_error(v_ref, v), "cosine": cosine(v_ref, v),
                     "forward_ms": 1e3 * med, "x_fp32_time": med / base, "repeats": repeats})
        r = rows[-1]
        print(f"digits       {name:9s} {r['bytes']:8d} B ({r['x_fp32']:.3f}x fp32)  v err {100 * r['velocity_err']:6.2f}%  "
              f"{r['forward_ms']:7.2f} ms ({r['x_fp32_time']:.2f}x fp32)", flush=True)
    return rows


def _shape(s) -> str:
    return "x".join(map(str, s))


def tables(res: dict) -> str:
    out = ["### (a) Error of one linear layer (emulated GEMM vs fp32)", "",
           "| layer | weight [out, in] | tokens | format | blocks (act / weight) | act rel. err | weight rel. err | "
           "GEMM rel. err | output cosine |",
           "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in res["layers"]:
        out.append(f"| {r['layer']} | {_shape(r['weight'])} | {r['tokens']} | {r['format']} | "
                   f"{ROW_BLOCK[r['format']]} / {WEIGHT_BLOCK[r['format']]} | {100 * r['act_err']:.2f}% | "
                   f"{100 * r['weight_err']:.2f}% | {100 * r['gemm_err']:.2f}% | {r['cosine']:.5f} |")
    out += ["", "### (b) Bytes of the quantized weight (measured: packed codes + all scales)", "",
            "| layer | weight [out, in] | format | bytes | bytes / element | × BF16 | × BF16 with 1×16/1×32/1×128 row-block scales |",
            "|---|---|---|---:|---:|---:|---:|"]
    for r in res["storage"]:
        out.append(f"| {r['layer']} | {_shape(r['weight'])} | {r['format']} | {r['bytes']:,} | {r['bytes_per_elem']:.4f} | "
                   f"{r['x_bf16']:.3f} | {r['row_layout_x_bf16']:.3f} |")
    out += ["", "### (c) Digits generator through `RolloutCopy` (`QUANT_PRESETS['digits']`, emulated)", "",
            "| format | linears quantized | bytes | × fp32 model | × bf16 model | velocity rel. err | velocity cosine | "
            "forward ms (median) | × fp32 forward |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["digits"]:
        out.append(f"| {r['format']} | {r['quantized']} | {r['bytes']:,} | {r['x_fp32']:.3f} | {r['x_bf16']:.3f} | "
                   f"{100 * r['velocity_err']:.2f}% | {r['cosine']:.5f} | {r['forward_ms']:.2f} | {r['x_fp32_time']:.2f} |")
    return "\n".join(out)


def reading(res: dict) -> str:
    """The block's interpretation, every number from this run's rows."""
    def pct(v):
        return f"{100 * v:.2f}%"

    def span(vals, fmt=pct):
        lo, hi = fmt(min(vals)), fmt(max(vals))
        return lo if lo == hi else f"{lo}-{hi}"

    lay, mem = res["layers"], res["storage"]
    parts = ["**Reading it.**"]
    for label, fmts in (("The E4M3 recipes that scale to avoid overflow (fp8 per tensor, fp8_block, mxfp8)",
                         ("fp8", "fp8_block", "mxfp8")), ("mxfp8_floor (up to 2x overflow, saturated)", ("mxfp8_floor",))):
        rs = [r for r in lay if r["format"] in fmts]
        if rs:
            parts.append(f"{label}: {span([v for r in rs for v in (r['act_err'], r['weight_err'])])} per operand, "
                         f"{span([r['gemm_err'] for r in rs])} on the GEMM.")
    nv = {(r["layer"], r["format"]): r for r in lay if r["format"].startswith("nvfp4")}
    for layer in dict.fromkeys(r["layer"] for r in lay):
        two, one = nv.get((layer, "nvfp4")), nv.get((layer, "nvfp4_single"))
        if two:
            parts.append(f"{layer}: NVFP4 {pct(two['act_err'])} (activations), {pct(two['weight_err'])} (weights), "
                         f"{pct(two['gemm_err'])} (GEMM)" + (f"; single-level NVFP4 {pct(one['act_err'])}, "
                                                             f"{pct(one['weight_err'])}, {pct(one['gemm_err'])}." if one else "."))
    nvm = [r for r in mem if r["format"] == "nvfp4"]
    if nvm:
        parts.append(f"An NVFP4 weight takes {span([r['x_bf16'] for r in nvm], lambda v: f'{v:.3f}')}× "
                     f"its BF16 bytes with one scale per 16×16 tile, {max(r['row_layout_x_bf16'] for r in nvm):.3f}× "
                     "with a scale per 1×16 row block (TE's GEMM layout).")
    dig = {r["format"]: r for r in res["digits"]}
    slow = [r for r in res["digits"] if r["format"] != "fp32"]
    if slow:
        fast, slowest = min(slow, key=lambda r: r["x_fp32_time"]), max(slow, key=lambda r: r["x_fp32_time"])
        parts.append(f"The emulated digits copy's forward costs {fast['x_fp32_time']:.1f}× ({fast['format']}) to "
                     f"{slowest['x_fp32_time']:.1f}× ({slowest['format']}) the fp32 forward on this CPU; the emulation "
                     "fake-quantizes every activation in plain torch, so these times say nothing about GPU kernels.")
    if "nvfp4" in dig:
        parts.append(f"The NVFP4 digits copy is {dig['nvfp4']['x_bf16']:.2f}× its BF16 size (embedders, output "
                     "projection and biases stay fp32).")
    return " ".join(parts)


def write_markdown(res: dict, command: str, path: Path) -> None:
    d = res["digits"][0]
    block = "\n".join([
        BEGIN,
        "## Low-precision formats: error, storage, and the emulated digits rollout copy",
        "",
        f"Command: `{command}`  ",
        f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {machine()}",
        "",
        "Pure-torch emulation (`difrl.quant`) written from Transformer Engine's documented forward recipes; it has "
        "never been run against Transformer Engine (no GPU was used). N(0,1) activations, N(0, 1/in) weights, seed 0. "
        "NVFP4 = E2M1 with an E4M3 scale per 16 and an FP32 tensor scale (nvfp4_single: the E4M3 block scale only, "
        "torchao's single-level mode); MXFP8 = E4M3 with an E8M0 scale per 32, rounded up (RCEIL; mxfp8_floor: the "
        "OCP spec's floor exponent); fp8 = E4M3 with one current-amax scale per tensor; fp8_block = E4M3 with "
        f"power-of-two scales. Digits: batch {d['batch']}, {d['repeats']} round-robin repeats; the emulation fake-"
        "quantizes activations in plain torch on every call, so it is slower than fp32 on a CPU by design.",
        "",
        tables(res),
        "",
        reading(res),
        END,
    ])
    write_block(path, BEGIN, END, block.split("\n")[1:-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "256 FLUX tokens and fewer repeats (under a minute)")
    ap.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()), help="torch threads (default 2, CI's cores)")
    ap.add_argument("--tokens", type=int, help="FLUX-size activation rows (default 1024, --quick 256)")
    ap.add_argument("--flux-dims", type=int, nargs=2, default=[3072, 12288], metavar=("IN", "OUT"),
                    help="the large layer's in/out features (default FLUX's MLP: 3072 12288)")
    ap.add_argument("--small-tokens", type=int, default=256, help="digits-size layer activation rows")
    ap.add_argument("--batch", type=int, default=256, help="digits velocity batch")
    ap.add_argument("--repeats", type=int, help="timed forward repeats per format (default 30, --quick 8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = args.tokens or (256 if args.quick else 1024)
    repeats = args.repeats or (8 if args.quick else 30)

    res = {"layers": [], "storage": [], "digits": []}
    d_in, d_out = args.flux_dims
    for name, (i, o, t) in {"digits-size": (128, 512, args.small_tokens), "FLUX-size": (d_in, d_out, tokens)}.items():
        err, mem = layer_rows(name, i, o, t)
        res["layers"] += err
        res["storage"] += mem
    res["digits"] = digits_rows(args.batch, repeats)

    command = "python benchmarks/bench_quant.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_write:
        write_markdown(res, command.strip(), ROOT / "BENCHMARKS.md")
        print(f"table written to {ROOT / 'BENCHMARKS.md'}")
    return res


if __name__ == "__main__":
    main()
