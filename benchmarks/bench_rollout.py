"""Rollout cost: each step kernel with log-probs (difrl.rollout) vs a plain ODE loop, same model and batch.

    .venv/bin/python benchmarks/bench_rollout.py            # full run (~2-3 min on 2 cores), updates BENCHMARKS.md
    .venv/bin/python benchmarks/bench_rollout.py --quick --json /tmp/rollout.json --no-write

The baseline is what a user would write to sample the model: ``x = randn``, then 10 Euler steps
``x += (sigma_next - sigma) * v``. The contenders are ``difrl.rollout.rollout`` with each kernel
over the Flow-GRPO step mask (SDE on all steps but the last, every SDE transition stored with its
log-prob and mean, per-sample noise from (seed, step)): everything the trainer needs from a rollout.
Methods are timed round-robin (one repeat of each in turn) so that machine drift hits all alike;
the table reports the median and the ratio to the baseline's median. Goal: ratio <= 1.05.

Two models: the bundled digits generator (the demo's, tiny: the sampler's own cost is most
visible here) and the same architecture widened (hidden 1024, 4 blocks; random weights) where the
network dominates, as it does for any real image model.
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

from difrl.models.digits import DigitsFlowNet, DigitsNetConfig, DigitsPolicy, digit_prompt
from difrl.rollout import rollout
from difrl.samplers import all_but_last, sigma_schedule

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_rollout:start -->", "<!-- bench_rollout:end -->"
KERNEL_KWARGS = {"ode": {}, "flow_sde": {"noise_level": 0.7}, "dance_sde": {"noise_level": 0.3}, "cps": {"noise_level": 0.8}}


def plain_ode_loop(policy, cond, sigmas, batch: int, gen: torch.Generator) -> torch.Tensor:
    """The baseline: sample x ~ N(0, I) and take Euler steps, nothing stored."""
    x = torch.randn(batch, *policy.latent_shape, generator=gen)
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(batch)
        x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigma, cond)
    return x


def make_methods(policy, batch: int, num_steps: int):
    prompts = [digit_prompt(i % 10) for i in range(batch)]
    cond = policy.encode(prompts)
    sigmas = sigma_schedule(num_steps)
    mask = all_but_last(num_steps)
    gen = torch.Generator().manual_seed(0)
    counter = iter(range(10**9))

    def engine(kernel):
        def run():
            seeds = torch.arange(batch) + next(counter) * batch
            train = mask if kernel != "ode" else None
            return rollout(policy, prompts, seeds, sigmas, kernel=kernel, kernel_kwargs=KERNEL_KWARGS[kernel],
                           sde_mask=mask if kernel != "ode" else None, train_mask=train)
        return run

    methods = {"plain ODE loop (baseline)": lambda: plain_ode_loop(policy, cond, sigmas, batch, gen)}
    methods["rollout ode"] = engine("ode")
    for k in ("flow_sde", "dance_sde", "cps"):
        methods[f"rollout {k} + log-probs"] = engine(k)
    return methods


@torch.no_grad()
def bench(methods: dict, repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | method | ms / rollout (median) | IQR ms | × baseline |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | {r['median_ms']:.2f} | {r['iqr_ms']:.2f} | "
                     f"{r['ratio']:.3f} |")
    return "\n".join(lines)


def write_markdown(rows: list[dict], command: str, path: Path) -> None:
    block = "\n".join([
        BEGIN,
        "## Rollout: kernels with log-probs vs a plain ODE loop",
        "",
        f"Command: `{command}`  ",
        f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}  ",
        f"Machine: {machine()}",
        "",
        "10 steps, SDE on all steps but the last (9 stored transitions per sample). Goal: × baseline ≤ 1.05.",
        "",
        table(rows),
        END,
    ])
    write_block(path, BEGIN, END, block.split("\n")[1:-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    standard_args(ap, "fewer repeats (well under a minute)")
    ap.add_argument("--repeats", type=int, help="timed repeats per method (default 40, --quick 8)")
    ap.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()), help="torch threads (default 2, CI's cores)")
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--models", nargs="+", choices=("digits", "digits-wide"), default=["digits", "digits-wide"])
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 160])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (8 if args.quick else 40)

    torch.manual_seed(0)
    builders = {
        "digits": ("digits (bundled, 0.6M params)", DigitsPolicy.from_checkpoint),
        "digits-wide": ("digits-wide (hidden 1024, 4 blocks, 48M params)",
                        lambda: DigitsPolicy(DigitsFlowNet(DigitsNetConfig(hidden=1024, blocks=4)))),
    }
    models = {builders[m][0]: builders[m][1]() for m in args.models}
    rows = []
    for model_name, policy in models.items():
        policy.module.eval()
        for batch in args.batches:
            times = bench(make_methods(policy, batch, args.num_steps), repeats)
            base = statistics.median(times["plain ODE loop (baseline)"])
            for method, ts in times.items():
                q = statistics.quantiles(ts, n=4)
                med = statistics.median(ts)
                rows.append({"model": model_name, "batch": batch, "method": method, "median_ms": 1e3 * med,
                             "iqr_ms": 1e3 * (q[2] - q[0]), "ratio": med / base, "repeats": repeats,
                             "num_steps": args.num_steps, "threads": args.threads})
                print(f"{model_name:38s} B={batch:4d} {method:32s} {1e3 * med:9.2f} ms  x{med / base:.3f}", flush=True)

    command = "python benchmarks/bench_rollout.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_write:
        write_markdown(rows, command.strip(), ROOT / "BENCHMARKS.md")
        print(f"table written to {ROOT / 'BENCHMARKS.md'}")
    return rows


if __name__ == "__main__":
    main()
