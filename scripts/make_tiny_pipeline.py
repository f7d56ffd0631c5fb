"""Write a tiny random-initialised diffusers pipeline directory (any kind of difrl.models.adapters), built in code.

    python scripts/make_tiny_pipeline.py flux runs/tiny_flux
    python scripts/make_tiny_pipeline.py sd3 runs/tiny_sd3 --seed 1
    python scripts/make_tiny_pipeline.py wan runs/tiny_wan

Every component has the real class and on-disk layout (difrl/models/tiny.py; each family file's
`tiny_pipeline`), so `model.path` pointing here runs the exact real-model code path on a CPU
(configs/flux_tiny.yaml). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from difrl.models.adapters import make_tiny_pipeline, model_kinds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=model_kinds())  # a registered family's too (an entry point: imported when built)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = ap.parse_args(argv)
    path = make_tiny_pipeline(args.kind, args.out_dir, seed=args.seed)
    print(f"tiny {args.kind} pipeline written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
