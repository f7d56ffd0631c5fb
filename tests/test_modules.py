"""What every layer asks of a network, defined once (difrl/utils/modules.py): its trained parameters
(`trainable_params`, which the gathered and the sharded checkpoints both read) and the model under a peft wrapper
(`peft_base`, which the rollout copy's merge, the FSDP units and the masked policies' saved weights read).

    .venv/bin/python -m pytest tests/test_modules.py -q
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from difrl.utils.modules import peft_base, trainable_params


def _lora_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return get_peft_model(net, LoraConfig(r=2, target_modules=["0", "2"]))


def test_trainable_params_are_the_ones_that_require_grad_in_order():
    net = _lora_net()
    params = trainable_params(net)
    assert list(params) == [k for k, p in net.named_parameters() if p.requires_grad] and len(params) == 4
    assert all(".lora_" in k for k in params) and all(p is dict(net.named_parameters())[k] for k, p in params.items())
    next(iter(params.values())).requires_grad_(False)
    assert len(trainable_params(net)) == 3


def test_peft_base_is_the_model_under_the_wrapper_and_a_plain_module_itself():
    net = _lora_net()
    base = peft_base(net)
    assert base is net.get_base_model() and hasattr(base[0], "lora_A")  # LoRA layers injected, no peft prefix
    plain = torch.nn.Linear(2, 2)
    assert peft_base(plain) is plain


def test_one_definition_each():
    # the checkpoints (gathered: difrl.train.run.state; sharded: difrl.train.run.sharded_state) read the same trained
    # parameters, and the rollout copy's merge (difrl.quant.sync), FSDP units (difrl.train.flow.rollout_copy) and the
    # masked policies' state_dict_and_meta (difrl.discrete.policy) unwrap peft the same way: no module keeps its own
    from difrl.discrete import policy
    from difrl.quant import sync
    from difrl.train.flow import rollout_copy
    from difrl.train.run import sharded_state, state

    assert state.trainable_params is trainable_params and sharded_state.trainable_params is trainable_params
    assert not hasattr(sharded_state, "trainable")
    assert sync.peft_base is peft_base and rollout_copy.peft_base is peft_base and policy.peft_base is peft_base
    assert not hasattr(sync, "_plain") and not hasattr(rollout_copy, "_plain")
