"""Several trainings one after another in one launch, so that a test pays a launch's start-up once.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 tests/many_runs.py PLAN_JSON
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/many_runs.py PLAN_JSON      # torchrun
    PLAN_JSON: [{"kind": "sd3", "argv": [...]}, {"kind": null, "argv": ["train", ...], "env": {"FSDP_OFFLOAD_PARAMS": "true"}}]

Each entry runs what its command would run: `kind` names an entry script's model kind (difrl.train.entry.main(kind,
argv): scripts/train_sd3.py ...), null means the difrl command line (difrl.cli.main(argv): `python -m difrl ...`).
`env` is set for that run only (what `accelerate launch --fsdp_offload_params true` would have set; the trainers read
the FSDP settings from the environment at start; `accelerate launch --mixed_precision bf16` is
ACCELERATE_MIXED_PRECISION=bf16). Any argument after PLAN_JSON is ignored (tests/test_fsdp.py's `run`
appends --out).

Each run has its own process group, as a separate launch does: accelerate's end_training destroys it, the singletons
of accelerate's state are reset, and the next run's Accelerator initialises a new one (with that run's settings and
environment). One line per run says so ("many_runs: run 2/3 on its own process group ...", tests/test_fsdp.py).

Why a second group needs its own place in the store (torch 2.14, torch/distributed/): under torchrun (accelerate
launch) every process is a client of the launcher's TCPStore, which lives for the whole launch (rendezvous.py:204,
_agent_store_serves: TORCHELASTIC_USE_AGENT_STORE). init_process_group names the default group by a counter
(distributed_c10d.py:2512, 6521: str(_world.group_count)), which destroy_process_group resets to 0
(distributed_c10d.py:3040), and keys the group's rendezvous by that name under "default_pg" (2551, 2734, 2764):
gloo's address keys are default_pg/0//cpu//0/<rank> for every group of the launch. A second group reads the first
one's addresses, left in the store, at once and connects to listeners that closed with it ("Gloo connectFullMesh
failed ... Connection refused" after retries on a short timeout; with the default 30-minute timeout the launch
waits). So each run's env:// rendezvous yields the launcher's store under a prefix of its own (many_runs/<i>/),
where its group's keys are new (`own_rendezvous`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys


@contextlib.contextmanager
def own_rendezvous(i: int, counted: list[int]):
    """Within: env:// rendezvous (what init_process_group runs) yields the store under the prefix many_runs/<i>/;
    `counted` gets one entry per rendezvous."""
    import torch.distributed as dist

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers  # the module, not the
    env = handlers["env"]                                                                       # function dist exports

    def prefixed(url, timeout=None, **kwargs):
        for store, rank, world_size in env(url, timeout, **kwargs):
            counted.append(i)
            yield dist.PrefixStore(f"many_runs/{i}", store), rank, world_size

    handlers["env"] = prefixed
    try:
        yield
    finally:
        handlers["env"] = env


def end_group() -> None:
    """After a run: its process group destroyed (end_training did, unless the run ended before it) and accelerate's
    state singletons reset, so that the next run's Accelerator initialises a group of its own."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    if dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main(plan: list[dict]) -> None:
    from difrl.cli import main as difrl
    from difrl.train.entry import main as entry

    for i, run in enumerate(plan):
        env = run.get("env", {})
        held = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        counted: list[int] = []
        try:
            with own_rendezvous(i, counted):
                code = entry(run["kind"], run["argv"]) if run.get("kind") else difrl(run["argv"])
        finally:
            end_group()
            for k, v in held.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if code:
            raise SystemExit(f"many_runs: {run} ended with status {code}")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"many_runs: run {i + 1}/{len(plan)} on its own process group ({len(counted)} rendezvous under "
                  f"many_runs/{i}/)", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
