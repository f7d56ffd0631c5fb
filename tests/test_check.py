"""`difrl check CONFIG [key=value ...] [--gpus N]` lists every problem of a config at once, loading nothing, and
`difrl train` / the entry scripts stop with the same list (issue 49, "Configs that run as published").

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_check.py -q

Only configs are read here (no model, no weights, no run directory): each test takes a second or two.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from difrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
FLUX = CONFIGS / "flux_flow_grpo.yaml"
DIGITS = CONFIGS / "digits.yaml"
# the published recipes that need a user's paths (the tiny and bundled-world configs need none)
PUBLISHED = sorted(p.name for p in CONFIGS.glob("*.yaml")
                   if re.search(r"_(flow_grpo|flow_grpo_fast|dance_grpo|mix_grpo|sol_rl)\.yaml$", p.name))


@pytest.fixture(autouse=True)
def one_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # --gpus absent: 1 process, not the launcher's count


def check(capsys, *args) -> tuple[int, list[str], str]:
    """(exit status, the numbered problems, the whole output) of `difrl check ARGS`."""
    rc = main(["check", *map(str, args)])
    out = capsys.readouterr().out
    return rc, re.findall(r"^  \d+\. (.*)$", out, re.M), out


def test_flux_flow_grpo_as_published_lists_every_problem_in_one_run(capsys, tmp_path):
    """The trial of issue 49 took four runs, one error each; here one run names them all (and nothing else)."""
    rc, problems, out = check(capsys, FLUX)
    assert rc == 1 and out.startswith(f"difrl check: {FLUX}: 5 problems"), out
    assert len(problems) == 5, out
    path, prompts, model_dir, processor_dir, plan = problems
    assert path.startswith(f"model.path = '/path/to/FLUX.1-dev' (in {FLUX}) does not exist")
    assert prompts.startswith(f"model.prompt_file = '/path/to/prompts.txt' (in {FLUX}) does not exist")
    assert "reward 'pickscore'" in model_dir and "'/path/to/PickScore_v1'" in model_dir
    assert "reward.options.pickscore.model_dir" in model_dir
    assert "'/path/to/CLIP-ViT-H-14-laion2B-s32B-b79K'" in processor_dir
    assert "reward.options.pickscore.processor_dir" in processor_dir
    # sized for 32 GPUs: on this one process the solver names the grad_accum that keeps 2 updates per rollout
    assert plan.startswith("the micro-batch plan on 1 process: ") and "use train.grad_accum=192" in plan

    # every path set to what exists, on the 32 processes it is sized for: OK
    pick, processor = tmp_path / "pick", tmp_path / "processor"
    for d, f in ((pick, "config.json"), (processor, "preprocessor_config.json")):
        d.mkdir()
        (d / f).write_text("{}")
    done = [f"model.path={tmp_path}", f"model.prompt_file={FLUX}", f"reward.options.pickscore.processor_dir={processor}"]
    rc, problems, out = check(capsys, FLUX, *done, f"reward.options.pickscore.model_dir={CONFIGS}", "--gpus", "32")
    assert rc == 1 and len(problems) == 1 and "reward.options.pickscore.model_dir" in problems[0], out
    assert "lacks config.json" in problems[0]  # a directory that is not a save_pretrained one: named too
    rc, problems, out = check(capsys, FLUX, *done, f"reward.options.pickscore.model_dir={pick}", "--gpus", "32")
    assert rc == 0 and problems == [] and out.startswith(f"difrl check: {FLUX}: OK (model.kind=flux"), out


def test_gpus_reports_the_plan_and_an_impossible_one_is_a_problem(capsys):
    rc, problems, out = check(capsys, DIGITS, "--gpus", "8")
    assert rc == 0 and problems == [], out
    assert out.startswith(f"difrl check: {DIGITS}: OK (model.kind=digits, flow trainer; on 8 processes: 160 "
                          "samples/iteration (10 groups of 16), 20 per process;"), out
    assert "2 optimizer update(s) per rollout" in out and "2 sample(s) x 9 steps = 18 transitions" in out

    rc, problems, out = check(capsys, DIGITS, "--gpus", "3")  # 160 samples do not split over 3 processes
    assert rc == 1 and len(problems) == 1, out
    assert problems[0].startswith("the micro-batch plan on 3 processes: 160 samples (rollout.prompts_per_iter x "
                                  "rollout.group_size) per iteration do not split evenly over 3 processes")

    # the FLUX recipe on 8 GPUs: the grad_accum its header names; on the 32 it is sized for, the plan is fine
    rc, problems, out = check(capsys, FLUX, "--gpus", "8")
    assert [p for p in problems if "micro-batch plan" in p][0].endswith("to take these") and \
        "use train.grad_accum=24 (with train.micro_batch=15)" in out, out
    rc, problems, out = check(capsys, FLUX, "--gpus", "32")
    assert len(problems) == 4 and not any("micro-batch plan" in p for p in problems), out
    assert "micro-batch plan on 32 processes: 1152 samples/iteration (48 groups of 24), 36 per process;" in out

    # a masked config plans with the masked trainer's solver
    rc, problems, out = check(capsys, CONFIGS / "sudoku.yaml", "--gpus", "2")
    assert rc == 0 and "masked trainer; on 2 processes:" in out, out


@pytest.mark.parametrize("config", ["digits.yaml", "sudoku.yaml", "text_arithmetic.yaml", "moving_digits.yaml"])
def test_a_clean_config_passes_with_one_line(capsys, config):
    rc, problems, out = check(capsys, CONFIGS / config)
    assert rc == 0 and problems == [] and len(out.strip().splitlines()) == 1 and ": OK (" in out, out


def test_unknown_key_bad_value_bad_path_and_reward_options_are_all_reported(capsys):
    rc, problems, out = check(capsys, DIGITS, "train.lrr=1e-4", "sampler.kind=cpss", "model.path=/nowhere/g.safetensors",
                              'reward.weights={pickscore: 1.0, "nopkg_h3.rewards:score": 1.0}',
                              "reward.options={pickscore: {model_dir: /nowhere/pick, scal: div26}}")
    assert rc == 1 and len(problems) == 6, out
    unknown, kind, path, pick, pick_dir, module = problems
    assert unknown.startswith("unknown config key 'train.lrr' (command line); did you mean 'train.lr'?")
    assert kind.startswith("config key 'sampler.kind' (command line) = 'cpss' is not an allowed choice")
    assert path.startswith("model.path = '/nowhere/g.safetensors' (command line) does not exist: it takes a digits "
                           "generator checkpoint")
    assert pick.startswith("reward 'pickscore': unknown option reward.options.pickscore.scal (it takes: model_dir, ")
    assert pick_dir.startswith("reward 'pickscore': the CLIP model directory not found at '/nowhere/pick' "
                               "(reward.options.pickscore.model_dir)")
    assert "No module named 'nopkg_h3'" in module
    # the directory is checked once the option is spelt right (the messages are the reward's own)
    rc, problems, out = check(capsys, DIGITS, "reward.weights={pickscore: 1.0}", "reward.options={pickscore: {}}")
    assert problems == ["reward 'pickscore' needs the CLIP model: set reward.options.pickscore.model_dir to a local "
                        "directory saved with save_pretrained (difrl never downloads weights)"], out


def test_held_out_panel_fid_aliased_rewards_and_packages_are_checked_too(capsys, monkeypatch):
    import difrl.rewards.preflight

    monkeypatch.setattr(difrl.rewards.preflight, "installed", lambda module: module != "open_clip")
    rc, problems, out = check(capsys, FLUX, "--gpus", "32", "reward.weights={remote@hps: 1.0}",
                              "eval.rewards={hpsv2: {checkpoint: /nowhere/hps.pt}}", "eval.fid.reference=/nowhere/ref")
    assert rc == 1 and len(problems) == 7, out  # model.path, model.prompt_file, and these five
    assert "eval.fid.reference = '/nowhere/ref' (command line) does not exist: it takes reference images" in out
    assert "eval.fid.reference is set, so the inception feature extractor needs its weights: set eval.fid.weights" in out
    assert "reward 'remote@hps' needs reward.options.remote@hps.url" in problems, out
    assert ("reward 'hpsv2' needs the package 'open_clip', which is not installed here; install it with: pip install "
            "'difrl[rewards]'") in problems, out
    assert any("(eval.rewards.hpsv2.checkpoint;" in p and "/nowhere/hps.pt" in p for p in problems), out


@pytest.mark.parametrize("config", PUBLISHED)
def test_published_recipes_use_built_in_rewards_and_name_every_path_at_the_top(capsys, config):
    """Every /path/to/ placeholder is a key of the file's one `set these` block, the rewards are built-ins, and with
    the processes its header launches `difrl check` finds nothing but those placeholders."""
    from difrl.rewards import REWARDS, unknown_reward

    text = (CONFIGS / config).read_text()
    tree = yaml.safe_load(text)

    def placeholders(node, prefix=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from placeholders(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, str) and node.startswith("/path/to/"):
            yield prefix

    keys = sorted(placeholders(tree))
    assert "model.path" in keys and "model.prompt_file" in keys
    blocks = re.findall(r"^# ---- set these.*\n((?:#.*\n)+?)[^#]", text, re.M)
    assert len(blocks) == 1, "one `set these` block"
    named = re.findall(r"^#   (\S+)", blocks[0], re.M)
    assert sorted(named) == keys, (named, keys)
    assert text.index("# ---- set these") < text.index("\nseed:"), "the block heads the file"
    for name in tree["reward"]["weights"]:
        assert unknown_reward(name) is None and name.partition("@")[0] in REWARDS, name
    assert "not part of difrl" not in text and "your_package" not in text

    gpus = re.search(r"--num_processes (\d+)", text.splitlines()[0])
    rc, problems, out = check(capsys, CONFIGS / config, "--gpus", gpus.group(1) if gpus else "8")
    assert rc == 1 and len(problems) == len(keys), out
    assert all("/path/to/" in p for p in problems), out


def test_train_stops_with_every_problem_before_loading_anything(tmp_path, capsys, monkeypatch):
    import difrl.train.flow.trainer

    def loaded(*a, **k):
        raise AssertionError("the trainer was called")

    monkeypatch.setattr(difrl.train.flow.trainer, "train", loaded)
    bad = ["train.lrr=1e-4", "model.path=/nowhere/g.safetensors"]
    assert main(["train", str(DIGITS), *bad, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"difrl train: error: 2 problems in {DIGITS} (nothing was loaded):\n"), err
    assert "  1. unknown config key 'train.lrr'" in err and "  2. model.path = '/nowhere/g.safetensors'" in err
    assert not (tmp_path / "run").exists()

    # the entry scripts (scripts/train_*.py) say the same
    from difrl.train.entry import main as entry_main

    assert entry_main("digits", [str(DIGITS), *bad, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert ": error: 2 problems in " in err and "train.lrr" in err and "/nowhere/g.safetensors" in err
    assert not (tmp_path / "run").exists()

    # one problem reads as the one error it always was
    assert main(["train", str(DIGITS), "train.lrr=1e-4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("difrl train: error: unknown config key 'train.lrr' (command line)") and "1." not in err


def test_config_loader_collects_instead_of_raising():
    from difrl.config import ConfigError, load_config
    from difrl.train.config import FlowConfig

    problems: list = []
    cfg = load_config(FlowConfig, DIGITS, ["train.lrr=1", "train.lr=-1", "sampler.kind=x", "rollout", "seed=1"],
                      problems)
    assert [e.key for e in problems] == [None, "train.lrr", "train.lr", "sampler.kind"], problems
    assert isinstance(problems[0], ConfigError) and "malformed override 'rollout'" in str(problems[0])
    # the refused values are the defaults; the rest is as given
    assert (cfg.train.lr, cfg.sampler.kind, cfg.seed) == (FlowConfig().train.lr, FlowConfig().sampler.kind, 1)
    with pytest.raises(ConfigError, match="malformed override 'rollout'"):  # without a list: the first, raised
        load_config(FlowConfig, DIGITS, ["train.lrr=1", "rollout"])


def test_fsdp_launch_config_says_checkpoints_are_sharded(tmp_path):
    """configs/accelerate/fsdp.yaml's header said checkpoints are gathered; under FSDP `auto` resolves to sharded."""
    from difrl.train.recipes import load_train_config
    from difrl.train.run.sharded_state import checkpoint_format

    header = "".join(l for l in (CONFIGS / "accelerate" / "fsdp.yaml").read_text().splitlines(True) if l.startswith("#"))
    cfg = load_train_config(DIGITS)
    assert cfg.train.checkpoint_format == "auto" and checkpoint_format(cfg, tmp_path, sharded=True) == "sharded"
    assert "Checkpoints are sharded" in re.sub(r"\n# ", " ", header)
    assert "Checkpoints and the final" not in header
