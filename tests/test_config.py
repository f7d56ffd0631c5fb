from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
import yaml

from difrl.config import (
    ConfigError,
    apply_overrides,
    cfg_field,
    config_error,
    config_from_dict,
    config_to_dict,
    describe_config,
    load_config,
    save_config,
)


@dataclass
class SamplerConfig:
    kind: str = cfg_field("flow_sde", choices=("ode", "flow_sde", "dance_sde", "cps"), help="step kernel")
    num_steps: int = cfg_field(10, ge=1, help="denoising steps")
    noise_level: float = cfg_field(0.7, ge=0.0, help="a / eta")
    window: tuple[int, int] | None = cfg_field(None, help="SDE window")
    mode: Literal["train", "eval"] = cfg_field("train")

    def validate(self) -> None:
        if self.window is not None and not 0 <= self.window[0] < self.window[1] <= self.num_steps:
            raise config_error("window", f"{self.window} must satisfy 0 <= lo < hi <= num_steps")


@dataclass
class TrainConfig:
    lr: float = cfg_field(3e-4, gt=0.0)
    clip_range: list[float] = cfg_field(default_factory=lambda: [1e-4, 1e-4])
    betas: tuple[float, ...] = cfg_field((0.9, 0.999))
    use_ema: bool = cfg_field(False)


@dataclass
class RootConfig:
    seed: int = cfg_field(0, help="random seed")
    out: str | None = cfg_field(None)
    tag: Optional[str] = cfg_field(None)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rewards: dict[str, float] = cfg_field(default_factory=lambda: {"digit_prob": 1.0})


@dataclass
class NeedsPath:
    data: str = cfg_field(help="dataset path")
    batch: int = cfg_field(4)


CALLS: list[str] = []


@dataclass
class Child:
    x: int = cfg_field(1)

    def validate(self) -> None:
        CALLS.append("child")


@dataclass
class Parent:
    lo: int = cfg_field(0)
    hi: int = cfg_field(5)
    child: Child = field(default_factory=Child)

    def validate(self) -> None:
        CALLS.append("parent")
        if self.lo >= self.hi:
            raise config_error("lo", "must be smaller than hi")


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------ loading
def test_defaults_without_file():
    cfg = load_config(RootConfig, None)
    assert cfg == RootConfig()


def test_yaml_and_override_precedence(tmp_path):
    path = write(tmp_path, "seed: 3\ntrain:\n  lr: 0.01\n  use_ema: true\nsampler:\n  kind: ode\n")
    cfg = load_config(RootConfig, path, ["train.lr=1e-4", "sampler.num_steps=20"])
    assert cfg.seed == 3  # from YAML
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)  # override wins (a parsed decimal: exact)
    assert cfg.train.use_ema is True
    assert cfg.sampler.kind == "ode"  # YAML, sibling of an override
    assert cfg.sampler.num_steps == 20
    assert cfg.sampler.noise_level == 0.7  # default
    assert cfg.train.clip_range == [1e-4, 1e-4]


def test_later_override_wins():
    cfg = load_config(RootConfig, None, ["seed=1", "seed=2"])
    assert cfg.seed == 2


def test_float_from_string_in_yaml_and_cli(tmp_path):
    assert yaml.safe_load("1e-4") == "1e-4"  # the reason for the special case
    path = write(tmp_path, "train:\n  lr: 1e-4\n")
    assert load_config(RootConfig, path).train.lr == 1e-4  # parsed: exact
    cfg = load_config(RootConfig, None, ["train.lr=3e-5", "train.clip_range=[1e-3, 2e-3]"])
    assert cfg.train.lr == 3e-5  # float('3e-5') is the literal: exact
    assert cfg.train.clip_range == [1e-3, 2e-3]


def test_int_accepted_for_float():
    cfg = load_config(RootConfig, None, ["sampler.noise_level=1"])
    assert cfg.sampler.noise_level == 1.0 and isinstance(cfg.sampler.noise_level, float)


def test_cli_number_for_str_field_keeps_text():
    cfg = load_config(RootConfig, None, ["out=2024", "tag=0.10"])
    assert cfg.out == "2024" and cfg.tag == "0.10"


def test_optional_none_and_value():
    assert load_config(RootConfig, None, ["out=null"]).out is None
    assert load_config(RootConfig, None, ["out=runs/a"]).out == "runs/a"
    assert load_config(RootConfig, None, ["sampler.window=null"]).sampler.window is None


def test_tuple_from_list():
    cfg = load_config(RootConfig, None, ["sampler.window=[0, 3]", "train.betas=[0.5, 0.6, 0.7]"])
    assert cfg.sampler.window == (0, 3)
    assert cfg.train.betas == (0.5, 0.6, 0.7)


def test_tuple_length_checked():
    with pytest.raises(ConfigError, match=r"'sampler\.window' \(command line\) got \[1, 2, 3\].*tuple\[int, int\].*2 items"):
        load_config(RootConfig, None, ["sampler.window=[1, 2, 3]"])


def test_tuple_item_type_checked():
    with pytest.raises(ConfigError, match=r"'sampler\.window\[1\]' \(command line\) got 'x' \(str\); expected int"):
        load_config(RootConfig, None, ["sampler.window=[1, x]"])


def test_dict_field(tmp_path):
    path = write(tmp_path, "rewards:\n  aesthetic: 0.5\n  ocr: 2\n")
    cfg = load_config(RootConfig, path)
    assert cfg.rewards == {"aesthetic": 0.5, "ocr": 2.0}  # YAML mapping replaces the default dict
    cfg = load_config(RootConfig, None, ["rewards.aesthetic=0.25"])
    assert cfg.rewards == {"digit_prob": 1.0, "aesthetic": 0.25}  # dotted override adds an entry
    with pytest.raises(ConfigError, match=r"'rewards\.ocr' \(in .*c\.yaml\) got 'lots' \(str\); expected float"):
        load_config(RootConfig, write(tmp_path, "rewards:\n  ocr: lots\n"))


def test_literal():
    assert load_config(RootConfig, None, ["sampler.mode=eval"]).sampler.mode == "eval"
    with pytest.raises(ConfigError, match=r"'sampler\.mode' \(command line\) got 'test'; expected one of 'train', 'eval'"):
        load_config(RootConfig, None, ["sampler.mode=test"])


# ------------------------------------------------------------------ errors
def test_unknown_key_suggestion(tmp_path):
    path = write(tmp_path, "train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr' \(in .*c\.yaml\); did you mean 'train\.lr'\?"):
        load_config(RootConfig, path)


def test_unknown_key_cli_and_top_level():
    with pytest.raises(ConfigError, match=r"unknown config key 'sampler\.num_step' \(command line\); did you mean 'sampler\.num_steps'\?"):
        load_config(RootConfig, None, ["sampler.num_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'sed' \(command line\); did you mean 'seed'\?"):
        load_config(RootConfig, None, ["sed=3"])


def test_unknown_key_lists_valid_keys_when_nothing_close():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.zzzz'.*valid keys at 'train': lr, clip_range, betas, use_ema") as ei:
        load_config(RootConfig, None, ["train.zzzz=1"])
    assert ei.value.key == "train.zzzz"


def test_wrong_type_message():
    with pytest.raises(ConfigError, match=re.escape("config key 'train.lr' (command line) got 'abc' (str); expected float")):
        load_config(RootConfig, None, ["train.lr=abc"])


def test_bool_not_accepted_for_numbers():
    with pytest.raises(ConfigError, match=r"'seed' \(command line\) got True \(bool\); expected int"):
        load_config(RootConfig, None, ["seed=true"])
    with pytest.raises(ConfigError, match=r"'train\.lr' \(command line\) got False \(bool\); expected float"):
        load_config(RootConfig, None, ["train.lr=false"])


def test_float_not_accepted_for_int():
    with pytest.raises(ConfigError, match=r"'sampler\.num_steps' \(command line\) got 2\.5 \(float\); expected int"):
        load_config(RootConfig, None, ["sampler.num_steps=2.5"])


def test_mapping_where_scalar_expected(tmp_path):
    path = write(tmp_path, "seed:\n  a: 1\n")
    with pytest.raises(ConfigError, match=r"'seed' \(in .*c\.yaml\) got a mapping \{'a': 1\}; expected int \(a single value, not a section\)"):
        load_config(RootConfig, path)


def test_scalar_where_mapping_expected(tmp_path):
    path = write(tmp_path, "sampler: 5\n")
    with pytest.raises(ConfigError, match=r"'sampler' \(in .*c\.yaml\) got 5 \(int\); expected a mapping of SamplerConfig settings"):
        load_config(RootConfig, path)
    with pytest.raises(ConfigError, match=r"cannot apply override 'sampler\.kind=ode'.*'sampler' holds 5"):
        load_config(RootConfig, path, ["sampler.kind=ode"])


def test_out_of_range():
    with pytest.raises(ConfigError, match=re.escape("config key 'sampler.num_steps' (command line) = 0 is out of range; expected >= 1")):
        load_config(RootConfig, None, ["sampler.num_steps=0"])
    with pytest.raises(ConfigError, match=re.escape("config key 'train.lr' (command line) = 0.0 is out of range; expected > 0.0")):
        load_config(RootConfig, None, ["train.lr=0.0"])


def test_not_in_choices(tmp_path):
    path = write(tmp_path, "sampler:\n  kind: euler\n")
    with pytest.raises(ConfigError, match=r"'sampler\.kind' \(in .*c\.yaml\) = 'euler' is not an allowed choice; expected one of 'ode', 'flow_sde', 'dance_sde', 'cps'"):
        load_config(RootConfig, path)


@pytest.mark.parametrize("arg", ["train.lr", "=3", ".lr=3", "train..lr=3", "train.=1"])
def test_malformed_override(arg):
    with pytest.raises(ConfigError, match=r"malformed override " + re.escape(repr(arg))):
        load_config(RootConfig, None, [arg])


def test_override_value_bad_yaml():
    with pytest.raises(ConfigError, match=r"malformed override 'train.clip_range=\[1, 2'.*not valid YAML"):
        load_config(RootConfig, None, ["train.clip_range=[1, 2"])


def test_yaml_not_a_mapping(tmp_path):
    path = write(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml must contain a mapping at the top level, got list"):
        load_config(RootConfig, path)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "seed: 1\ntrain:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*c\.yaml \(line \d+, column \d+\)"):
        load_config(RootConfig, path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(RootConfig, tmp_path / "nope.yaml")


def test_missing_required_field(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required config key 'data'") as ei:
        load_config(NeedsPath, write(tmp_path, "batch: 2\n"))
    assert ei.value.key == "data"
    assert load_config(NeedsPath, None, ["data=/tmp/x"]).data == "/tmp/x"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------ validate()
def test_validate_called_children_first():
    CALLS.clear()
    cfg = load_config(Parent, None, ["child.x=2"])
    assert cfg.child.x == 2
    assert CALLS == ["child", "parent"]


def test_validate_error_gets_dotted_key():
    with pytest.raises(ConfigError, match=r"config key 'lo' \(command line\) is invalid: must be smaller than hi"):
        load_config(Parent, None, ["lo=9"])
    with pytest.raises(ConfigError, match=r"config key 'sampler\.window' \(command line\) is invalid: \(2, 50\) must satisfy") as ei:
        load_config(RootConfig, None, ["sampler.window=[2, 50]"])
    assert ei.value.key == "sampler.window"


# ------------------------------------------------------------------ dict / overrides on instances
def test_config_from_dict_source_label():
    cfg = config_from_dict(RootConfig, {"seed": 5, "sampler": {"kind": "cps"}})
    assert cfg.seed == 5 and cfg.sampler.kind == "cps"
    with pytest.raises(ConfigError, match=r"'seed' \(in checkpoint\) got 'x'"):
        config_from_dict(RootConfig, {"seed": "x"}, source="checkpoint")


def test_apply_overrides_on_instance():
    base = load_config(RootConfig, None, ["seed=7", "rewards.ocr=2"])
    new = apply_overrides(base, ["train.lr=1e-5", "rewards.ocr=3"])
    assert new is not base
    assert new.seed == 7 and new.train.lr == 1e-5  # parsed decimals: exact
    assert new.rewards == {"digit_prob": 1.0, "ocr": 3.0}
    assert base.train.lr == 3e-4  # original untouched
    with pytest.raises(ConfigError, match=r"'train\.lr' \(command line\) got 'fast'"):
        apply_overrides(base, ["train.lr=fast"])


def test_nested_defaults_from_parent_factory():
    @dataclass
    class Outer:
        sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(num_steps=40))

    cfg = config_from_dict(Outer, {"sampler": {"kind": "ode"}})
    assert cfg.sampler.num_steps == 40 and cfg.sampler.kind == "ode"


# ------------------------------------------------------------------ serialisation
def test_config_to_dict_plain():
    cfg = load_config(RootConfig, None, ["sampler.window=[1, 4]"])
    d = config_to_dict(cfg)
    assert d["sampler"]["window"] == [1, 4]
    assert d["train"]["betas"] == [0.9, 0.999]
    assert d["rewards"] == {"digit_prob": 1.0}
    assert isinstance(d["sampler"], dict)


def test_save_load_round_trip(tmp_path):
    cfg = load_config(RootConfig, None, ["seed=11", "out=runs/x", "sampler.window=[1, 4]",
                                         "train.lr=1e-4", "rewards.ocr=0.5", "tag=1e-4"])
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    assert load_config(RootConfig, path) == cfg
    assert load_config(RootConfig, str(path)) == cfg
    assert sorted(os.listdir(path.parent)) == ["config.yaml"]  # no temp files left behind
    save_config(apply_overrides(cfg, ["seed=12"]), path)  # overwrite in place
    assert load_config(RootConfig, path).seed == 12


def test_describe_config_lists_nested_keys():
    text = describe_config(RootConfig)
    for key in ["seed", "out", "sampler.kind", "sampler.num_steps", "sampler.window",
                "train.lr", "train.clip_range", "rewards"]:
        assert re.search(rf"^{re.escape(key)}\s", text, re.M), key
    line = next(ln for ln in text.splitlines() if ln.startswith("sampler.num_steps"))
    assert "int" in line and "10" in line and "denoising steps" in line and ">= 1" in line
    kind = next(ln for ln in text.splitlines() if ln.startswith("sampler.kind"))
    assert "one of: ode, flow_sde, dance_sde, cps" in kind
    assert "tuple[int, int] | None" in text
    assert "(required)" in describe_config(NeedsPath)


# ---------------------------------------------------------------------------------- the trainers' configs
def test_the_trainer_is_chosen_from_the_typed_model_kind(tmp_path):
    from difrl.train.config import FlowConfig
    from difrl.train.recipes import load_train_config
    from difrl.train.masked.config import MaskedConfig

    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    assert type(load_train_config(os.path.join(root, "digits.yaml"))) is FlowConfig
    sudoku = load_train_config(os.path.join(root, "sudoku.yaml"), ["train.iterations=3"])
    assert type(sudoku) is MaskedConfig and sudoku.trainer == "masked" and sudoku.train.iterations == 3
    assert type(load_train_config(None, ["model.kind=digit_tokens"])) is MaskedConfig  # an override picks it too
    assert type(load_train_config(None)) is FlowConfig  # no model.kind: the default world (digits)
    # the masked sections' defaults: the common TrainConfig with the masked trainer's values
    m = load_train_config(None, ["model.kind=sudoku"])
    assert (m.train.lr, m.train.clip_low, m.train.lora.enabled, m.advantage.eps, m.eval.every) == (1e-4, 0.2, False, 1e-5, 0)
    # an unknown kind names the key, where it came from and the choices
    with pytest.raises(ConfigError, match=r"'model.kind' \(command line\) = 'sudok'.*did you mean 'sudoku'"):
        load_train_config(os.path.join(root, "digits.yaml"), ["model.kind=sudok"])
    path = tmp_path / "x.yaml"
    path.write_text("model: {kind: fluxx}\n")
    with pytest.raises(ConfigError, match=rf"'model.kind' \(in {re.escape(str(path))}\) = 'fluxx'.*'flux'"):
        load_train_config(path)
    # a key of the other trainer is an unknown key of this one
    with pytest.raises(ConfigError, match="unknown config key 'estimator'"):
        load_train_config(os.path.join(root, "digits.yaml"), ["estimator.kind=d1"])


def test_a_diffusers_world_must_name_its_reward():
    from difrl.train.recipes import load_train_config

    with pytest.raises(ConfigError, match=r"'reward.weights'.*model.kind=flux has no reward of its own"):
        load_train_config(None, ["model.kind=flux", "model.path=/nowhere", "model.prompts=[a cat]"])


def test_empty_config_file_is_refused(tmp_path):
    from difrl.config import ConfigError
    from difrl.train.recipes import load_train_config

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_train_config(empty)
