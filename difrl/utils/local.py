"""Local weights paths and optional packages, checked with errors that name the option that set them.

    p = local_file(path, "the Inception weights", "eval.fid.weights", who="InceptionExtractor", error=EvalConfigError)
    d = local_dir(path, "the CLIP model", "reward.options.clip_score.model_dir", who="reward 'clip_score'",
                  error=RewardConfigError, needs=("config.json",))
    cfg = model_config(d, "eval.fid.weights", who="DinoV2Extractor", error=EvalConfigError, model_type="dinov2")
    mod = optional_import("torch_fidelity", extra="eval", who="InceptionExtractor", error=EvalConfigError)

difrl never downloads weights: every model comes from a path in the config, and a missing or wrong one is an
`error` (the caller's configuration-error class) that says who needed it, the full option name that set it
(`reward.options.<reward>.<option>`, `eval.fid.weights`, ...) and the path. The reward and evaluation layers
wrap these with their own error class and option prefix (difrl.rewards.base, difrl.eval.extractors).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def local_file(path, what: str, option: str, who: str, error: type[Exception] = ValueError) -> Path:
    """`path` as an existing local file; else `error` naming `who`, `what` it should be, `option` and the path."""
    if path in (None, ""):
        raise error(f"{who} needs {what}: set {option} to a local file (difrl never downloads weights)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise error(f"{who}: {what} not found at {str(p)!r} ({option}{'; it is a directory' if p.is_dir() else ''}; "
                    "difrl never downloads weights)")
    return p


def local_dir(path, what: str, option: str, who: str, error: type[Exception] = ValueError,
              needs: tuple[str, ...] = ("config.json",)) -> Path:
    """`path` as an existing local (save_pretrained) directory holding the files `needs`; else `error` naming
    `who`, `what`, `option`, the path and the missing files."""
    if path in (None, ""):
        raise error(f"{who} needs {what}: set {option} to a local directory saved with save_pretrained "
                    "(difrl never downloads weights)")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise error(f"{who}: {what} directory not found at {str(p)!r} ({option})")
    missing = [n for n in needs if not (p / n).exists()]
    if missing:
        raise error(f"{who}: {what} directory {str(p)!r} ({option}) lacks {', '.join(missing)}: is it a "
                    "save_pretrained directory?")
    return p


def model_config(d: Path, option: str, who: str, error: type[Exception] = ValueError, model_type: str | None = None,
                 kind: str = "") -> dict:
    """The config.json of the save_pretrained directory `d` as a dict, checked to be of `model_type` when given
    (`kind` describes that type in the error, e.g. "a transformers CLIPModel"): read before any weights load."""
    path = Path(d) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{who}: cannot read {str(path)!r} ({option}): {e}") from e
    if model_type is not None and cfg.get("model_type") != model_type:
        raise error(f"{who}: {str(d)!r} ({option}) holds a {cfg.get('model_type')!r} model, not {model_type!r}"
                    + (f" ({kind})" if kind else ""))
    return cfg


def optional_import(module: str, extra: str, who: str, error: type[Exception] = ImportError, hint: str = ""):
    """Import a package of difrl's optional extra `extra`, or raise `error` saying who needs it and how to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise error(f"{who} needs the package {module!r}, which does not import here ({e}); install it with: "
                    f"pip install 'difrl[{extra}]'" + (f". {hint}" if hint else "")) from e
