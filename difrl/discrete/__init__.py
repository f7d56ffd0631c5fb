"""Discrete (masked) diffusion: the masked policy adapters, samplers and the MDLM loss.

    from difrl.discrete import TinyMaskedPolicy, HFMaskedLM, llada_sample, eb_sample, emerge_sample, mdlm_loss
"""

from difrl.discrete.losses import forward_mask, mdlm_loss, sample_t
from difrl.discrete.policy import NEG, HFMaskedLM, MaskedNetConfig, MaskedPolicy, MaskedTransformer, TinyMaskedPolicy
from difrl.discrete.samplers import SAMPLERS, DiscreteRollout, eb_sample, emerge_sample, llada_sample

__all__ = ["NEG", "SAMPLERS", "DiscreteRollout", "HFMaskedLM", "MaskedNetConfig", "MaskedPolicy", "MaskedTransformer",
           "TinyMaskedPolicy", "eb_sample", "emerge_sample", "forward_mask", "llada_sample", "mdlm_loss", "sample_t"]
