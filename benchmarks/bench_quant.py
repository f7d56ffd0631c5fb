"""Low-precision formats on CPU: quantization error, real storage, and the digits rollout copy (difrl.quant);
with --gpu, what each backend x format costs on a GPU against BF16.

    .venv/bin/python benchmarks/bench_quant.py            # full run (~2-3 min on 2 cores), updates BENCHMARKS.md
    .venv/bin/python benchmarks/bench_quant.py --quick --json /tmp/quant.json --no-write
    .venv/bin/python benchmarks/bench_quant.py --gpu      # on a CUDA GPU (never run on one yet), its own block
    .venv/bin/python benchmarks/bench_quant.py --gpu --quick   # the same code path, tiny shapes, CPU is fine

Three tables, every format of ``difrl.quant.FORMATS`` (bf16, fp8, fp8_block, mxfp8, mxfp8_floor, nvfp4,
nvfp4_single), all with the pure-torch emulation that CI runs. It is written from Transformer Engine's documented
forward recipes (docs/reference/specs/lowprec-and-correctors.md §2-3) but has never been run against Transformer Engine
(no GPU was used); tests/test_quant.py compares it with torchao's quantizers bit for bit (see docs/guides/low-precision.md):

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

--gpu (GPU mode; a CUDA device, or any device with --quick, which shrinks every shape):
(g1) one linear layer (bias, BF16 weights and activations) at the FLUX shape of the issue (x 4608x3072,
    W 9216x3072) and SD3.5-Medium block shapes (4 samples x 1024 image tokens; attention 1536->1536, MLP
    1536->6144->1536): BF16 ``F.linear`` against each backend x format (GPU_COMBOS: Transformer Engine,
    the torch-native FP8 backend with and without fast accumulation, the exact emulation), median ms, speed-up,
    relative error against the fp32 layer and, for the torch backend, against the emulation of its format.
(g2) a whole 2.0B SD3.5-Medium-shaped ``SD3Transformer2DModel`` (the constructor of docs/reference/specs/gpu-regime.md,
    random weights, BF16, built on the GPU; diffusers needed), one forward at 512x512 (64x64 latents) for a
    batch of 4: BF16 against a rollout copy per backend x format (``difrl.quant.timing.time_rollout_copy``),
    with the SD3 preset's skip list and both its min_dim (2432, SD3.5-Large's width: only the MLPs of this
    model are quantized) and min_dim 0 (every linear not skipped by name).
A backend x format that cannot run here is listed with the reason (no GPU, no Transformer Engine, no FP8
tensor cores). Only a full run on a CUDA device writes its block in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cell, machine, standard_args, write_block  # noqa: E402

from difrl.models.digits import DigitsPolicy, digit_prompt
from difrl.quant import (FORMATS, QUANT_PRESETS, QuantizationError, RolloutCopy, qdq, quantize, quantize_module,
                         quantized_layers, relative_error, storage_bytes)
from difrl.quant.formats import cosine
from difrl.quant.timing import time_ms, time_rollout_copy

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_quant:start -->", "<!-- bench_quant:end -->"
ROW_BLOCK = {"bf16": "-", "fp8": "tensor", "fp8_row": "row", "fp8_block": "1x128", "mxfp8": "1x32", "mxfp8_floor": "1x32", "nvfp4": "1x16",
             "nvfp4_single": "1x16"}
WEIGHT_BLOCK = {"bf16": "-", "fp8": "tensor", "fp8_row": "row", "fp8_block": "128x128", "mxfp8": "1x32", "mxfp8_floor": "1x32",
                "nvfp4": "16x16", "nvfp4_single": "16x16"}


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
    for label, fmts in (("The E4M3 recipes that scale to avoid overflow (fp8 per tensor, fp8_row, fp8_block, mxfp8)",
                         ("fp8", "fp8_row", "fp8_block", "mxfp8")), ("mxfp8_floor (up to 2x overflow, saturated)", ("mxfp8_floor",))):
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
        "OCP spec's floor exponent); fp8 = E4M3 with one current-amax scale per tensor (fp8_row: per row, i.e. per "
        "token and per output channel); fp8_block = E4M3 with "
        f"power-of-two scales. Digits: batch {d['batch']}, {d['repeats']} round-robin repeats; the emulation fake-"
        "quantizes activations in plain torch on every call, so it is slower than fp32 on a CPU by design. GPU speed of each "
        "backend × format against BF16 is `bench_quant.py --gpu`'s own block, written only by a run on a GPU.",
        "",
        tables(res),
        "",
        reading(res),
        END,
    ])
    write_block(path, BEGIN, END, block.split("\n")[1:-1])


# ---------------------------------------------------------------------------------- GPU mode

GPU_BEGIN, GPU_END = "<!-- bench_quant_gpu:start -->", "<!-- bench_quant_gpu:end -->"
# (backend, format); "torch+fast" = the torch backend with Hopper's fast accumulation (torchao's default)
GPU_COMBOS = (("te", "fp8"), ("te", "fp8_block"), ("te", "mxfp8"), ("te", "nvfp4"), ("torch", "fp8"),
              ("torch", "fp8_row"), ("torch+fast", "fp8_row"), ("emulate", "fp8"), ("emulate", "fp8_row"),
              ("emulate", "mxfp8"), ("emulate", "nvfp4"))
GEMM_SHAPES = {"FLUX (issue)": (4608, 3072, 9216), "SD3 attention": (4096, 1536, 1536), "SD3 MLP in": (4096, 1536, 6144),
               "SD3 MLP out": (4096, 6144, 1536)}  # name: (tokens M, in K, out N)
QUICK_GEMM_SHAPES = {"tiny": (64, 64, 96)}
# docs/reference/specs/gpu-regime.md's 2.0B SD3.5-Medium-shaped transformer; --quick: a 2-block one with the same
# structure
SD3_2B = dict(sample_size=64, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
              joint_attention_dim=24, caption_projection_dim=1536, pooled_projection_dim=24, out_channels=16,
              pos_embed_max_size=96)
SD3_TINY = dict(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=8, caption_projection_dim=16, pooled_projection_dim=8, out_channels=16,
                pos_embed_max_size=16)


def _not_run(e: Exception) -> str:
    return f"not run: {e}" if isinstance(e, QuantizationError) else f"FAILED: {type(e).__name__}: {str(e)[:300]}"


def _swap(module: nn.Module, backend: str, fmt: str, **kw) -> tuple[nn.Module, str, str]:
    """A copy of `module` with its linears on `backend` (QuantizationError if it cannot run): (copy, backend
    that ran, why)."""
    q = copy.deepcopy(module)
    report = quantize_module(q, fmt, backend=backend.split("+")[0], **kw)
    if backend.endswith("+fast"):
        for layer in quantized_layers(q).values():
            layer.fast_accum = True
    return q, ",".join(report.backends), "; ".join(report.backends.values())


@torch.no_grad()
def gpu_gemm_rows(shapes: dict, combos, device: torch.device, warmup: int, repeats: int) -> list[dict]:
    rows = []
    for name, (M, K, N) in shapes.items():
        torch.manual_seed(0)
        lin = nn.Linear(K, N, device=device)
        for p in lin.parameters():  # BF16-valued weights: the fp32 reference and every path see the same values
            p.copy_(p.bfloat16().float())
        lin16 = copy.deepcopy(lin).bfloat16()
        x16 = torch.randn(M, K, device=device).bfloat16()
        y32 = lin(x16.float())
        ms16 = statistics.median(time_ms(lambda: lin16(x16), warmup, repeats, device))
        flop = 2 * M * N * K
        rows.append({"shape": name, "x": [M, K], "weight": [N, K], "backend": "bf16", "format": "bf16", "ms": ms16,
                     "speedup": 1.0, "tflops": flop / ms16 / 1e9, "err_vs_fp32": relative_error(y32, lin16(x16)),
                     "err_vs_emulation": None, "note": "F.linear"})
        emulated = {}
        for backend, fmt in combos:
            try:
                q, ran, why = _swap(nn.Sequential(lin16), backend, fmt)
                y = q(x16).float()
                if ran == "emulate":
                    emulated[fmt] = y
                elif fmt not in emulated and ran == "torch":
                    emulated[fmt] = _swap(nn.Sequential(lin16), "emulate", fmt)[0](x16).float()
                ms = statistics.median(time_ms(lambda: q(x16), warmup, repeats, device))
            except Exception as e:  # cannot run here (QuantizationError), or failed: the row says so, the rest runs
                rows.append({"shape": name, "x": [M, K], "weight": [N, K], "backend": backend, "format": fmt, "ms": None,
                             "speedup": None, "tflops": None, "err_vs_fp32": None, "err_vs_emulation": None,
                             "note": _not_run(e)})
                continue
            rows.append({"shape": name, "x": [M, K], "weight": [N, K], "backend": backend, "format": fmt, "ms": ms,
                         "speedup": ms16 / ms, "tflops": flop / ms / 1e9, "err_vs_fp32": relative_error(y32, y),
                         "err_vs_emulation": relative_error(emulated[fmt], y) if ran == "torch" else None, "note": why})
            del q
        for r in rows[-len(combos) - 1:]:
            print(f"{r['shape']:14s} {r['backend']:10s} {r['format']:9s} " + (
                f"{r['ms']:8.3f} ms  x{r['speedup']:.2f}  {r['tflops']:7.1f} TFLOP/s  err {100 * r['err_vs_fp32']:.3f}%"
                if r["ms"] is not None else r["note"]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def gpu_transformer_rows(combos, device: torch.device, quick: bool, batch: int, text_tokens: int, warmup: int,
                         repeats: int) -> list[dict]:
    try:
        from diffusers import SD3Transformer2DModel
    except ImportError as e:
        return [{"model": "SD3 2B", "backend": "-", "format": "-", "note": f"not run: diffusers is not importable ({e})"}]
    cfg = SD3_TINY if quick else SD3_2B
    torch.manual_seed(0)
    with torch.device(device):
        model = SD3Transformer2DModel(**cfg).to(torch.bfloat16).eval()
        side = cfg["sample_size"]
        inputs = {"hidden_states": torch.randn(batch, cfg["in_channels"], side, side, dtype=torch.bfloat16),
                  "encoder_hidden_states": torch.randn(batch, text_tokens, cfg["joint_attention_dim"], dtype=torch.bfloat16),
                  "pooled_projections": torch.randn(batch, cfg["pooled_projection_dim"], dtype=torch.bfloat16),
                  "timestep": torch.full((batch,), 500.0), "return_dict": False}
    params = sum(p.numel() for p in model.parameters())
    label = f"SD3 {params / 1e9:.2f}B" if params > 1e8 else f"SD3 tiny ({params / 1e6:.2f}M)"
    base = statistics.median(time_ms(lambda: model(**inputs), warmup, repeats, device))
    rows = [{"model": label, "backend": "bf16", "format": "bf16", "min_dim": None, "ms": base, "speedup": 1.0,
             "quantized": "-", "rel_err": 0.0, "note": f"batch {batch}, {side * 8}x{side * 8}"}]
    print(f"{label} bf16 {base:.2f} ms", flush=True)
    preset = QUANT_PRESETS["sd3"]
    # the preset's min_dim leaves only the MLPs of the 2B model quantized; the tiny model's width is 16, so the
    # same cut there is 16 (attention 16x16 kept, MLP 16->64->16 quantized)
    cut = 16 if quick else preset["min_dim"]
    for backend, fmt in combos:
        for min_dim in ((cut, 0) if backend.startswith("torch") else (cut,)):
            row = {"model": label, "backend": backend, "format": fmt, "min_dim": min_dim}
            try:
                if backend.endswith("+fast"):
                    continue  # the GEMM table shows what fast accumulation buys; one forward per combo here
                r = time_rollout_copy(model, inputs, fmt, backend, preset["skip"], min_dim, warmup, repeats, base)
            except Exception as e:  # cannot run here (QuantizationError), or failed: the row says so, the rest runs
                rows.append(row | {"ms": None, "speedup": None, "quantized": "-", "rel_err": None, "note": _not_run(e)})
                print(f"{label} {backend} {fmt} {_not_run(e)}", flush=True)
                continue
            why = "; ".join(f"{k}: {v}" for k, v in r["backends"].items())
            rows.append(row | {"ms": r["ms_copy"], "speedup": r["speedup"], "quantized": r["quantized"],
                               "rel_err": r["rel_err"], "note": why})
            print(f"{label} {backend:8s} {fmt:8s} min_dim {min_dim:4d}: {r['ms_copy']:.2f} ms x{r['speedup']:.2f} "
                  f"({r['quantized']} linears, err {100 * r['rel_err']:.2f}%)", flush=True)
    del model
    return rows


def gpu_tables(res: dict) -> str:
    out = ["### (g1) One linear layer, BF16 vs each backend x format", "",
           "| shape | x | weight | backend | format | ms (median) | × BF16 speed | TFLOP/s | rel. err vs fp32 | "
           "rel. err vs emulation | note |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in res["gemm"]:
        out.append(f"| {r['shape']} | {_shape(r['x'])} | {_shape(r['weight'])} | {r['backend']} | {r['format']} | "
                   f"{cell(r['ms'], '.3f')} | {cell(r['speedup'], '.2f')} | {cell(r['tflops'], '.0f')} | "
                   f"{cell(r['err_vs_fp32'], '.3f', 100, '%')} | {cell(r['err_vs_emulation'], '.3f', 100, '%')} | "
                   f"{r['note']} |")
    out += ["", "### (g2) Whole transformer forward, BF16 vs a rollout copy per backend x format", "",
            "| model | backend | format | min_dim | linears quantized | ms (median) | × BF16 speed | rel. err vs BF16 | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in res["transformer"]:
        out.append(f"| {r['model']} | {r['backend']} | {r['format']} | {'-' if r.get('min_dim') is None else r['min_dim']} | "
                   f"{r.get('quantized', '-')} | {cell(r.get('ms'), '.2f')} | {cell(r.get('speedup'), '.2f')} | "
                   f"{cell(r.get('rel_err'), '.2f', 100, '%')} | {r['note']} |")
    return "\n".join(out)


def gpu_main(args, argv) -> dict | None:
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("bench_quant --gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to time. "
              "Add --quick to run the same code path on the CPU with tiny shapes.")
        return None
    device = torch.device("cuda" if cuda else "cpu")
    combos = [tuple(c.split(":")) for c in args.combos] if args.combos else list(GPU_COMBOS)
    warmup, repeats = (1, args.repeats or 2) if args.quick else (5, args.repeats or 20)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu",
           "gemm": gpu_gemm_rows(QUICK_GEMM_SHAPES if args.quick else GEMM_SHAPES, combos, device, warmup, repeats),
           "transformer": gpu_transformer_rows(combos, device, args.quick, args.gpu_batch, 93 if not args.quick else 8,
                                               warmup, min(repeats, 10))}
    text = gpu_tables(res)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if not args.no_write and cuda:
        command = "python benchmarks/bench_quant.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
        body = ["## Low-precision backends on a GPU: one linear layer and the 2B SD3 transformer forward", "",
                f"Command: `{command.strip()}`  ",
                f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ", f"Machine: {machine()}",
                "", "BF16 weights and activations; times are medians of CUDA-event timed calls after warm-up (which "
                "includes torch.compile's tracing of the torch backend).", "", text]
        write_block(ROOT / "BENCHMARKS.md", GPU_BEGIN, GPU_END, body)
        print(f"table written to {ROOT / 'BENCHMARKS.md'}")
    return res


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
    ap.add_argument("--gpu", action="store_true", help="GPU mode: BF16 vs each backend x format (see the docstring)")
    ap.add_argument("--combos", nargs="+", metavar="BACKEND:FORMAT",
                    help="GPU mode: the backend x format pairs (default GPU_COMBOS, e.g. torch:fp8_row emulate:nvfp4)")
    ap.add_argument("--gpu-batch", type=int, default=4, help="GPU mode: the transformer forward's batch (default 4)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gpu:
        return gpu_main(args, argv)
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
