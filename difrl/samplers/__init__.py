"""Step kernels (pure fp32 tensor functions), sigma schedules and step masks."""

from difrl.samplers.kernels import (
    KERNELS,
    StepOutput,
    cps_step,
    dance_sde_step,
    flow_sde_step,
    gaussian_log_prob,
    ode_step,
    reduce_elements,
    split_step,
)
from difrl.samplers.schedules import (
    all_but_last,
    exponential_time_shift,
    fixed_window,
    random_subset,
    random_window,
    sigma_schedule,
    sliding_window_start,
    step_masks,
    time_shift,
)

__all__ = [
    "KERNELS", "StepOutput", "cps_step", "dance_sde_step", "flow_sde_step", "gaussian_log_prob", "ode_step",
    "reduce_elements", "split_step", "all_but_last", "exponential_time_shift", "fixed_window", "random_subset", "random_window",
    "sigma_schedule", "sliding_window_start", "step_masks", "time_shift",
]
