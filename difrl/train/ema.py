"""The averaged and the snapshot copies of a network's trainable weights, checkpointed beside it (difrl.train.run.state).

    ema = EMA(trainable_params(net), decay=0.999, module=net)   # module: under FSDP, resharded after a swap
    ema.update()                                               # shadow <- d shadow + (1 - d) live
    with ema.swapped(): evaluate(net)                          # the EMA weights live inside the block
    source = WeightSnapshot(trainable_params(net), net)        # the weights as they are now
    source.take()                                              # ... as they are now (GARDO's reference, a copy's source)

A WeightSnapshot is an EMA of decay 0: its update copies the live weights, so a checkpoint saves and restores it as
it does an EMA (extras: tensors and update count).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from difrl.train.dist.full_tensors import is_sharded, reshard


class EMA:
    """Exponential moving average of named tensors, decay warmed up as min(decay, (1 + n) / (10 + n)). `module`: the
    network holding `params`; under FSDP give it, so that a swap reshards it (full_tensors.reshard).

    Update and swap are `torch._foreach_*` calls over every tensor at once (a few fused kernels, not one op and one
    Python dispatch per parameter: thousands at FLUX scale), on the local tensors (a DTensor's shard: the EMA is
    elementwise, so each process averages its own rows, as the per-parameter DTensor ops did). The numbers are the
    per-tensor loop's: the same lerp and copy kernels (tests/test_dcp_scale.py checks bit equality)."""

    def __init__(self, params: dict[str, nn.Parameter], decay: float, module: nn.Module | None = None):
        self.decay = decay
        self.params = params
        self.module = module
        self.shadow = {k: p.detach().clone() for k, p in params.items()}
        self.num_updates = 0

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(live, shadow) as plain local tensors, in the params' order (a sharded one's local rows: its storage)."""
        live = [_local(p.detach()) for p in self.params.values()]
        return live, [_local(self.shadow[k]) for k in self.params]

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """shadow <- d shadow + (1 - d) live; d = `decay` if given, else the warmed-up self.decay."""
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates)) if decay is None else decay
        live, shadow = self._pairs()
        if live:
            torch._foreach_lerp_(shadow, live, 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange live and EMA weights (call twice to restore). The temporary copy of the live weights is made
        SWAP_BUCKET_BYTES at a time (the per-parameter loop held one parameter; a copy of all of them would add a
        whole shard of the model at once)."""
        live, shadow = self._pairs()
        start = 0
        while start < len(live):
            end, size = start, 0
            while end < len(live) and (end == start or size + live[end].nbytes <= SWAP_BUCKET_BYTES):
                size, end = size + live[end].nbytes, end + 1
            held = torch._foreach_mul(live[start:end], 1.0)  # a copy: x * 1.0 is x exactly (IEEE, signed zeros too)
            torch._foreach_copy_(live[start:end], shadow[start:end])
            torch._foreach_copy_(shadow[start:end], held)
            start = end
        if self.module is not None:  # the next forward must gather the swapped shards (reshard_after_forward=False)
            reshard(self.module)

    @contextmanager
    def swapped(self):
        """The EMA weights live inside the block, the trained ones restored after it."""
        self.swap()
        try:
            yield
        finally:
            self.swap()


class WeightSnapshot(EMA):
    """The weights as they were at the last take() (or at construction): an EMA of decay 0, which a checkpoint
    keeps as it keeps an EMA."""

    def __init__(self, params: dict[str, nn.Parameter], module: nn.Module | None = None):
        super().__init__(params, 0.0, module)

    def take(self) -> None:
        """shadow <- live, exactly (an update of decay 0: torch's lerp with weight 1 returns the end point)."""
        self.update(0.0)


SWAP_BUCKET_BYTES = 1 << 28  # the most bytes EMA.swap copies aside at once (256 MiB)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t
