"""`difrl config`: every config key with its type, default and range, or a config resolved (file, then overrides).

    difrl config [--masked]                                       # every key (the flow trainer's, or the masked one's)
    difrl config configs/digits.yaml [key=value ...]              # the resolved config, as YAML
"""

from __future__ import annotations

import argparse

from difrl.cli.args import load, split


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--masked", action="store_true", help="the masked-diffusion trainer's keys (Sudoku, digit tokens); a "
                                                         "masked CONFIG or model.kind=sudoku selects them too")
    p.add_argument("rest", nargs="*", help="[CONFIG] [key=value ...]")


def main(args) -> int:
    from difrl.config import config_to_dict, describe_config
    from difrl.train.config import FlowConfig
    from difrl.train.masked.config import MaskedConfig

    path, overrides = split(args.rest)
    if path is None and not overrides:
        print(describe_config(MaskedConfig if args.masked else FlowConfig))
    else:
        import yaml

        print(yaml.safe_dump(config_to_dict(load(path, overrides)), sort_keys=False), end="")
    return 0
