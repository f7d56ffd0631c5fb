"""A run's final weights, the one path of the trainers' finish (difrl/train/flow/trainer.py, masked.py) and of
`difrl export` (difrl/train/export.py): the world's own files (World.save_final, difrl/worlds/contract.py).

    save_final(world, policy, net, cfg.train.lora.enabled, run_dir, masters, ema, accelerator.is_main_process)
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from difrl.train.dist.full_tensors import gathered
from difrl.train.scaffold import save_policy


def save_final(world, policy, net, lora: bool, out_dir: Path, masters, ema=None, main: bool = True) -> None:
    """A run's final weights into `out_dir`, the one path of the trainers' finish (difrl/train/flow/trainer.py, masked.py)
    and of `difrl export`: the EMA's weights when `ema` is given (swapped in), under FSDP the full weights gathered
    (full_tensors.gathered: collective, so every process calls this; only the main one keeps them, the others see meta
    tensors), cast to the dtypes the model was loaded in (masters.as_loaded), written by the main process in the
    world's own files (World.save_final: policy.safetensors, lora/, transformer/), whose merged checkpoint is
    scaffold.save_policy's. `net`: the trained network (peft's wrapper under LoRA), the module policy.module runs."""
    with ema.swapped() if ema is not None else nullcontext(), gathered(net, keep=main), masters.as_loaded(net):
        if main:
            world.save_final(policy, net, lora, Path(out_dir), lambda path: save_policy(policy, net, lora, path))

