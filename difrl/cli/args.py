"""What the commands share in reading their arguments: a config path among `key=value` overrides, the typed
config it names, and a run directory standing for its config.yaml.

    path, overrides = split(args.rest)       # CONFIG|RUN_DIR [key=value ...]
    run, path = run_dir_config(path)         # a run directory: (it, its config.yaml)
    cfg = load(path, overrides)              # a FlowConfig or a MaskedConfig, as model.kind says
"""

from __future__ import annotations

from pathlib import Path


def split(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the one argument that is not key=value or None, the key=value overrides in order); a second is refused."""
    path = None
    overrides = []
    for a in argv:
        if "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise SystemExit(f"difrl: unexpected argument {a!r} (overrides are key=value)")
    return path, overrides


def load(path: str | None, overrides: list[str]):
    """The typed config of the trainer that model.kind names (a FlowConfig or a MaskedConfig)."""
    from difrl.train.recipes import load_train_config

    return load_train_config(path, overrides)


def run_dir_config(path: str | None) -> tuple[Path | None, str | None]:
    """A run directory stands for its config.yaml (and its trained policy): (run dir or None, config path)."""
    if path and Path(path).is_dir():
        run = Path(path)
        if not (run / "config.yaml").exists():
            raise FileNotFoundError(f"{run} is not a difrl run directory (no config.yaml)")
        return run, str(run / "config.yaml")
    return None, path
