"""The world seam: a world defined here, with its own eval line, early-stop rule and final save, is used by the
trainers and by `difrl export` without any change to them (difrl/worlds/contract.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_world_seams.py -q

The worlds are the bundled digits and Sudoku worlds with those three members replaced (dataclasses.replace), handed
to the trainers through their `build_world` / `build_masked_world` names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest


class SecondEval:
    """A stop rule of this file: stop at the second evaluation, counting them in the run's state."""

    def initial_state(self) -> dict:
        return {"test_evals": 0}

    def lift(self, state: dict) -> None:
        state["test_evals"] = 0

    def __call__(self, cfg, ev: dict, state: dict) -> str | None:
        state["test_evals"] += 1
        return "the test rule's second evaluation" if state["test_evals"] >= 2 else None


def save_note(policy, net, lora: bool, out_dir: Path, write_merged) -> None:
    """A final save of this file: a note naming the trained parameters, and the merged checkpoint under its own name."""
    names = sorted(n for n, p in net.named_parameters() if p.requires_grad)
    (Path(out_dir) / "note.json").write_text(json.dumps({"lora": lora, "trained": len(names)}))
    write_merged(Path(out_dir) / "merged.safetensors")


def own_world(world):
    return dataclasses.replace(world, describe_eval=lambda ev: f"TEST LINE accuracy={ev['accuracy']:.2f}",
                               stop=SecondEval(), save_final=save_note)


@pytest.fixture
def flow_world_of_this_file(monkeypatch):
    import difrl.train.flow.trainer
    import difrl.worlds
    from difrl.worlds import build_world

    built = lambda *a, **kw: own_world(build_world(*a, **kw))  # noqa: E731
    monkeypatch.setattr(difrl.train.flow.trainer, "build_world", built)  # the trainer's
    monkeypatch.setattr(difrl.worlds, "build_world", built)  # difrl export's (imported when it runs)


def test_flow_trainer_and_export_use_the_worlds_eval_line_stop_rule_and_save(tmp_path, capsys, flow_world_of_this_file):
    from test_train import run

    from difrl.train.export import export
    from difrl.utils.io import load_safetensors_checked

    summary, d = run(tmp_path / "r", "train.iterations=5", "eval.every=1")
    out = capsys.readouterr().out
    assert "eval before: TEST LINE accuracy=" in out and "eval after:  TEST LINE accuracy=" in out
    # the rule stopped the run at its second evaluation (after iteration 2) and its counter is in the checkpoint
    assert summary["iterations"] == 2 and summary["stopped_early"] == "the test rule's second evaluation"
    state = json.loads((d / "checkpoints" / "iter-000002" / "state.json").read_text())
    assert state["test_evals"] == 2 and "best_fd" not in state
    # the world's own files, not the digits world's policy.safetensors
    trained = load_safetensors_checked(d / "checkpoints" / "iter-000002" / "trainable.safetensors", "test")[0]
    assert json.loads((d / "note.json").read_text()) == {"lora": True, "trained": len(trained)}  # LoRA: digits default
    assert (d / "merged.safetensors").is_file() and not (d / "policy.safetensors").exists()
    # difrl export writes them too, the same tensors as the run's final save (exact: the same checkpoint's weights)
    exported = export(d, out=tmp_path / "x", log=lambda s: None)
    assert sorted(p.name for p in exported.iterdir()) == ["merged.safetensors", "note.json"]
    mine, theirs = (load_safetensors_checked(p / "merged.safetensors", "test")[0] for p in (exported, d))
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)


def test_masked_trainer_uses_the_worlds_eval_line_and_save(tmp_path, capsys, monkeypatch):
    import difrl.train.masked.trainer
    from difrl.worlds import build_masked_world

    sudoku_line = lambda ev: f"TEST LINE cells={ev['cell_accuracy']:.2f}"  # noqa: E731
    monkeypatch.setattr(difrl.train.masked.trainer, "build_masked_world", lambda cfg: dataclasses.replace(
        build_masked_world(cfg), describe_eval=sudoku_line, save_final=save_note))
    from test_train_masked import run

    _, d = run(tmp_path / "r")
    out = capsys.readouterr().out
    assert "eval before: TEST LINE cells=" in out and "eval after:  TEST LINE cells=" in out
    assert json.loads((d / "note.json").read_text())["lora"] is False  # full fine-tuning: sudoku default
    assert (d / "merged.safetensors").is_file() and not (d / "policy.safetensors").exists()


# configs/digits.yaml made tiny (as tests/test_cli_run_dirs.py): one iteration of 8 samples, one image per digit
DIGITS_CLI = ["threads=1", "train.iterations=1", "eval.per_digit=1", "rollout.prompts_per_iter=2",
              "rollout.group_size=4", "train.grad_accum=1", "checkpoint_every=0", "train.updates_per_epoch=null",
              "train.micro_batch=72"]


def table_rows(out: str) -> list[str]:
    """The row names of the before/after table `difrl train` prints last (between its header and the next line
    that is not a row of three columns)."""
    lines = out.splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.split() == ["before", "after"])
    rows = []
    for ln in lines[start + 1:]:
        parts = ln.split()
        if len(parts) != 3:
            break
        rows.append(parts[0])
    return rows


def test_cli_table_lists_the_metrics_the_world_declares(tmp_path, capsys, monkeypatch):
    # the world of this file reports its own eval keys before / after (World.before_after, in its order), then its
    # headline; the CLI names none of them: not the digits world's fd and diversity, which this world does not list
    import difrl.train.flow.trainer
    from difrl.cli import main
    from difrl.worlds import build_world

    monkeypatch.setattr(difrl.train.flow.trainer, "build_world", lambda *a, **kw: dataclasses.replace(
        build_world(*a, **kw), before_after=("real_diversity", "judge_accuracy"), headline=("accuracy",)))
    config = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
    assert main(["train", str(config), *DIGITS_CLI, "--out", str(tmp_path / "r")]) == 0
    assert table_rows(capsys.readouterr().out) == ["real_diversity", "judge_accuracy", "accuracy"]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["before_after"] == ["real_diversity", "judge_accuracy", "accuracy"]  # the world's order, kept
