"""The model-family registration hook (difrl.models.register_model, the `difrl.models` entry points) and the guide.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_model_registry.py -q

A family registered from outside difrl (tests/model_plugins.py: model.kind "example") is a kind every table accepts:
the configs (load_flow_config, load_train_config, `difrl config`'s listing), the worlds and the loader; installed as
an entry point, its module is imported only when its kind is built, never when difrl or a config loads. A class that
lacks a hook, or a kind already taken, is refused at registration; an unknown kind gets an error listing the known
kinds and how to add one; a Wan 2.2 TI2V checkpoint is kind wan22. docs/guides/adding-a-model.md's example is tests/model_plugins.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("diffusers")

import model_plugins  # noqa: E402  (tests/ is on sys.path: registers "example")
from difrl.config import ConfigError  # noqa: E402
from difrl.models import adapters  # noqa: E402
from difrl.models.diffusers_base import DiffusersFlowPolicy  # noqa: E402
from difrl.train.config import load_flow_config  # noqa: E402
from difrl.train.recipes import load_train_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "flux_tiny.yaml"


def test_a_registered_family_is_a_kind_every_table_accepts():
    from difrl.config import describe_config
    from difrl.models import model_kinds, register_model
    from difrl.train.config import FlowConfig
    from difrl.worlds import flow_kinds, world_file

    assert register_model is adapters.register_model  # difrl.models' name for the hook
    assert adapters.ADAPTERS["example"] is model_plugins.ExamplePolicy and model_plugins.ExamplePolicy.kind == "example"
    assert "example" in model_kinds() and "example" in flow_kinds()
    assert world_file("example").__name__ == "difrl.worlds.diffusers"
    assert load_flow_config(CONFIG, ["model.kind=example"]).model.kind == "example"
    cfg = load_train_config(CONFIG, ["model.kind=example"])
    assert type(cfg).__name__ == "FlowConfig" and cfg.model.kind == "example"
    listing = next(ln for ln in describe_config(FlowConfig).splitlines() if ln.startswith("model.kind"))
    assert "example" in listing  # `difrl config` lists it among the choices


def test_registration_refuses_an_incomplete_class_and_a_taken_kind(monkeypatch):
    monkeypatch.setattr(adapters, "ADAPTERS", dict(adapters.ADAPTERS))  # registrations here end with the test

    class NoHooks(DiffusersFlowPolicy):
        pipeline_class = "StableDiffusion3Pipeline"
        accepted_classes = ("StableDiffusion3Pipeline",)
        required_components = ("transformer",)

    with pytest.raises(TypeError, match=r"no _encode_batch\(\); no _forward\(\); no _vae_latents\(\).*empty "
                                        r"block_classes \(FSDP.*docs/guides/adding-a-model\.md"):
        adapters.register_model("nohooks")(NoHooks)
    with pytest.raises(TypeError, match="not a subclass of .*DiffusersFlowPolicy"):
        adapters.register_model("plain")(object)
    with pytest.raises(ValueError, match="model kind 'sd3' is already difrl.models.sd3.SD3Policy"):
        adapters.register_model("sd3")(type("Again", (model_plugins.ExamplePolicy,), {}))
    twin = adapters.register_model("example_twin")(type("Twin", (model_plugins.ExamplePolicy,), {}))
    assert twin.kind == "example_twin" and model_plugins.ExamplePolicy.kind == "example"  # the subclass's own kind
    assert "nohooks" not in adapters.ADAPTERS and "plain" not in adapters.ADAPTERS


def test_an_unknown_kind_lists_the_known_ones_and_says_how_to_add_one(tmp_path):
    from difrl.models.adapters import load_flow_policy
    from difrl.worlds import build_world

    how = r"register_model\(kind\).*'difrl\.models' entry-point group \(docs/guides/adding-a-model\.md\)"
    for load in (load_train_config, load_flow_config):  # `difrl train` / the entry scripts, and the flow config
        with pytest.raises(ConfigError, match=rf"model\.kind.*'nosuchmodel' is not an allowed choice.*'flux', 'sd3', "
                                              rf"'wan'.*{how}"):
            load(CONFIG, ["model.kind=nosuchmodel"])
    # (a near miss of a real kind is named first)
    with pytest.raises(ValueError, match=rf"unknown model kind 'nosuchmodel'; (did you mean '\w+'\? )?known: flux, sd3, "
                                         rf"wan.*{how}"):
        load_flow_policy("nosuchmodel", tmp_path)
    with pytest.raises(ValueError, match=rf"did you mean 'sd3'\?.*{how}"):
        load_flow_policy("sd33", tmp_path)
    with pytest.raises(ValueError, match=rf"unknown model.kind 'nosuchmodel'; known: digits, moving_digits, flux.*{how}"):
        build_world("nosuchmodel", str(tmp_path))


def test_a_wan22_ti2v_checkpoint_trains_as_kind_wan22_and_each_wan_kind_names_the_other():
    """Wan 2.2 (TI2V-5B: WanPipeline with expand_timesteps; A14B: two experts) is model.kind=wan22
    (difrl/models/wan22.py): the tiny TI2V pipeline loads there; kind wan refuses either naming wan22, and kind wan22
    refuses a Wan 2.1 pipeline naming wan."""
    from difrl.models.adapters import build_tiny_pipeline
    from difrl.models.wan import WanPolicy
    from difrl.models.wan22 import Wan22Policy

    ti2v = build_tiny_pipeline("wan22")
    policy = Wan22Policy(ti2v, height=32, width=32, num_frames=5)
    assert policy.kind == "wan22" and tuple(policy.latent_shape) == (48, 2, 2, 2)
    with pytest.raises(ValueError, match=r"Wan 2.2 TI2V \(expand_timesteps\).*model.kind=wan22"):
        WanPolicy(ti2v, height=32, width=32, num_frames=5)
    with pytest.raises(ValueError, match=r"no expand_timesteps and no transformer_2 \(a Wan 2.1 text-to-video "
                                         r"checkpoint\): set model.kind=wan"):
        Wan22Policy(SimpleNamespace(transformer_2=None, config={"expand_timesteps": False, "boundary_ratio": None}))
    two_experts = SimpleNamespace(transformer_2=object(), config={"boundary_ratio": 0.875})
    with pytest.raises(ValueError, match=r"Wan 2.2 two-expert \(A14B\).*model.kind=wan22"):
        WanPolicy(two_experts)  # A14B trains as wan22 too: tests/test_wan22.py
    with pytest.raises(ValueError, match=r"a transformer_2 and boundary_ratio=None: Wan 2.2 A14B needs both"):
        Wan22Policy(SimpleNamespace(transformer_2=object(), config={"boundary_ratio": None}))


def test_an_entry_point_family_is_imported_only_when_its_kind_is_built(tmp_path):
    """A package outside difrl (here tests/model_plugins.py with a dist-info naming it under the difrl.models group):
    importing difrl and loading a config with its kind import nothing of it; building its world's adapter does."""
    site = tmp_path / "site"
    dist = site / "example_family-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[difrl.models]\nexample = model_plugins:ExamplePolicy\n")
    script = textwrap.dedent(f"""
        import sys
        import difrl, difrl.models, difrl.worlds, difrl.train.config, difrl.cli.weights
        from difrl.train.recipes import load_train_config
        assert "model_plugins" not in sys.modules, "imported with difrl"
        cfg = load_train_config({str(CONFIG)!r}, ["model.kind=example"])
        from difrl.models.adapters import model_kinds, adapter_class
        assert cfg.model.kind == "example" and "example" in model_kinds()
        assert difrl.cli.weights.is_diffusers("example")  # difrl eval / sample: a run's lora/ or transformer/, not a bundled world
        assert "model_plugins" not in sys.modules, "imported by the config"
        cls = adapter_class("example")
        assert "model_plugins" in sys.modules and cls.__name__ == "ExamplePolicy" and cls.kind == "example"
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site), str(ROOT / "tests")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_the_guide_shows_the_example_family_as_the_tests_run_it():
    """docs/guides/adding-a-model.md's example block is tests/model_plugins.py, character for character: the code the
    family tests run (tests/test_diffusers_models.py, tests/test_train_diffusers.py) is the code a reader copies."""
    guide = (ROOT / "docs" / "guides" / "adding-a-model.md").read_text()
    blocks = re.findall(r"```python\n# tests/model_plugins\.py\n(.*?)```", guide, flags=re.S)
    assert len(blocks) == 1, "the guide has one example block, headed '# tests/model_plugins.py'"
    assert blocks[0] == (ROOT / "tests" / "model_plugins.py").read_text()
