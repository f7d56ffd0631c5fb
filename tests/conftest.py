"""Shared test set-up: offline, deterministic, small thread count (CI has 2 cores)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


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
