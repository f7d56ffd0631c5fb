"""What building a reward would refuse, found without building it: no model loads, no weights file is read.

    problems = preflight_reward("pickscore", {"model_dir": "/w/PickScore_v1"}, "reward 'pickscore'",
                                "reward.options.pickscore")     # [] or ["reward 'pickscore': ... not found ...", ...]

`difrl check` and `difrl train` (difrl.train.check) list these with every other problem of a config before
anything loads. For one reward (a name as in reward.weights: built-in, ``module:function``, entry point,
``name@alias``) and its options:
- the name is known and its factory imports (a ``module:function`` is imported: that is where "No module named
  'your_package'" shows);
- the options are ones the factory takes, and those without a default are given (inspect.signature, as
  build_reward's "bad options" error says);
- what the factory declares (difrl.rewards.base.RewardModel): `local_paths`, the options naming local files or
  save_pretrained directories, checked with the helpers the reward loads with (difrl.utils.local: the same
  messages); `required`, the options it cannot run without; `packages`, the optional packages it imports, found
  with importlib.util.find_spec (not imported: open_clip alone takes seconds). A factory whose checks depend on
  its options defines ``preflight(options, who, prefix) -> list[str]`` instead (geneval, video).
What only a load can tell (a directory that holds another model, a file that is not a state dict, a reward server
that is down) is still reported when the reward is built.
"""

from __future__ import annotations

import importlib.util
import inspect

from difrl.rewards import find_reward_factory, unknown_reward
from difrl.rewards.base import RewardConfigError
from difrl.utils import local


def preflight_reward(name: str, options: dict, who: str, prefix: str) -> list[str]:
    """Every problem of reward `name` with `options` (set at config key `prefix`, e.g. reward.options.pickscore),
    each message naming `who` (e.g. "reward 'pickscore'") and the full option key."""
    if (problem := unknown_reward(name)) is not None:
        return [problem]
    try:
        factory = find_reward_factory(name)
    except ValueError as e:  # a module:function that does not import
        return [str(e)]
    if not isinstance(options, dict):
        return [f"{who}: {prefix} must be a mapping of the reward's options, got {options!r}"]
    problems = option_problems(factory, options, who, prefix)
    hook = getattr(factory, "preflight", None)
    if callable(hook):
        problems += hook(options, who, prefix)
    else:
        problems += declared_problems(options, who, prefix, getattr(factory, "local_paths", {}),
                                      getattr(factory, "required", ()), getattr(factory, "packages", ()))
    return problems


def option_problems(factory, options: dict, who: str, prefix: str) -> list[str]:
    """Options the factory does not take, and its parameters without a default that are not given."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes = ", ".join(p.name for p in named) or "no options"
    names = {p.name for p in named}
    out = [f"{who}: unknown option {prefix}.{k} (it takes: {takes})" for k in options if k not in names]
    out += [f"{who} needs {prefix}.{p.name} (it has no default)" for p in named
            if p.default is p.empty and p.name not in options]
    return out


def declared_problems(options: dict, who: str, prefix: str, local_paths: dict, required=(), packages=()) -> list[str]:
    """The declared checks (module docstring): `local_paths` option -> (what it is, the files a directory must
    hold, or None for a file); `required` options; `packages` [(module, extra)]."""
    out = [f"{who} needs the package {module!r}, which is not installed here; install it with: pip install "
           f"'difrl[{extra}]'" for module, extra in packages if not installed(module)]
    for option, (what, needs) in local_paths.items():
        value = options.get(option)
        if value in (None, "") and option not in required:
            continue  # optional and unset: the reward's default (e.g. processor_dir = model_dir)
        where = dict(option=f"{prefix}.{option}", who=who, error=RewardConfigError)
        try:
            if needs is None:
                local.local_file(value, what, **where)
            else:
                local.local_dir(value, what, **where, needs=needs)
        except RewardConfigError as e:
            out.append(str(e))
    out += [f"{who} needs {prefix}.{option}" for option in required
            if option not in local_paths and options.get(option) in (None, "")]
    return out


def installed(module: str) -> bool:
    """Whether the top-level package `module` is installed (found, not imported)."""
    return importlib.util.find_spec(module) is not None
