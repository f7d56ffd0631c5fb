"""The policy adapters: the FlowPolicy protocol, the bundled worlds' networks, one file per diffusers family.

    from difrl.models import register_model, model_kinds, load_flow_policy   # the adapter table's API

The table's names are imported from difrl.models.adapters when first asked for (PEP 562), so importing one adapter
module (difrl.models.digits) does not import the diffusers families.
"""

_TABLE = ("ADAPTERS", "BUILTIN_ADAPTERS", "ENTRY_POINT_GROUP", "adapter_class", "load_flow_policy", "model_kinds",
          "register_model", "unknown_model_kind")


def __getattr__(name: str):
    if name in _TABLE:
        from difrl.models import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module 'difrl.models' has no attribute {name!r}")


__all__ = list(_TABLE)
