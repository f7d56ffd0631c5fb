"""The iteration skeleton both recipes share (difrl/train/iteration.py): which samples an iteration trains on.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m pytest tests/test_iteration.py -q
"""

from __future__ import annotations

import torch


def test_kept_samples_drop_groups_with_a_failed_reward_and_with_drop_zero_spread_the_flat_ones():
    # three groups of two: group 0's rewards vary, group 1's are equal (no learning signal), group 2's vary but one
    # reward failed (advantage_function marks the whole group failed). kept_samples needs no IterationRewards: only
    # the advantages and the failures
    from difrl.algos.advantages import group_advantages
    from difrl.train.iteration import kept_samples

    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages({"r": torch.tensor([0.1, 0.9, 0.5, 0.5, 0.2, 0.7])}, {"r": 1.0}, groups)
    assert adv.zero_spread.tolist() == [False, False, True, True, False, False]
    failed = groups == 2  # [N] bool: the samples of a group with a failed reward
    assert kept_samples(adv, failed, drop_zero_spread=False).tolist() == [True, True, True, True, False, False]
    assert kept_samples(adv, failed, drop_zero_spread=True).tolist() == [True, True, False, False, False, False]
