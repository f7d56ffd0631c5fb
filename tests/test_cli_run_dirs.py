"""`difrl eval RUN_DIR` and `difrl sample RUN_DIR` on a trained run of every world (issue 39 items 5, 6): the run's
config.yaml and final weights (policy.safetensors, lora/ or transformer/), the same evaluation as the run's own final
one, and a clear error for what a world cannot do.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_cli_run_dirs.py -q

Each world trains once per module (1 iteration, a tiny evaluation; seconds each on one thread).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
FLOW = ["threads=1", "train.iterations=1", "eval.per_digit=1", "rollout.prompts_per_iter=2", "rollout.group_size=4",
        "train.grad_accum=1", "checkpoint_every=0",
        "train.updates_per_epoch=null"]  # digits.yaml makes 2 updates per rollout; these 8 samples make 1
MASKED = ["threads=1", "train.iterations=1", "rollout.prompts_per_iter=2", "rollout.group_size=4", "train.micro_batch=8",
          "train.inner_updates=1", "checkpoint_every=0",
          "train.updates_per_epoch=null"]  # the masked configs make 2 updates per pass; these 8 samples make 1
DIFFUSERS = ["rollout.prompts_per_iter=2", "rollout.group_size=2", "sampler.num_steps=3", "eval.num_steps=3",
             "eval.per_digit=1", "train.iterations=1", "train.micro_batch=4", "train.grad_accum=1"]
# world -> (config, overrides, the weights the run writes, its headline eval key, what its samples are)
WORLDS = {
    "digits": ("digits.yaml", [*FLOW, "train.micro_batch=72"], "policy.safetensors", "accuracy", "png"),
    "moving_digits": ("moving_digits.yaml", [*FLOW, "train.micro_batch=56"], "policy.safetensors", "motion_accuracy",
                      "gif"),
    "digit_tokens": ("digit_tokens.yaml", [*MASKED, "eval.per_digit=1"], "policy.safetensors", "accuracy", "png"),
    "sudoku": ("sudoku.yaml", [*MASKED, "eval.count=8"], "policy.safetensors", "cell_accuracy", "text"),
    "text": ("text_arithmetic.yaml", [*MASKED, "seed=3", "eval.count=4", "eval.samples=2", "eval.pass_k=[1,2]",
                                      "eval.every=0"], "policy.safetensors", "pass@1", "text"),
    "flux_lora": ("flux_tiny.yaml", DIFFUSERS, "lora", "reward", "png"),
    "sd3_full": ("sd3_tiny.yaml", [*DIFFUSERS, "train.lora.enabled=false", "train.lr=1e-3"], "transformer", "reward",
                 "png"),
    "wan_lora": ("wan_tiny.yaml", DIFFUSERS, "lora", "reward", "gif"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world -> its trained run directory, trained on first use (the tiny diffusers pipelines built once each)."""
    root, made = tmp_path_factory.mktemp("runs"), {}

    def get(world: str) -> Path:
        if world not in made:
            config, overrides, *_ = WORLDS[world]
            extra = []
            if world.partition("_")[0] in ("flux", "sd3", "wan"):
                from difrl.models.adapters import make_tiny_pipeline

                kind = world.partition("_")[0]
                extra = [f"model.path={make_tiny_pipeline(kind, root / f'pipe_{kind}', seed=0)}"]
            assert main(["train", str(CONFIGS / config), *overrides, *extra, "--out", str(root / world)]) == 0
            made[world] = root / world
        return made[world]

    return get


def _evals(run: Path) -> list[dict]:
    return json.loads((run / "eval.json").read_text())


@pytest.mark.parametrize("world", list(WORLDS))
def test_eval_of_a_run_dir_is_the_runs_final_evaluation(runs, world, capsys):
    config, _, weights, key, _ = WORLDS[world]
    run = runs(world)
    assert (run / weights).exists()
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0, capsys.readouterr().err
    after, mine = next(e for e in _evals(run) if e["tag"] == "after"), _evals(run)[-1]
    assert mine["tag"] == "difrl-eval" and mine["policy"] == str(run / weights)
    assert mine[key] == after[key]  # the trained policy under the run's own evaluation settings, not the base


@pytest.mark.parametrize("world", list(WORLDS))
def test_sample_of_a_run_dir_uses_its_trained_policy(runs, world, tmp_path, capsys):
    _, _, weights, _, shown = WORLDS[world]
    run = runs(world)
    capsys.readouterr()
    grid = tmp_path / "g.png"
    args = ["sample", str(run), "--samples", "2", *([] if shown == "text" else ["--grid", str(grid)])]
    assert main(args) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == str(run / weights) and out["results"]
    assert all(r["samples"] == 2 and isinstance(r["reward_mean"], float) for r in out["results"])
    if shown == "text":  # Sudoku grids and text completions are printed; there is no picture to write
        assert all(len(r["texts"]) == 2 and all(isinstance(t, str) for t in r["texts"]) for r in out["results"])
        assert main(["sample", str(run), "--samples", "1", "--grid", str(grid)]) == 2
        assert "samples are not pictures" in capsys.readouterr().err and not grid.exists()
    else:  # videos: a GIF beside the name
        assert out["grid"] == str(grid.with_suffix(f".{shown}")) and Path(out["grid"]).stat().st_size > 0


def test_sample_of_a_config_takes_a_checkpoint_and_prompts_each_world_reads(runs, tmp_path, capsys):
    # a diffusers LoRA on the config's pipeline (the LoRA file inside lora/ stands for the directory)
    run = runs("flux_lora")
    pipe = next(ln.split(": ", 1)[1] for ln in (run / "config.yaml").read_text().splitlines() if ln.strip().startswith("path:"))
    lora_file = next((run / "lora").glob("*.safetensors"))
    assert main(["sample", str(CONFIGS / "flux_tiny.yaml"), f"model.path={pipe}", "--checkpoint", str(lora_file),
                 "--samples", "1", "--prompt", "a red dog"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == str(run / "lora")
    # Sudoku takes a puzzle, digit tokens a digit prompt; a text task's problem needs its answer: refused
    assert main(["sample", str(runs("sudoku")), "--samples", "1", "--prompt", "12.4/..3./4.../...1"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["prompt"] == "12.4/..3./4.../...1" and res["texts"][0].startswith("12")
    assert main(["sample", str(runs("sudoku")), "--prompt", "12345"]) == 2
    assert "not a 4x4 Sudoku puzzle" in capsys.readouterr().err
    assert main(["sample", str(runs("digit_tokens")), "--samples", "1", "--prompt", "a handwritten 7"]) == 0
    assert [r["prompt"] for r in json.loads(capsys.readouterr().out)["results"]] == ["a handwritten 7"]
    assert main(["sample", str(runs("text")), "--prompt", "1+2="]) == 2
    assert "takes no prompt typed by hand" in capsys.readouterr().err
    assert main(["sample", str(runs("sudoku")), "--search", "dts"]) == 2
    assert "masked world" in capsys.readouterr().err


def test_sample_of_a_moving_digits_config_writes_a_gif(tmp_path, capsys):
    """The bundled base of a video world (no run): `--grid g.png` used to fail with "too many values to unpack"."""
    assert main(["sample", str(CONFIGS / "moving_digits.yaml"), "--samples", "1", "--prompt", "a 3 moving left",
                 "--grid", str(tmp_path / "g.png")]) == 0
    assert json.loads(capsys.readouterr().out)["grid"] == str(tmp_path / "g.gif") and (tmp_path / "g.gif").is_file()


def test_eval_checkpoint_of_a_moving_digits_run(runs, capsys):
    """--checkpoint policy.safetensors on a moving-digits config (it used to ask for a diffusers directory)."""
    run = runs("moving_digits")
    capsys.readouterr()
    assert main(["eval", str(CONFIGS / "moving_digits.yaml"), "threads=1", "eval.per_digit=1",
                 "--checkpoint", str(run / "policy.safetensors"), "--out", str(run / "x.json")]) == 0
    after = next(e for e in _evals(run) if e["tag"] == "after")
    assert json.loads((run / "x.json").read_text())["motion_accuracy"] == after["motion_accuracy"]
    assert main(["eval", str(CONFIGS / "moving_digits.yaml"), "--checkpoint", str(run)]) == 0  # a run dir: its weights
    assert main(["eval", str(CONFIGS / "moving_digits.yaml"), "--checkpoint", str(run / "samples")]) == 2
    assert "not a file: model.kind=moving_digits takes a run's policy.safetensors file" in capsys.readouterr().err
