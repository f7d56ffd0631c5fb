"""Several trainings one after another in one launch, so that a test pays a launch's start-up once.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 tests/many_runs.py PLAN_JSON
    PLAN_JSON: [{"kind": "sd3", "argv": [...]}, {"kind": null, "argv": ["train", ...], "env": {"FSDP_OFFLOAD_PARAMS": "true"}}]

Each entry runs what its command would run: `kind` names an entry script's model kind (difrl.train.entry.main(kind,
argv): scripts/train_sd3.py ...), null means the difrl command line (difrl.cli.main(argv): `python -m difrl ...`).
`env` is set for that run only (what `accelerate launch --fsdp_offload_params true` would have set; the trainers read
the FSDP settings from the environment at start). Any argument after PLAN_JSON is ignored (tests/test_fsdp.py's `run`
appends --out).

Why the process group is kept: accelerate's end_training destroys it at the end of each run, and a second
init_process_group in the same launch waits for ever on the launcher's store. Every run of a plan asks for the same
group (one launch, one backend), so the first one's is kept for the next ones.
"""

from __future__ import annotations

import json
import os
import sys


def main(plan: list[dict]) -> None:
    from accelerate.state import PartialState

    from difrl.cli import main as difrl
    from difrl.train.entry import main as entry

    PartialState.destroy_process_group = lambda self, group=None: None
    for run in plan:
        env = run.get("env", {})
        held = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            code = entry(run["kind"], run["argv"]) if run.get("kind") else difrl(run["argv"])
        finally:
            for k, v in held.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if code:
            raise SystemExit(f"many_runs: {run} ended with status {code}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
