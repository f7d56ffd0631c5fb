"""difrl: RL for diffusion models (docs/architecture.md).

Importing difrl installs one logging filter and nothing else: torch's ``torch.utils._pytree`` notice that an Enum
passed to register_constant() "is an Enum subclass and is now natively supported by torch.compile" is dropped.
torchao prints it for its own enums when it is imported (peft and diffusers import it to probe for quantized
layers), so a library user's first ``import peft`` through difrl would show it; it concerns torchao's code, not
the user's. Every other record of that logger still shows (difrl.utils.quiet lists what the commands drop).
"""

import logging as _logging

PYTREE_ENUM_NOTICE = "is an Enum subclass and is now natively supported by torch.compile"


def _drop_pytree_enum_notice(record: _logging.LogRecord) -> bool:
    return PYTREE_ENUM_NOTICE not in record.getMessage()


_logging.getLogger("torch.utils._pytree").addFilter(_drop_pytree_enum_notice)
