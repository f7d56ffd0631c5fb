"""difrl's trainer on a GPU at real model size: rollouts against plain diffusers, flat vs tree vs Sol-RL iterations.

    python benchmarks/bench_gpu.py                         # one CUDA GPU, <= 8 min: writes its block in BENCHMARKS.md
    python benchmarks/bench_gpu.py --quick --json /tmp/g.json   # tiny dimensions on the CPU in about a minute
    python benchmarks/bench_gpu.py --prompts 4 --stage-timeout 120 --time-limit 1200   # more leaves, longer stages
    bash benchmarks/gpu_check.sh bench_gpu                 # the prepared GPU check: the same under its `timeout`

The model is an SD3.5-Medium-shaped 2.0B-parameter `SD3Transformer2DModel` (24 joint blocks, 24 heads x 64) with
random weights, built with plain diffusers constructors next to tiny CLIP / T5 text encoders and a tiny 4-level VAE
(8x downsampling, 16 latent channels), in bf16 at 512x512 (1024 image tokens), saved with `save_pretrained` to a
scratch directory that the trainer loads like any local pipeline (docs/reference/specs/gpu-regime.md). Nothing is
downloaded; the GPU machine needs torch and difrl's pure-Python dependencies only. `--quick` builds the same pipeline
with tiny dimensions on the CPU (64x64 images, 2 blocks) so the test suite runs the whole script.

Every stage runs under its own time budget (BUDGET_S), and the run under a time limit (--time-limit, default
TIME_LIMIT_S = gpu_check.sh's `timeout`): the start prints the budgets' sum against the limit. A stage that raises
(out of memory, a compile or config error, its budget running out, whatever wrapper the timeout surfaced in) becomes
a FAILED row with the error, memory is freed, and the run goes on with the next stage; no stage starts past the
limit. The JSON rows and, for a full run, the BENCHMARKS.md block are rewritten after every stage, so a run killed
from outside keeps what it measured. What one run measures:
1. rollout vs pipe: `pipe(prompts, output_type="latent")` against difrl's `rollout()` on the same pipeline, batch
   16 x 16 steps (mean of 3 after a warm-up): as the trainer calls it (flow_sde, every trained transition stored),
   and ODE; plus 16 bare transformer forwards. Ratios to pipe().
2. the trainer (`difrl.train.flow.trainer.train`, LoRA rank 32, KL off, evaluation reduced to one sample) for 2 iterations
   per method, the second timed: flat GRPO, BranchGRPO (splits [0, 4, 8, 12] x 2 = 16 leaves), + width and depth
   pruning, BranchGRPO-Mix (SDE window 0..7), Sol-RL (32 candidates in 8 steps from an fp8_row rollout copy on the automatically chosen backend: the
   torch-native one on a GPU without Transformer Engine, difrl.quant.torch_fp8; 16
   regenerated); the same `train.micro_batch` (transitions) and leaves per prompt in each. Seconds per iteration
   split into rollout / update, NFE, peak GPU memory (`torch.cuda.max_memory_allocated`), the update's achieved
   TFLOP/s (FLOPs of one trained transition's forward + backward counted by torch's FlopCounterMode, times the
   transitions trained, over the update's seconds), and flat GRPO again with `model.gradient_checkpointing` and with
   `model.compile`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.monotonic()  # the time limit counts from here: torch's and diffusers' imports are start-up

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cell, publish, standard_args  # noqa: E402

BEGIN, END = "<!-- bench_gpu:begin -->", "<!-- bench_gpu:end -->"
PROMPTS = ["a photo of a cat", "a red dog", "a bright sky", "a dark forest", "a green tree", "a blue car",
           "an old house", "a small boat"]

# (full, quick): the model's shape and the run's size
SHAPE = {
    "full": dict(sample_size=64, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
                 joint_attention_dim=32, caption_projection_dim=1536, pooled_projection_dim=32, out_channels=16,
                 pos_embed_max_size=96),
    "quick": dict(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
                  pos_embed_max_size=16),
}
RUN = {  # image side, steps, leaves per prompt (= tree of 2^splits), split steps, Mix window, Sol-RL, LoRA rank
    "full": dict(side=512, steps=16, leaves=16, splits=[0, 4, 8, 12], depth_prune=[12, 13, 14, 15], window=8,
                 candidates=32, preview=8, rank=32, micro=15, pipe_batch=16, repeats=3),
    "quick": dict(side=64, steps=6, leaves=4, splits=[0, 2], depth_prune=[4, 5], window=2,
                  candidates=8, preview=3, rank=4, micro=5, pipe_batch=4, repeats=2),
}


# ---------------------------------------------------------------------------------- the model

def build_pipeline(size: str, device: str, dtype: torch.dtype):
    """A StableDiffusion3Pipeline with the SD3.5-Medium-shaped transformer (random weights), tiny CLIP / T5 text
    encoders (hidden 16 / 32: CLIP 16 + 16 zero-padded to T5's 32 = joint_attention_dim, pooled 16 + 16 = 32) and a
    tiny 4-level VAE (8x, 16 latent channels), all built on `device` in `dtype` (the VAE and encoders in fp32)."""
    import diffusers
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from difrl.models.tiny import tiny_clip_config, tiny_clip_tokenizer, tiny_t5_kwargs, tiny_t5_tokenizer

    torch.manual_seed(0)
    clip_tok, clip_tok2, t5_tok = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
    with torch.device(device):
        transformer = diffusers.SD3Transformer2DModel(**SHAPE[size]).to(dtype)
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            latent_channels=16, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5305)
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=transformer, vae=vae,
            text_encoder=CLIPTextModelWithProjection(tiny_clip_config(len(clip_tok), 16, 16)), tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(tiny_clip_config(len(clip_tok2), 16, 16)), tokenizer_2=clip_tok2,
            text_encoder_3=T5EncoderModel(T5Config(**tiny_t5_kwargs(len(t5_tok), 32))), tokenizer_3=t5_tok,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            comp.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------------------------- the time budget

# gpu_check.sh runs this script under `timeout TIME_LIMIT_S` and passes the same number as --time-limit (a test checks
# that the two agree and that the budget below fits under it).
TIME_LIMIT_S = 540
END_RESERVE_S = 15  # kept back from the limit for the last block write and removing the scratch pipeline
MIN_STAGE_S = 5  # a stage with less time than this left before the limit is not started
ALARM_REPEAT_S = 5  # a stage that caught its StageTimeout and ran on gets another one this often
# Seconds: the start-up allowance (imports, building and saving the pipeline) and each stage's limit. The full run's
# are estimated from docs/reference/specs/gpu-regime.md's H200 figures for this shape (2 prompts x 16 leaves: flat GRPO
# ~12 s per iteration, a tree ~5 s, Sol-RL's fp8 candidates plus their compile, inductor's regional compile of one block
# forward + backward) with two iterations, loading and saving each.
BUDGET_S = {
    "full": {"start-up": 45, "rollout vs pipe": 45, "flat GRPO": 55, "BranchGRPO": 35,
             "BranchGRPO + width/depth pruning": 35, "BranchGRPO-Mix": 35, "Sol-RL (fp8_row candidates)": 90,
             "flat GRPO + gradient checkpointing": 50, "flat GRPO + compile": 90},
    "quick": {"start-up": 60, "rollout vs pipe": 60, "flat GRPO": 60, "BranchGRPO": 60,
              "BranchGRPO + width/depth pruning": 60, "BranchGRPO-Mix": 60, "Sol-RL (fp8_row candidates)": 60,
              "flat GRPO + gradient checkpointing": 60},
}
ROLLOUT_STAGE = "rollout vs pipe"
PIPE = "pipe(output_type='latent')"


def stage_budgets(size: str, stages: list[str], every: float | None = None) -> dict[str, float]:
    """Start-up allowance and each of `stages`' limit in seconds (`every`: the same limit for every stage)."""
    table = BUDGET_S[size]
    return {"start-up": table["start-up"], **{s: every if every else table[s] for s in stages}}


def budget_line(budgets: dict[str, float], limit: float) -> str:
    """The plan printed before the run starts: the sum of the budgets against the time limit."""
    stages = [v for k, v in budgets.items() if k != "start-up"]
    total = sum(budgets.values())
    head = (f"time budget: start-up {budgets['start-up']:g} s + {len(stages)} stages "
            f"({' + '.join(f'{v:g}' for v in stages)} = {sum(stages):g} s) = {total:g} s")
    if total <= limit - END_RESERVE_S:
        return (f"{head}, within the {limit:g} s time limit ({limit - total:g} s to spare, {END_RESERVE_S} s of it "
                "for the end)")
    return (f"{head}: OVER the {limit:g} s time limit less {END_RESERVE_S} s for the end; the last stages get only "
            f"the time left, and none starts with less than {MIN_STAGE_S} s")


# ---------------------------------------------------------------------------------- running a stage

class StageTimeout(Exception):
    """A stage's own time budget ran out (raised by time_limit's alarm)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, alarm: dict | None = None):
    """Raise StageTimeout in this (main) thread after `seconds` (between Python operations), and again every
    ALARM_REPEAT_S if the block catches it and goes on; `alarm["fired"]` says whether it went off, whatever the
    exception it became on the way out (a wrapper may drop it from the chain)."""
    alarm = {} if alarm is None else alarm
    alarm["fired"] = False
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield alarm
        return

    def stop(signum, frame):
        alarm["fired"] = True
        raise StageTimeout(f"the stage budget of {seconds:g} s ran out")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
    try:
        yield alarm
    finally:
        while True:  # disarmed before the old handler is back, even if the alarm goes off right here (`fired` says so)
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except StageTimeout:
                pass
        signal.signal(signal.SIGALRM, old)


def timeout_in_chain(exc: BaseException) -> StageTimeout | None:
    """The StageTimeout that `exc` is or wraps: its __cause__ / __context__ chain walked (torch.compile raises
    BackendCompilerFailed `from None`, which keeps the timeout as __context__), or None."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StageTimeout):
            return e
        todo += [e.__cause__, e.__context__]
    return None


def one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def failure_row(stage: str, method: str, exc: BaseException, budget: float | None, fired: bool = False) -> dict:
    """The FAILED row of a stage that raised `exc`: its type and a one-line message; a timeout (the stage's own
    alarm, found in the exception chain or known to have fired) says it was the stage budget, and as what it
    surfaced (BackendCompilerFailed inside torch.compile, RewardError inside a reward call, ...)."""
    kind = type(exc).__name__
    row = {"stage": stage, "method": method, "status": "FAILED", "error_type": kind, "timed_out": False}
    if timeout_in_chain(exc) is not None or fired:
        row["timed_out"] = True
        how = "" if isinstance(exc, StageTimeout) else f", surfaced as {kind}"
        row["error"] = f"timed out: the stage budget of {budget:g} s ran out (StageTimeout{how})"
    else:
        row["error"] = one_line(f"{kind}: {exc}")
    return row


def free_memory(device: str) -> None:
    """Between stages: what a stage (or its exception's frames) held goes, and the CUDA cache with it."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_stage(rows: list[dict], stage: str, method: str, fn, budget: float, deadline: float, device: str,
              force: str | None = None) -> None:
    """`fn(rows)` (it appends its rows) under min(budget, time left before `deadline`): any exception becomes a
    FAILED row and the run goes on; memory is freed after. `force` ("error" or "timeout", from --fail-stage) makes
    the stage fail on purpose: an error at its start, or a budget so short that the alarm fires inside its work."""
    left = deadline - time.monotonic()
    if left < MIN_STAGE_S:
        rows.append({"stage": stage, "method": method, "status": "SKIPPED",
                     "error": f"not started: {max(left, 0):.0f} s left before the time limit"})
        print(f"{method}: {rows[-1]['error']}", flush=True)
        return
    limit = 0.05 if force == "timeout" else min(budget, left)
    reset_peak(device)
    t, alarm, n = time.perf_counter(), {}, len(rows)
    try:
        with time_limit(limit, alarm):
            if force == "error":
                raise RuntimeError(f"forced failure of {method!r} (--fail-stage)")
            fn(rows)
        if alarm["fired"]:  # something inside caught the StageTimeout and the stage ran on: not within its budget
            del rows[n:]
            raise StageTimeout(f"the stage budget of {limit:g} s ran out")
    except Exception as e:  # OOM, compile, config, timeout in any wrapper: this stage's row, then the next stage
        rows.append(failure_row(stage, method, e, limit, alarm.get("fired", False)))
        rows[-1]["peak_gib"] = peak_gib(device)
    rows[-1]["seconds_stage"] = time.perf_counter() - t
    free_memory(device)
    print(f"{method}: {rows[-1]}", flush=True)


# ---------------------------------------------------------------------------------- measuring

def timed(fn, device: str, repeats: int) -> float:
    """Mean seconds of `repeats` calls after one warm-up call (difrl.quant.timing.time_ms: CUDA events on a GPU)."""
    from difrl.quant.timing import time_ms

    return statistics.mean(time_ms(fn, 1, repeats, device)) / 1e3


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


# ---------------------------------------------------------------------------------- stage 1: rollout vs pipe()

def rollout_vs_pipe(path: Path, size: str, device: str, dtype: str, out: list[dict]) -> float:
    """pipe() vs difrl's rollout on one loaded pipeline, a row appended to `out` per timing as it is measured (a
    stage cut short keeps them); returns the FLOPs of one transition's forward + backward through the LoRA-wrapped
    transformer (for the update's TFLOP/s)."""
    from torch.utils.flop_counter import FlopCounterMode

    from difrl.models.adapters import load_flow_policy
    from difrl.rollout import initial_latents, rollout
    from difrl.train.config import LoraConfig
    from difrl.train.scaffold import wrap_policy

    r = RUN[size]
    policy = load_flow_policy("sd3", path, dtype=dtype, height=r["side"], width=r["side"], device=device,
                              max_sequence_length=16, cache_prompts=True)
    B, N = r["pipe_batch"], r["steps"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(B)]
    seeds = torch.arange(B)
    sigmas = policy.sigma_schedule(N)
    latents = initial_latents(seeds, policy.latent_shape, device).to(policy.dtype)
    train_mask = torch.ones(N, dtype=torch.bool)
    train_mask[-1] = False
    pipe = policy.pipe

    def run_pipe():
        pipe(prompts, height=r["side"], width=r["side"], num_inference_steps=N, guidance_scale=1.0, latents=latents,
             output_type="latent", max_sequence_length=16)

    def run_rollout(kind: str):
        def go():
            rollout(policy, prompts, seeds, sigmas, kind, {"noise_level": 0.7} if kind != "ode" else None,
                    sde_mask=None if kind != "ode" else torch.zeros(N, dtype=torch.bool),
                    train_mask=train_mask if kind != "ode" else None)
        return go

    cond = policy.encode(prompts)
    x = latents.float()
    sigma = torch.full((B,), 0.5, device=device)

    def bare_forwards():
        with torch.no_grad():
            for _ in range(N):
                policy._forward(x, sigma, cond, 1.0)

    for name, fn in ((PIPE, run_pipe),
                     (f"rollout() flow_sde, {N - 1} transitions stored (the trainer's)", run_rollout("flow_sde")),
                     ("rollout() ode", run_rollout("ode")), (f"{N} bare transformer forwards", bare_forwards)):
        out.append({"stage": "rollout_vs_pipe", "method": name, "seconds": timed(fn, device, r["repeats"])})

    # FLOPs of one trained transition (LoRA as the trainer wraps it): forward + backward of a batch of 2, halved
    net, _ = wrap_policy(policy, LoraConfig(rank=r["rank"], alpha=2 * r["rank"]), 0, need_reference=False)
    policy.module = net
    xb, sb, cb = x[:2], sigma[:2], {k: v[:2] for k, v in cond.items()}
    with FlopCounterMode(display=False) as counter:
        policy.velocity(xb, sb, cb).float().square().mean().backward()
    return counter.get_total_flops() / 2


# ---------------------------------------------------------------------------------- stage 2: the trainer

def methods(size: str) -> dict[str, list[str]]:
    """The trainer runs; --quick leaves out model.compile (inductor's CPU compile of even tiny blocks takes minutes on
    2 cores; the wiring is tested in tests/test_train_diffusers.py)."""
    r = RUN[size]
    tree = ["rollout.kind=tree", f"tree.split_steps={json.dumps(r['splits'])}", "tree.factor=2"]
    return {
        "flat GRPO": [],
        "BranchGRPO": tree,
        "BranchGRPO + width/depth pruning": tree + ["tree.width_prune=best_worst", "tree.width_ratio=0.5",
                                                    f"tree.depth_prune={json.dumps(r['depth_prune'])}"],
        "BranchGRPO-Mix": tree + ["steps.mode=fixed_window", "steps.window_start=0", f"steps.window_size={r['window']}"],
        "Sol-RL (fp8_row candidates)": ["rollout.kind=solrl", "rollout.precision=fp8_row", "rollout.quant_backend=auto", f"solrl.candidates={r['candidates']}",
                                    f"solrl.preview_steps={r['preview']}"],
        "flat GRPO + gradient checkpointing": ["model.gradient_checkpointing=true"],
        **({"flat GRPO + compile": ["model.compile=true"]} if size == "full" else {}),
    }


def trainer_config(path: Path, size: str, dtype: str, prompts: int, extra: list[str]):
    from difrl.train.config import load_flow_config

    r = RUN[size]
    return load_flow_config(ROOT / "configs" / "sd3_tiny.yaml", [
        f"model.path={path}", f"model.height={r['side']}", f"model.width={r['side']}", f"model.dtype={dtype}",
        "model.max_sequence_length=16", f"model.prompts={json.dumps(PROMPTS[:max(prompts, 1)])}",
        f"model.eval_prompts={json.dumps(PROMPTS[:1])}", f"sampler.num_steps={r['steps']}", "sampler.noise_level=0.7",
        f"rollout.prompts_per_iter={prompts}", f"rollout.group_size={r['leaves']}", "rollout.same_init_noise=false",
        "train.iterations=2", f"train.micro_batch={r['micro']}", "train.grad_accum=1", "train.kl_beta=0",
        f"train.lora.rank={r['rank']}", f"train.lora.alpha={2 * r['rank']}", "train.lr=1e-4",
        "eval.every=0", "eval.per_digit=1", "eval.num_steps=2", "checkpoint_every=0", *extra])


def trainer_row(name: str, run_dir: Path, device: str, flops_per_transition: float | None, guidance_nfe: int) -> dict:
    """The trainer's second iteration from its metrics.jsonl; no TFLOP/s where the FLOPs were not counted (the
    rollout stage failed)."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]  # the second iteration: compiled, allocator warm
    transitions = last["nfe_train"] / guidance_nfe  # recomputed (trained) transitions this iteration
    update_tflops = (None if flops_per_transition is None
                     else flops_per_transition * transitions / last["seconds_update"] / 1e12)
    row = {"stage": "trainer", "method": name, "seconds_iter": last["seconds"], "seconds_rollout": last["seconds_rollout"],
           "seconds_update": last["seconds_update"], "seconds_first_iter": rows[0]["seconds"],
           "nfe_rollout": last.get("nfe_full", 0) + last.get("nfe_lowprec", 0), "nfe_lowprec": last.get("nfe_lowprec", 0),
           "transitions_trained": transitions, "update_tflops": update_tflops, "peak_gib": peak_gib(device)}
    if "seconds_candidates" in last:
        row["seconds_candidates"] = last["seconds_candidates"]
        row["candidate_s_per_forward"] = last["seconds_candidates"] / max(last["nfe_lowprec"], 1)
        row["regenerate_s_per_forward"] = last["seconds_regenerate"] / max(last["nfe_full"], 1)
    if "seconds_sampling" in last:
        row["rollout_s_per_forward"] = last["seconds_sampling"] / max(last.get("nfe_full", 0), 1)
    return row


# ---------------------------------------------------------------------------------- the run

TITLE = "GPU: rollouts and trainer iterations at 2B scale (bench_gpu)"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "tiny dimensions on the CPU in about a minute")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per iteration (default 2; --quick 1)")
    ap.add_argument("--stage-timeout", type=float, default=None,
                    help="seconds every stage may take (default: each stage's own budget, BUDGET_S)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                    help=f"seconds the whole run may take, start-up included (default {TIME_LIMIT_S}, gpu_check.sh's "
                         "timeout): no stage runs past it")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the trainer methods")
    # testing: make a stage fail on purpose, NAME or NAME:timeout (its budget cut so the alarm fires in its work)
    ap.add_argument("--fail-stage", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    cuda = torch.cuda.is_available() and not args.quick
    if not args.quick and not cuda:
        ap.error("the full run needs a CUDA GPU (the CPU runs --quick)")
    device, dtype = ("cuda:0", "bf16") if cuda else ("cpu", "fp32")
    prompts = args.prompts or (2 if not args.quick else 1)
    chosen = methods(size)
    if args.methods:
        chosen = {k: v for k, v in chosen.items() if k in args.methods.split(",")}
    stages = [ROLLOUT_STAGE, *chosen]
    force = {name: kind or "error" for name, _, kind in (f.partition(":") for f in args.fail_stage)}
    if set(force) - set(stages) or set(force.values()) - {"error", "timeout"}:
        ap.error(f"--fail-stage {args.fail_stage}: NAME or NAME:timeout, NAME one of {stages}")
    budgets = stage_budgets(size, stages, args.stage_timeout)
    print(budget_line(budgets, args.time_limit), flush=True)
    deadline = STARTED + args.time_limit - END_RESERVE_S

    from difrl.train.flow.trainer import train

    meta = {"stage": "meta", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "diffusers": __import__("diffusers").__version__, "date": _dt.date.today().isoformat(), "size": size,
            "prompts": prompts, "leaves": RUN[size]["leaves"], "steps": RUN[size]["steps"], "dtype": dtype,
            "time_limit_s": args.time_limit, "budget_s": budgets, "stages": stages, "finished": [],
            "flops_per_transition": None}
    rows: list[dict] = [meta]

    def save(final: bool = False) -> None:  # after every stage: a run cut off from outside keeps what it measured
        add_ratios(rows)
        publish(args, BEGIN, END, TITLE, "bench_gpu.py", argv, report(rows), rows, echo=final)

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        path = Path(tmp) / "pipe"
        try:
            pipe = build_pipeline(size, device, torch.bfloat16 if dtype == "bf16" else torch.float32)
            meta["transformer_params"] = sum(p.numel() for p in pipe.transformer.parameters())
            pipe.save_pretrained(path)
            del pipe
        except Exception as e:  # nothing can run without the pipeline: say why, in the JSON too
            meta.update(failure_row("meta", "build", e, None), stage="meta")
            print(f"building the pipeline failed: {meta['error']}", flush=True)
            save(final=True)
            return rows
        free_memory(device)
        meta["seconds_startup"] = time.monotonic() - STARTED
        print(f"built and saved the pipeline ({meta['transformer_params'] / 1e9:.2f}B transformer); start-up took "
              f"{meta['seconds_startup']:.1f} s of its {budgets['start-up']:g} s allowance", flush=True)

        def measure_rollouts(out: list[dict]) -> None:
            meta["flops_per_transition"] = rollout_vs_pipe(path, size, device, dtype, out)

        def trainer_stage(name: str, extra: list[str]):
            def go(out: list[dict]) -> None:
                run_dir = Path(tmp) / f"run{stages.index(name)}"
                train(trainer_config(path, size, dtype, prompts, extra), out_dir=run_dir)
                out.append(trainer_row(name, run_dir, device, meta["flops_per_transition"], 1))
            return go

        work = {ROLLOUT_STAGE: ("rollout_vs_pipe", measure_rollouts),
                **{name: ("trainer", trainer_stage(name, extra)) for name, extra in chosen.items()}}
        for name, (stage, fn) in work.items():
            run_stage(rows, stage, name, fn, budgets[name], deadline, device, force.get(name))
            meta["finished"].append(name)
            save()
    save(final=True)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each rollout row's seconds over pipe()'s (`x_pipe`) and each trainer row's seconds per iteration over flat
    GRPO's (`x_flat`), in place: the baselines are measured in the same run. Where a baseline is missing (failed, cut
    off, not chosen) no row gets that ratio, and the meta row's `no_ratio` says why."""
    pipe = next((r for r in rows if r.get("method") == PIPE and "seconds" in r), None)
    flat = next((r for r in rows if r.get("method") == "flat GRPO" and "seconds_iter" in r), None)
    missing = {}
    for key, base, stage, value, name in (("x_pipe", pipe, "rollout_vs_pipe", "seconds", PIPE),
                                          ("x_flat", flat, "trainer", "seconds_iter", "flat GRPO")):
        measured = [r for r in rows if r.get("stage") == stage and value in r]
        for r in measured:
            r.pop(key, None)
            if base:
                r[key] = r[value] / base[value]
        if measured and not base:
            failed = next((r for r in rows if r.get("method") == name and "error" in r), None)
            missing[key] = (f"No {key} ratios: the {name} baseline " +
                            (f"{failed['status']} ({failed['error']})" if failed else "was not measured in this run"))
    meta = next((r for r in rows if r.get("stage") == "meta"), None)
    if meta is not None:
        meta["no_ratio"] = missing
    return rows


def _failed(r: dict) -> str:
    return f"{r.get('status', 'FAILED')}: {r['error']}".replace("|", "/")


def report(rows: list[dict]) -> list[str]:
    """The block's lines: every number and sentence computed from `rows` (a failed stage shows its error and no
    claim; a stage not reached when the block was written is named)."""
    meta = rows[0]
    params = meta.get("transformer_params")
    size = f"of {params / 1e6:,.1f}M parameters " if params else ""
    lines = [f"Device {meta['device']}, torch {meta['torch']}, diffusers {meta['diffusers']}, {meta['date']}; "
             f"SD3.5-Medium-shaped transformer {size}(random weights), "
             f"{meta['dtype']}, {meta['steps']} steps, {meta['prompts']} prompt(s) x {meta['leaves']} leaves per iteration."]
    if "error" in meta:
        return lines + ["", f"Building the pipeline {_failed(meta)}; no stage ran."]
    lines += ["", "| rollout | seconds | x pipe() |", "|---|---:|---:|"]
    for r in rows:
        if r.get("stage") == "rollout_vs_pipe":
            lines.append(f"| {r['method']} | {_failed(r)} | |" if "error" in r else
                         f"| {r['method']} | {cell(r.get('seconds'), '.3f')} | {cell(r.get('x_pipe'))} |")
    lines += ["", "| method | s / iter | x flat | rollout s | update s | rollout NFE | trained transitions | "
                  "update TFLOP/s | peak GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("stage") != "trainer":
            continue
        if "error" in r:
            lines.append(f"| {r['method']} | {_failed(r)} | | | | | | | {cell(r.get('peak_gib'), '.1f')} |")
            continue
        lines.append(f"| {r['method']} | {cell(r.get('seconds_iter'))} | {cell(r.get('x_flat'))} | "
                     f"{cell(r.get('seconds_rollout'))} | {cell(r.get('seconds_update'))} | "
                     f"{cell(r.get('nfe_rollout'), '.0f')} | {cell(r.get('transitions_trained'), '.0f')} | "
                     f"{cell(r.get('update_tflops'), '.3g')} | "
                     f"{cell(r.get('peak_gib'), '.1f')} |")
    lines += ["", *budget_sentences(rows), *readings(rows)]
    return lines


def budget_sentences(rows: list[dict]) -> list[str]:
    """What the time budget was and what came of it: stages failed, cut off or not reached, ratios left out."""
    meta = rows[0]
    out = []
    budgets = meta.get("budget_s")
    if budgets:
        out.append(f"- Time budget {sum(budgets.values()):g} s (start-up {budgets['start-up']:g} s + "
                   f"{len(budgets) - 1} stages) under a {meta['time_limit_s']:g} s limit"
                   + (f"; start-up took {meta['seconds_startup']:.0f} s." if "seconds_startup" in meta else "."))
    failed = [r for r in rows if r.get("stage") != "meta" and "error" in r]
    if failed:
        out.append(f"- {len(failed)} stage(s) did not finish (their errors are in the tables; nothing below is "
                   f"claimed from them): {', '.join(r['method'] for r in failed)}.")
    not_reached = [s for s in meta.get("stages", []) if s not in meta.get("finished", [])]
    if not_reached:
        out.append(f"- Not reached when this block was written (the run was still going or was cut off): "
                   f"{', '.join(not_reached)}.")
    out += [f"- {note}." for note in meta.get("no_ratio", {}).values()]
    return out


def _target(value: float, target: float) -> str:
    return f"target <= {target:g}: {'met' if value <= target else 'missed'}"


def readings(rows: list[dict]) -> list[str]:
    """Sentences computed from the rows: each compares what the issues' targets compare (issues 29, 30)."""
    out = []
    meta = rows[0]
    by = {r["method"]: r for r in rows if "method" in r and "error" not in r}  # a failed stage claims nothing
    train = next((r for m, r in by.items() if m.startswith("rollout() flow_sde")), None)
    if train and "x_pipe" in train:
        out.append(f"- difrl's rollout as the trainer calls it took {train['x_pipe']:.3f}x pipe() on the same pipeline "
                   f"({_target(train['x_pipe'], 1.03)}).")
    flat = by.get("flat GRPO")
    for name, target in (("BranchGRPO", 0.45), ("BranchGRPO + width/depth pruning", 0.25), ("BranchGRPO-Mix", 0.25)):
        r = by.get(name)
        if flat and r and "x_flat" in r:
            out.append(f"- {name}: {r['x_flat']:.2f}x flat GRPO's seconds per iteration at equal leaves and the same "
                       f"train.micro_batch ({_target(r['x_flat'], target)}).")
    sol = by.get("Sol-RL (fp8_row candidates)")
    if sol and flat and "candidate_s_per_forward" in sol and "rollout_s_per_forward" in flat:
        ratio = sol["candidate_s_per_forward"] / flat["rollout_s_per_forward"]
        out.append(f"- Sol-RL's fp8_row candidate stage cost {ratio:.2f}x a {meta['dtype']} rollout per forward "
                   f"({_target(ratio, 0.75)}).")
    for name in ("flat GRPO + gradient checkpointing", "flat GRPO + compile"):
        r = by.get(name)
        if flat and r and "seconds_iter" in r and r.get("peak_gib") is not None:
            out.append(f"- {name}: {r['seconds_iter'] / flat['seconds_iter']:.2f}x the seconds per iteration, "
                       f"peak memory {r['peak_gib']:.1f} vs {flat['peak_gib']:.1f} GiB (first iteration "
                       f"{r['seconds_first_iter']:.1f} s).")
    return out


if __name__ == "__main__":
    main()
