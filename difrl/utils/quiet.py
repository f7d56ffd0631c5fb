"""Known third-party messages that difrl's commands leave out: library start-up noise, not the user's problem.

    from difrl.utils.quiet import quiet_third_party
    quiet_third_party()   # first thing in a command (difrl.cli.main, difrl.train.entry.main): before heavy imports

Each filter drops one known message of one named logger (or one warning category and message raised in one
module) and nothing else, so every other warning still shows. What is dropped, and why:

- torch's ``torch.utils._pytree`` "<enum 'KernelPreference'> is an Enum subclass ... deprecated": torchao
  (an optional dependency of transformers, which peft imports for LoRA) registers its enums at import time;
  the message is about torchao's code, and difrl uses neither torchao nor torch.compile there.
- diffusers' "Unable to import `torchao` Tensor objects": printed on every pipeline load when torchao's
  optional tensor classes are missing; it concerns loading torchao-quantized checkpoints, which difrl never does.
- diffusers' "No LoRA keys associated to CLIPTextModel ... open an issue" (diffusers.loaders.lora_base, text
  encoders only): FLUX's load_lora_weights looks for text-encoder LoRA keys in every LoRA it loads; difrl trains
  the transformer only, and difrl.models.lora_io.check_lora_dir has already required transformer LoRA keys.
- transformers' "Token indices sequence length is longer than the specified maximum sequence length" and the
  diffusers pipelines' "The following part of your input was truncated": the pipeline truncates long prompts
  as intended; difrl says so once in its own words (DiffusersFlowPolicy.encode).
- transformers' FutureWarning "`is_gradient_checkpointing` is deprecated": peft's get_peft_model reads that
  property of every transformers model it wraps (LoRA on a text dLLM); difrl never calls it.
- Progress bars of weight loading and saving ("Loading weights", "Writing model shards"): transformers reads
  HF_HUB_DISABLE_PROGRESS_BARS when it is first imported; set here unless the user set it.
  diffusers' "Loading pipeline components" bar is turned off around the load (difrl.models.diffusers_base).
"""

from __future__ import annotations

import logging
import os
import warnings

from difrl import PYTREE_ENUM_NOTICE

# logger name -> fragments of the messages dropped from it
DROPPED = {
    "torch.utils._pytree": (PYTREE_ENUM_NOTICE,),  # dropped from `import difrl` on (difrl/__init__.py)
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    "diffusers.loaders.lora_base": ("No LoRA keys associated to CLIPTextModel", "No LoRA keys associated to T5"),
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer than the specified maximum",),
    "diffusers.pipelines.flux.pipeline_flux": ("The following part of your input was truncated",),
    "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3": ("The following part of your input was truncated",),
    "diffusers.pipelines.wan.pipeline_wan": ("The following part of your input was truncated",),
}


class DropMessages(logging.Filter):
    """Drops the records whose message contains one of `fragments`."""

    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = tuple(fragments)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def quiet_third_party() -> None:
    """Install the filters of DROPPED (once per logger) and the one warning filter, and turn off the hub
    libraries' progress bars."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module="transformers.modeling_utils")
    for name, fragments in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(fragments))


__all__ = ["DROPPED", "DropMessages", "quiet_third_party"]
