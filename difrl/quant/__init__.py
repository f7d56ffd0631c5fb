"""Low-precision formats, quantized linear layers and the rollout copy (docs/architecture.md seam 7). Pure torch;
Transformer Engine is used only when installed and the GPU supports the format; FP8 (fp8 / fp8_row) runs
natively through torch._scaled_mm on a GPU with compute capability >= 8.9 (difrl/quant/torch_fp8.py).

    from difrl.quant import RolloutCopy, QUANT_PRESETS, qdq
"""

from difrl.quant.formats import FORMATS, Quantized, dequantize, qdq, quantize, relative_error
from difrl.quant.linear import (BACKENDS, QUANT_PRESETS, QuantizationError, QuantLinear, QuantReport, TELinear,
                                TorchFP8Linear, choose_backend, quantize_module, quantized_layers, storage_bytes,
                                te_recipe, te_support)
from difrl.quant.sync import RolloutCopy, WeightSyncError, merged_state_dict

__all__ = ["FORMATS", "Quantized", "dequantize", "qdq", "quantize", "relative_error", "BACKENDS", "QUANT_PRESETS",
           "QuantizationError", "QuantLinear", "QuantReport", "TELinear", "TorchFP8Linear", "choose_backend", "quantize_module",
           "quantized_layers", "storage_bytes", "te_recipe", "te_support", "RolloutCopy", "WeightSyncError",
           "merged_state_dict"]
