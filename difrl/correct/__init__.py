"""Importance-sampling correctors shared by diffusion and LLM RL (pure torch; see core.py)."""

from difrl.correct.core import (
    METHODS,
    SAFETY_BOUND,
    Correction,
    ais,
    aspo_loss,
    ctpo_log_ratio,
    diagnostics,
    ess_fraction,
    geo_rs,
    gspo_log_ratio,
    k2_rs,
    k3_rs,
    log_ratio,
    minpro,
    no_correction,
    seq_log_ratio,
    seq_mis,
    seq_tis,
    token_mis,
    token_tis,
    vcpo_lr_scale,
    vespo,
)

__all__ = [
    "METHODS", "SAFETY_BOUND", "Correction", "ais", "aspo_loss", "ctpo_log_ratio", "diagnostics", "ess_fraction",
    "geo_rs", "gspo_log_ratio", "k2_rs", "k3_rs", "log_ratio", "minpro", "no_correction", "seq_log_ratio", "seq_mis", "seq_tis",
    "token_mis", "token_tis", "vcpo_lr_scale", "vespo",
]
