"""Shared test set-up: offline, deterministic, one thread per process (CI has 2 cores).

    make test        # = python -m pytest -n 2 --dist loadfile: two pytest-xdist workers, each takes whole files

`make test` runs the suite as two worker processes (pytest-xdist), one core each: most tests run in one process on
one thread (Python start-up, one-thread kernels), so on 2 cores two of them run at a time where one did. `--dist
loadfile` keeps every test of a file on one worker, so a module-scoped fixture (a trained reference run, a tiny
pipeline) is built once, not once per worker; no fixture here is session-scoped, so nothing is shared across files.
A launch of several processes picks a free port (`--standalone`, `--main_process_port 0` or tests/test_fsdp.py's
free_port), never accelerate's default 29500, which the other worker's launch may hold at the same moment.
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one thread in this process and, inherited, in every process a test starts (a command given its own count keeps
# it): two workers of 2 threads each on 2 cores would fight, and oversubscribed kernels run slower, not faster
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def weights_reproduced(shipped: dict, rebuilt: dict, what: str, rtol: float = 1e-3, atol: float = 1e-4) -> bool:
    """True when a pretraining script rebuilt the shipped weights (bit-exact on the CPU that built them, within
    float tolerance where the kernels round alike). A CPU whose BLAS / oneDNN kernels round differently (seen:
    an AVX-512 AMD EPYC against the machine that built the assets) makes a long training run drift apart, so
    then the caller must check that the rebuilt model *behaves* like the shipped one; this warns with the size
    of the drift, so the difference is visible in the test log rather than hidden."""
    import warnings

    assert shipped.keys() == rebuilt.keys(), f"{what}: tensor names differ"
    worst = max(float((rebuilt[k].float() - shipped[k].float()).abs().max()) for k in shipped)
    close = all(torch.allclose(rebuilt[k], shipped[k], rtol=rtol, atol=atol) for k in shipped)
    if not close:
        warnings.warn(f"{what}: the rebuilt weights differ from the shipped ones by up to {worst:.3g} (this CPU's "
                      "float kernels round differently); checking that the rebuilt model behaves the same instead")
    return close


@pytest.fixture
def one_process_group():
    """A one-process gloo group in the test process (FSDP2 and DCP on one rank), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
