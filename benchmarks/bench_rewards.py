"""Reward plug-ins: samples per second of each built-in, and scoring overlapped with sampling vs serial.

    .venv/bin/python benchmarks/bench_rewards.py --json benchmarks/results/bench_rewards.json   # ~6 min, 2 cores
    .venv/bin/python benchmarks/bench_rewards.py --quick --json /tmp/r.json                    # ~1.5 min, no write

Part 1 (throughput): every built-in reward is built through the plug-in path (`build_reward`) on
TINY randomly initialised backbones saved in the real file layout (difrl.rewards.tiny; OCR runs its
real bundled PP-OCRv6 models, GenEval the synthetic detector), and scores `--batch` images; the
baseline in the same run is the same reward called one image at a time (what hpsv2's `score`,
ImageReward's `inference_rank` and DanceGRPO's loop do). Tiny-backbone rates measure difrl's
overhead (preprocessing, tokenisation, chunking), not a real model's cost.

Part 2 (overlap): configs/digits.yaml with its rollout in `--chunks` chunks, trained with
`reward.overlap` false (serial) and true (chunk k decoded and scored in a thread while chunk k + 1
samples), the two modes run back to back per seed. The measure is the seconds an iteration spends
sampling and waiting for its rewards (`seconds_rollout + seconds_reward`: the phases overlap can
change; the policy update after them is the same work either way and on a shared CPU its timing
noise would swamp the difference), median over iterations after the first, per seed, then mean ±
sample standard deviation over seeds, and the ratio overlapped / serial per seed; whole seconds per iteration are
reported beside it. Two rewards: the digits world's
own classifier (cheap: a few ms per iteration) and the same classifier behind a simulated 40 ms
latency per chunk (`time.sleep`, a stand-in for a remote reward server; it holds no CPU). The
metrics of the two modes are compared too: overlap must not change a single number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, sample_std, standard_args, threads_override  # noqa: E402

from difrl.rewards import REWARDS, build_reward, register_reward  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_rewards:start -->", "<!-- bench_rewards:end -->"
LATENCY_S = 0.04


@register_reward("bench_slow_digit_prob")
def slow_digit_prob(latency_s: float = LATENCY_S):
    """digit_prob after a sleep per call: an I/O-bound reward (a remote server's latency) that holds no CPU."""
    inner = build_reward("digit_prob")

    def score(images, prompts, metadata):
        time.sleep(latency_s)
        return {"bench_slow_digit_prob": inner(images, prompts, metadata)["digit_prob"]}

    return score


# ------------------------------------------------------------------------------- part 1: throughput


def text_images(texts: list[str], h: int = 96, w: int = 320) -> torch.Tensor:
    """[B, 3, h, w] in [0, 1]: black text on white, drawn by Pillow (OCR's input)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=40)
    out = []
    for t in texts:
        img = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(img).text((12, 24), t, fill="black", font=font)
        out.append(torch.tensor(list(img.getdata()), dtype=torch.float32).view(h, w, 3).permute(2, 0, 1) / 255)
    return torch.stack(out)


def workloads(root: Path, batch: int) -> list[tuple[str, str, dict, torch.Tensor, list[str], list[dict]]]:
    """(label, reward name, options, samples, prompts, metadata) for every built-in."""
    from difrl.rewards.tiny import tiny_reward_options

    g = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, 64, 64, generator=g)
    prompts = [f"a photo of a {c}" for c in ("cat", "dog", "red car", "tree")] * (batch // 4 + 1)
    prompts = prompts[:batch]
    tiny = tiny_reward_options(root)
    geneval_meta = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "exclude": [],
                     "detections": [{"class": "cat", "score": 0.9, "box": [4, 4, 40, 40]}]} for _ in range(batch)]
    ocr_texts = [f"SALE {i:02d}" for i in range(max(1, batch // 4))]
    rows = [(f"{n} (tiny backbone)", n, tiny[n], images, prompts, [{}] * batch)
            for n in ("clip_score", "pickscore", "aesthetic", "hpsv2")]
    rows += [
        ("ocr (bundled PP-OCRv6, 96x320 text images)", "ocr", {}, text_images(ocr_texts),
         [f'a sign that says "{t}"' for t in ocr_texts], [{}] * len(ocr_texts)),
        ("jpeg_compressibility (Pillow, q95)", "jpeg_compressibility", {}, images, prompts, [{}] * batch),
        ("geneval (synthetic detector)", "geneval", {"detector": "synthetic"}, images, prompts, geneval_meta),
        ("digit_prob (bundled CNN, 8x8)", "digit_prob", {}, images[:, :1, :8, :8], [f"a handwritten {i % 10}" for i in range(batch)],
         [{}] * batch),
        ("video over 8 frames (tiny clip_score, mean)", "video",
         {"image_reward": "clip_score", "image_options": tiny["clip_score"]},
         images[: max(1, batch // 8), None].expand(-1, 8, -1, -1, -1).contiguous(), prompts[: max(1, batch // 8)],
         [{}] * max(1, batch // 8)),
    ]
    return rows


def rate(fn, samples, prompts, metadata, repeats: int) -> float:
    """Samples per second: the median of `repeats` timed calls after one warm-up."""
    fn(samples, prompts, metadata)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(samples, prompts, metadata)
        times.append(time.perf_counter() - t)
    return len(prompts) / statistics.median(times)


def throughput(batch: int, repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, name, options, samples, prompts, meta in workloads(Path(d), batch):
            batched = build_reward(name, **options)
            one = lambda s, p, m, f=batched: [f(s[i:i + 1], p[i:i + 1], m[i:i + 1]) for i in range(len(p))]  # noqa: E731
            r_batched = rate(batched, samples, prompts, meta, repeats)
            r_one = rate(one, samples, prompts, meta, repeats)
            rows.append({"part": "throughput", "reward": label, "batch": len(prompts),
                         "samples_per_s": round(r_batched, 1), "one_at_a_time_per_s": round(r_one, 1),
                         "batched_speedup": round(r_batched / r_one, 2)})
            print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------- part 2: overlap


def overlap_runs(seeds: list[int], iterations: int, chunks: int, threads: int = 0) -> list[dict]:
    """threads: the runs' torch threads (config `threads`); 0: the config's default (common.threads_override)."""
    from difrl.train.config import load_flow_config
    from difrl.train.flow.trainer import TIMING_KEYS, train

    rows = []
    for reward in ("digit_prob", "bench_slow_digit_prob"):
        per_mode: dict[str, list[float]] = {}
        same = True
        for seed in seeds:
            metrics = {}
            for overlap in (False, True):
                with tempfile.TemporaryDirectory() as d:
                    cfg = load_flow_config(ROOT / "configs" / "digits.yaml", [
                        f"seed={seed}", f"train.iterations={iterations}", "eval.every=0", f"rollout.chunks={chunks}",
                        f"reward.overlap={str(overlap).lower()}", f"reward.weights={{{reward}: 1.0}}",
                        *threads_override(threads)])
                    train(cfg, out_dir=Path(d) / "run")
                    lines = [json.loads(ln) for ln in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
                # first iteration: warm-up
                phase = [r["seconds_rollout"] + r["seconds_reward"] for r in lines[1:]]
                whole = [r["seconds"] - r.get("seconds_eval", 0.0) for r in lines[1:]]
                per_mode.setdefault(str(overlap), []).append(statistics.median(phase))
                per_mode.setdefault(f"{overlap}_whole", []).append(statistics.median(whole))
                metrics[overlap] = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in lines]
            same &= metrics[False] == metrics[True]
        serial, over = per_mode["False"], per_mode["True"]
        ratios = [o / s for o, s in zip(over, serial)]
        whole = {m: statistics.mean(per_mode[f"{m}_whole"]) for m in ("False", "True")}
        rows.append({"part": "overlap", "reward": reward if reward == "digit_prob" else
                     f"digit_prob + {LATENCY_S * 1000:.0f} ms simulated latency per chunk",
                     "chunks": chunks, "iterations": iterations, "seeds": len(seeds),
                     "serial_rollout_reward_s": round(statistics.mean(serial), 4),
                     "serial_std": round(sample_std(serial), 4),
                     "overlap_rollout_reward_s": round(statistics.mean(over), 4),
                     "overlap_std": round(sample_std(over), 4),
                     "serial_s_per_iter": round(whole["False"], 4), "overlap_s_per_iter": round(whole["True"], 4),
                     "ratio_mean": round(statistics.mean(ratios), 3), "ratio_min": round(min(ratios), 3),
                     "ratio_max": round(max(ratios), 3), "metrics_identical": same})
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------- report


def verdict(r: dict) -> str:
    """A sentence computed from the row: faster / slower only when every seed's ratio is on that side of 1."""
    spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    if r["ratio_max"] < 1.0:
        word = f"overlapped is faster than serial (every seed's ratio below 1: {spread})"
    elif r["ratio_min"] > 1.0:
        word = f"overlapped is slower than serial (every seed's ratio above 1: {spread})"
    else:
        word = f"no clear difference between overlapped and serial (seed ratios {spread} straddle 1)"
    return (f"- {r['reward']}, sampling + scoring: {word}; the metrics of the two modes are "
            f"{'identical' if r['metrics_identical'] else 'DIFFERENT'}.")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "2 seeds x 6 iterations, 3 repeats (about 1.5 min); never writes BENCHMARKS.md")
    ap.add_argument("--batch", type=int, help="samples per call (default 32; --quick 16)")
    ap.add_argument("--repeats", type=int, help="timed calls per rate (default 5; --quick 3)")
    ap.add_argument("--seeds", type=int, help="overlap seeds (default 3; --quick 2)")
    ap.add_argument("--iterations", type=int, help="overlap iterations per run (default 30; --quick 6)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads, also the overlap runs' (0: this process all its cores, the runs their config's default)")
    args = ap.parse_args(argv)
    for key, full, quick in (("batch", 32, 16), ("repeats", 5, 3), ("seeds", 3, 2), ("iterations", 30, 6)):
        if getattr(args, key) is None:  # an explicit value wins over --quick's
            setattr(args, key, quick if args.quick else full)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = throughput(args.batch, args.repeats)
    rows += overlap_runs(list(range(args.seeds)), args.iterations, args.chunks, args.threads)

    tp = [r for r in rows if r["part"] == "throughput"]
    ov = [r for r in rows if r["part"] == "overlap"]
    lines = [f"Part 1: every built-in through `build_reward`, {args.batch} samples per call (OCR: {args.batch // 4} "
             "text images, video: clips of 8 frames), median of "
             f"{args.repeats} calls; the baseline is the same reward called one sample at a time. Tiny backbones "
             "(random weights, real file layout) measure difrl's own overhead, not a real model's cost.", "",
             "| reward | samples | samples/s batched | samples/s one at a time | batched / one |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['reward']} | {r['batch']} | {r['samples_per_s']} | {r['one_at_a_time_per_s']} | {r['batched_speedup']}x |"
              for r in tp]
    lines += ["", f"Part 2: `configs/digits.yaml`, rollout in {args.chunks} chunks, {args.iterations} iterations, "
              f"{args.seeds} seeds, serial and overlapped back to back per seed; seconds per iteration spent sampling "
              f"and waiting for rewards (median over iterations 2+, mean ± sample std over the n={args.seeds} seeds); whole iterations (with "
              "the unchanged policy update) beside it.", "",
              "| reward | serial rollout + reward s | overlapped rollout + reward s | overlapped / serial (min-max over "
              "seeds) | whole s/iter serial → overlapped | metrics identical |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['reward']} | {r['serial_rollout_reward_s']:.3f} ± {r['serial_std']:.3f} | "
              f"{r['overlap_rollout_reward_s']:.3f} ± {r['overlap_std']:.3f} | {r['ratio_mean']:.2f} "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['serial_s_per_iter']:.3f} → {r['overlap_s_per_iter']:.3f} | "
              f"{'yes' if r['metrics_identical'] else 'NO'} |" for r in ov]
    lines += ["", *[verdict(r) for r in ov],
              "- Measured on a CPU only (the machine line above): sampling and scoring share its cores, so the thread "
              "mainly hides time a reward spends waiting (the simulated latency), not its compute. Not run on a "
              "GPU, where a reward model would run beside the sampler."]
    publish(args, BEGIN, END, "Reward plug-ins: throughput and overlapped scoring", "bench_rewards.py", argv, lines, rows)
    return rows


if __name__ == "__main__":
    main()
    REWARDS.pop("bench_slow_digit_prob", None)
