"""Plain GRPO vs the default config on the digits world, left running: the over-optimisation table of
docs/guides/methods.md (its block between the overopt markers; PAGE).

    .venv/bin/python scripts/overoptimisation.py                 # 2 x 400 iterations, about 2 minutes on 2 cores
    .venv/bin/python scripts/overoptimisation.py --iterations 200 --no-write --json /tmp/overopt.json

Both runs use the same seeds and have the FD stopping rule switched off, so the table shows what
each objective does by itself; `plain` is the default config with `train.kl_beta=0`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from difrl.train.config import load_flow_config
from difrl.train.flow.trainer import train

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- overopt:start -->", "<!-- overopt:end -->"
PAGE = ROOT / "docs" / "guides" / "methods.md"  # the page whose block this script rewrites
RUNS = {"plain GRPO (kl_beta=0)": ["train.kl_beta=0"], "default (kl_beta=0.5)": []}


def eval_rows(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "eval/fd" in r:
            rows[r["iteration"]] = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("eval/")}
    summary = json.loads((run_dir / "summary.json").read_text())
    rows[0] = summary["eval_before"]
    rows[summary["iterations"]] = summary["eval_after"]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--every", type=int, default=50, help="table rows every this many iterations")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "overopt")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-write", action="store_true", help="do not update the table in docs/guides/methods.md")
    args = ap.parse_args(argv)

    results = {}
    for name, overrides in RUNS.items():
        run_dir = args.out / ("plain" if overrides else "default")
        cfg = load_flow_config(ROOT / "configs" / "digits.yaml",
                               [*overrides, f"train.iterations={args.iterations}", "stop.fd_rise=null", "eval.every=25"])
        train(cfg, out_dir=run_dir, overwrite=True)
        results[name] = eval_rows(run_dir)

    iters = [i for i in sorted(next(iter(results.values()))) if i % args.every == 0 or i == args.iterations]
    lines = ["| iteration | " + " | ".join(f"{n}: accuracy / judge / FD" for n in results) + " |",
             "|---:|" + "---:|" * len(results)]
    for i in iters:
        cells = [f"{r[i]['accuracy']:.3f} / {r[i]['judge_accuracy']:.3f} / {r[i]['fd']:.1f}" for r in results.values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    command = "python scripts/overoptimisation.py" + "".join(" " + a for a in (argv if argv is not None else sys.argv[1:]))
    best = {n: min(r.values(), key=lambda e: e["fd"]) for n, r in results.items()}
    notes = [f"{n}: best FD {b['fd']:.1f}, final FD {r[args.iterations]['fd']:.1f} "
             f"({r[args.iterations]['fd'] / b['fd']:.1f}× its best)" for (n, r), b in zip(results.items(), best.values())]
    table = "\n".join([BEGIN, f"`{command}` (real data diversity {next(iter(results.values()))[0]['real_diversity']:.3f})", "",
                       *lines, "", "; ".join(notes) + ".", END])
    print(table)
    if args.json:
        # per run: its evaluations by iteration, and the derived figures the closing line prints
        derived = {n: {"best_fd": b["fd"], "final_fd": r[args.iterations]["fd"],
                       "final_over_best": round(r[args.iterations]["fd"] / b["fd"], 1)}
                   for (n, r), b in zip(results.items(), best.values())}
        args.json.write_text(json.dumps({**{n: {str(i): e for i, e in r.items()} for n, r in results.items()},
                                         "derived": derived}, indent=1))
    if not args.no_write:
        write_table(PAGE, table)
        print(f"table written to {PAGE}")


def write_table(page: Path, table: str) -> None:
    """Replace the block between BEGIN and END in `page` by `table` (which holds both markers); the rest of the page
    stays as it is. A page without exactly one such block is an error naming it, before anything is written."""
    text = page.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{page} must hold one {BEGIN} ... {END} block for the over-optimisation table "
                         f"(found {text.count(BEGIN)} start and {text.count(END)} end markers)")
    head, rest = text.split(BEGIN, 1)
    page.write_text(head + table + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
