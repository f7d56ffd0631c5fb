"""LoRA the diffusers way: a diffusers policy's transformer LoRA as a diffusers LoRA directory, and back.

    from difrl.models.lora_io import load_lora, save_lora
    save_lora(policy, "run/lora")                        # diffusers LoRA dir: pipe.load_lora_weights("run/lora")
    load_lora(other_policy, "run/lora")                  # refuses a LoRA made for another model kind
    load_transformer(policy, "run/transformer")          # a full fine-tune's transformer (save_pretrained) instead

Works for every adapter of difrl/models/adapters.py: it reads only `policy.module`, `policy.pipe`,
`policy.kind`, `policy.pipeline_class` and `policy.lora_components()` (one diffusers LoRA file per trained transformer:
Wan 2.2 A14B writes lora/ for `transformer` and lora/transformer_2/ for `transformer_2`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from difrl.models.diffusers_base import DiffusersFlowPolicy, ModelKindError, PipelineDirError

LORA_MARKER = "difrl_lora.json"  # written beside the diffusers LoRA file: which model kind it was trained on


def _peft_parts(module: nn.Module, adapter_name: str):
    """(peft-wrapped module, its LoraConfig, key prefix to strip) for a PeftModel or a diffusers
    model with an adapter (add_adapter / load_lora_weights); unwraps DDP-style `.module` wrappers."""
    from peft import PeftModel

    while not hasattr(module, "peft_config") and isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    if not hasattr(module, "peft_config") or adapter_name not in module.peft_config:
        raise ValueError(f"the policy's module has no LoRA adapter {adapter_name!r} (wrap it with peft first)")
    prefix = "base_model.model." if isinstance(module, PeftModel) else ""
    return module, module.peft_config[adapter_name], prefix


def save_lora(policy: DiffusersFlowPolicy, out_dir: str | Path, adapter_name: str = "default") -> Path:
    """Write the policy's transformer LoRA as a diffusers LoRA directory (pytorch_lora_weights.safetensors)
    that `pipe.load_lora_weights(out_dir)` reads with the right scaling: rank and lora_alpha go in as
    adapter metadata (without it diffusers assumes alpha = r, docs/reference/specs/ecosystem.md §2.2). A small
    difrl_lora.json records the model kind so load_lora can refuse a LoRA made for another model."""
    from peft.utils import get_peft_model_state_dict

    from difrl.utils.io import atomic_write_json

    module, config, prefix = _peft_parts(policy.module, adapter_name)
    state = get_peft_model_state_dict(module, adapter_name=adapter_name)
    state = {k[len(prefix):] if k.startswith(prefix) else k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    meta = config.to_dict()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub, key_prefix, _, _ in policy.lora_components():  # Wan 2.2 A14B: lora/ and lora/transformer_2/
        part = {k[len(key_prefix):]: v for k, v in state.items() if k.startswith(key_prefix)}
        targets = meta["target_modules"]  # full names inside one expert (train_experts): relative to that expert
        targets = sorted(t.removeprefix(key_prefix) for t in targets) if isinstance(targets, (list, set)) else targets
        type(policy.pipe).save_lora_weights(out_dir / sub, transformer_lora_layers=part,
                                            transformer_lora_adapter_metadata={**meta, "target_modules": targets})
    atomic_write_json(out_dir / LORA_MARKER, {
        "kind": policy.kind, "pipeline_class": policy.pipeline_class,
        "transformer_class": type(policy.pipe.transformer).__name__, "rank": config.r,
        "lora_alpha": config.lora_alpha, "target_modules": sorted(config.target_modules),
        "parts": [sub for sub, *_ in policy.lora_components()]})
    return out_dir


def check_lora_dir(policy: DiffusersFlowPolicy, lora_dir: str | Path) -> dict[str, torch.Tensor]:
    """The transformer LoRA tensors of `lora_dir` (keys without the 'transformer.' prefix), after checking
    that the directory was made for this policy's model kind: the difrl marker if present, and always
    that every LoRA key names a module of this transformer with matching shapes."""
    lora_dir = Path(lora_dir)
    if not lora_dir.is_dir():
        raise PipelineDirError(f"{lora_dir}: no such LoRA directory")
    marker = lora_dir / LORA_MARKER
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("kind") != policy.kind:
            raise ModelKindError(f"{lora_dir} holds a LoRA for model kind {info.get('kind')!r} "
                                 f"({info.get('pipeline_class')}), not for {policy.kind!r} ({policy.pipeline_class})")
    tf = {}
    for sub, key_prefix, attr, _ in policy.lora_components():
        part = _check_part(policy, lora_dir / sub, getattr(policy.pipe, attr))
        tf.update({key_prefix + k: v for k, v in part.items()})
    return tf


def _check_part(policy: DiffusersFlowPolicy, lora_dir: Path, transformer: nn.Module) -> dict[str, torch.Tensor]:
    """The transformer LoRA tensors of one diffusers LoRA file in `lora_dir`, each checked against `transformer`."""
    if not any(lora_dir.glob("*.safetensors")):
        raise PipelineDirError(f"{lora_dir} has no LoRA weights (*.safetensors; expected pytorch_lora_weights.safetensors)")
    state = type(policy.pipe).lora_state_dict(str(lora_dir))
    state = state[0] if isinstance(state, tuple) else state
    tf = {k[len("transformer."):]: v for k, v in state.items() if k.startswith("transformer.")}
    if not tf:
        raise ModelKindError(f"{lora_dir} has no transformer LoRA weights for a {policy.pipeline_class} "
                             f"(keys start {sorted(state)[:2]})")
    modules = dict(transformer.named_modules())
    bad = []
    for key, w in tf.items():
        name, _, kind = key.rpartition(".lora_")
        base = modules.get(name)
        base = getattr(base, "base_layer", base)  # already LoRA-wrapped
        if not isinstance(base, nn.Linear):
            bad.append(f"{key} (no such linear layer)")
        elif kind.startswith("A") and w.shape[1] != base.in_features:
            bad.append(f"{key} (in {w.shape[1]} != {base.in_features})")
        elif kind.startswith("B") and w.shape[0] != base.out_features:
            bad.append(f"{key} (out {w.shape[0]} != {base.out_features})")
    if bad:
        raise ModelKindError(f"{lora_dir} does not fit this {type(transformer).__name__} "
                             f"(kind {policy.kind!r}): {len(bad)} of {len(tf)} LoRA tensors do not match, e.g. "
                             + "; ".join(bad[:3]))
    return tf


def load_lora(policy: DiffusersFlowPolicy, lora_dir: str | Path, adapter_name: str = "default") -> DiffusersFlowPolicy:
    """Load a diffusers LoRA directory into the policy after check_lora_dir. A policy whose module is
    already peft-wrapped with `adapter_name` (training resume) gets the weights set in place; a plain
    policy gets them through the pipeline's own `load_lora_weights` (the same path a user takes)."""
    tf = check_lora_dir(policy, lora_dir)
    module = policy.module
    if hasattr(module, "peft_config") and adapter_name in module.peft_config:
        from peft import set_peft_model_state_dict

        _, _, prefix = _peft_parts(module, adapter_name)
        result = set_peft_model_state_dict(module, {prefix + k: v for k, v in tf.items()}, adapter_name=adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []))
        missing = [k for k in getattr(result, "missing_keys", []) if ".lora_" in k and f".{adapter_name}." in k]
        if unexpected or missing:
            raise ValueError(f"{lora_dir} does not match the policy's adapter {adapter_name!r}: "
                             f"{len(unexpected)} tensors have no place in it (e.g. {unexpected[:2]}), "
                             f"{len(missing)} of its tensors are not in the directory (e.g. {missing[:2]}); "
                             "wrap with the same target_modules and rank")
        return policy
    if any(hasattr(m, "peft_config") for m in module.modules()):
        raise ValueError("the policy's module is wrapped but has no peft adapter "
                         f"{adapter_name!r}; load the LoRA before wrapping it")
    # the user's path, with diffusers' conversions of other LoRA formats; it also looks for text-encoder keys
    # and warns when there are none (difrl trains only the transformer: difrl.utils.quiet drops that warning)
    for sub, _, _, kwargs in policy.lora_components():  # Wan 2.2 A14B: lora/transformer_2 into transformer_2
        policy.pipe.load_lora_weights(str(Path(lora_dir) / sub), adapter_name=adapter_name, **kwargs)
    return policy


def load_transformer(policy: DiffusersFlowPolicy, transformer_dir: str | Path) -> DiffusersFlowPolicy:
    """Load a full fine-tune's transformer (the trainer's RUN_DIR/transformer, a `save_pretrained` directory)
    into the policy's transformer in place (its device and dtype kept); a directory holding another
    transformer class or other shapes raises, naming it."""
    d = Path(transformer_dir)
    if not (d / "config.json").is_file():
        raise PipelineDirError(f"{d}: not a transformer directory (no config.json; a full fine-tune's run writes "
                               "RUN_DIR/transformer)")
    _load_into(policy, policy.pipe.transformer, d)
    if getattr(policy.pipe, "transformer_2", None) is not None:  # Wan 2.2 A14B: RUN_DIR/transformer_2 beside it
        d2 = d.parent / "transformer_2"
        if not (d2 / "config.json").is_file():
            raise PipelineDirError(f"{d2}: no transformer directory for the low-noise expert (a two-expert full "
                                   "fine-tune writes RUN_DIR/transformer and RUN_DIR/transformer_2)")
        _load_into(policy, policy.pipe.transformer_2, d2)
    return policy


def _load_into(policy: DiffusersFlowPolicy, target: nn.Module, d: Path) -> None:
    saved_class = json.loads((d / "config.json").read_text()).get("_class_name")
    if saved_class != type(target).__name__:
        raise ModelKindError(f"{d} holds a {saved_class}, not the {type(target).__name__} of this {policy.kind!r} "
                             "pipeline")
    trained = type(target).from_pretrained(str(d), local_files_only=True)
    try:
        target.load_state_dict(trained.state_dict())
    except RuntimeError as e:  # missing / unexpected keys or other shapes
        raise ModelKindError(f"{d} does not fit this {type(target).__name__}: {str(e)[:300]}") from e
