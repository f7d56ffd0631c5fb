"""What a new user runs from the README and the docs pages, end to end through the `difrl` command (issue 34, issue 32's CLI items):
evaluating trained text / diffusers runs, eval.json keeping every evaluation, a reward server that is down,
hints naming the right option, bad flags, and no third-party noise on stderr.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_cli_paths.py -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from difrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "configs" / "text_arithmetic.yaml"
FLUX = ROOT / "configs" / "flux_tiny.yaml"
DIGITS = ROOT / "configs" / "digits.yaml"
# 16 rollouts per iteration, 2 iterations, a 16-problem eval with 2 samples each (seconds on one thread)
TEXT_RUN = ["seed=3", "threads=1", "rollout.prompts_per_iter=4", "rollout.group_size=4", "train.micro_batch=16",
            "train.updates_per_epoch=null", "train.inner_updates=2", "train.iterations=2", "eval.count=16", "eval.samples=2", "eval.pass_k=[1,2]",
            "eval.every=0", "checkpoint_every=0"]
TEXT_METRICS = ("pass@1", "pass@2", "greedy_accuracy", "format_rate", "nfe", "n", "problems")
FLUX_RUN = ["train.iterations=1", "train.grad_accum=1", "rollout.group_size=2", "eval.per_digit=1"]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def _one_thread_after():
    """The commands run here set torch's thread count (digits.yaml: every core) and leave it so: back to the pytest
    worker's one thread after each test, so that the tests after it here and in this worker's next files do not run
    with two threads beside the other worker."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _evals(run: Path) -> list[dict]:
    return json.loads((run / "eval.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in eval.json"))


def _difrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The installed command as a user runs it (a fresh process: start-up imports and stderr as they are)."""
    return subprocess.run([sys.executable, "-c", "import sys; from difrl.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=cwd)


# ----------------------------------------------------------------------------- text dLLM runs
@pytest.mark.slow  # a 2-iteration text run and three evaluations (about 20 s)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_eval_of_a_trained_text_run_gives_its_final_evaluation(tmp_path, capsys, lora):
    """`difrl eval RUN_DIR` scores the trained policy (full fine-tune, or LoRA merged into policy.safetensors):
    the same pass@k and greedy accuracy as the run's own final evaluation at the same seeds, not the base's."""
    run = tmp_path / "run"
    extra = ["train.lora.enabled=true", "train.lora.rank=4", "train.lr=3e-3"] if lora else ["train.lr=3e-4"]
    assert main(["train", str(TEXT), *TEXT_RUN, *extra, "--out", str(run)]) == 0
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert "samples" not in closing and "policy.safetensors" in closing  # a text run writes no samples/
    assert f"out: {run}" in (run / "config.yaml").read_text()  # the --out used, not the config's runs/text_arithmetic
    before, after = (next(e for e in _evals(run) if e["tag"] == t) for t in ("before", "after"))
    assert any(before[k] != after[k] for k in ("pass@1", "pass@2", "greedy_accuracy"))  # training moved the numbers

    assert main(["eval", str(run)]) == 0
    mine = _evals(run)[-1]
    assert mine["tag"] == "difrl-eval" and mine["policy"] == str(run / "policy.safetensors")
    assert {k: mine[k] for k in TEXT_METRICS} == {k: after[k] for k in TEXT_METRICS}
    if lora:
        return
    # the config plus --checkpoint: the same trained policy, never silently the base
    out = tmp_path / "checkpoint.json"
    assert main(["eval", str(TEXT), *TEXT_RUN, "--checkpoint", str(run / "policy.safetensors"), "--out", str(out)]) == 0
    assert {k: json.loads(out.read_text())[k] for k in TEXT_METRICS} == {k: after[k] for k in TEXT_METRICS}
    # --temperature (offered by --help) is the sampling temperature of pass@k
    assert main(["eval", str(run), "--temperature", "0", "--pass-k", "1", "--samples", "1"]) == 0
    greedy = _evals(run)[-1]
    assert greedy["temperature"] == 0.0 and greedy["pass@1"] == after["greedy_accuracy"]
    capsys.readouterr()
    assert main(["eval", str(TEXT), "--checkpoint", str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors: no trained policy there" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tiny FLUX runs
@pytest.fixture(scope="module")
def flux_pipe(tmp_path_factory):
    from difrl.models.adapters import make_tiny_pipeline

    return make_tiny_pipeline("flux", tmp_path_factory.mktemp("flux_pipe") / "pipe", seed=0)


@pytest.fixture(scope="module")
def flux_runs(tmp_path_factory, flux_pipe):
    """A 1-iteration LoRA run and a 1-iteration full fine-tune of the tiny FLUX pipeline (stderr kept)."""
    root, pipe = tmp_path_factory.mktemp("flux"), flux_pipe
    runs = {}
    for name, extra in (("lora", []), ("full", ["train.lora.enabled=false", "train.lr=1e-3"])):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_flux.py"), str(FLUX), f"model.path={pipe}",
                               *FLUX_RUN, *extra, "--out", str(root / name)],
                              capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (root / name, proc)
    return runs


def _only_progress_bars(stderr: str) -> list[str]:
    """The stderr lines that are not difrl's own training bar (tqdm redraws with carriage returns)."""
    parts = [p.strip() for line in stderr.splitlines() for p in line.split("\r")]
    return [p for p in parts if p and not p.startswith("train:")]


@pytest.mark.slow  # builds the tiny pipeline and trains it twice (about 20 s)
def test_tiny_flux_run_and_its_eval_print_no_third_party_warnings(flux_runs):
    for _, proc in flux_runs.values():
        assert _only_progress_bars(proc.stderr) == []  # torchao / pytree / loading and saving bars: none
    run, _ = flux_runs["lora"]
    ev = _difrl("eval", str(run))
    assert ev.returncode == 0 and _only_progress_bars(ev.stderr) == []  # no "No LoRA keys associated to CLIPTextModel"


def test_long_prompts_are_said_truncated_once_in_difrl_words(flux_pipe, capfd):
    """A prompt over the tokenizers' limits: one difrl line, not the tokenizer's and pipeline's warnings."""
    from difrl.models.adapters import load_flow_policy
    from difrl.utils.quiet import quiet_third_party

    quiet_third_party()  # what the commands install first
    policy = load_flow_policy("flux", flux_pipe, height=32, width=32, max_sequence_length=16)
    long = "a photo of a cat sitting on a red sofa next to a window " * 3
    policy.encode([long, "a dog"])
    policy.encode([long + "at night", "a cat"])
    out, err = capfd.readouterr()
    assert out.count("are truncated, as the pipeline does") == 1
    assert "CLIPTokenizer: 16 tokens" in out and "T5Tokenizer: 16 tokens (model.max_sequence_length)" in out
    assert "truncated" not in err and "sequence length" not in err


@pytest.mark.slow
def test_eval_of_diffusers_runs_lora_and_full_fine_tune(flux_runs):
    """`difrl eval RUN_DIR` loads the run's lora/ or, after a full fine-tune, its transformer/ (issue 32):
    the same eval reward as the run's own final evaluation."""
    for name in ("lora", "full"):
        run, _ = flux_runs[name]
        assert main(["eval", str(run)]) == 0
        after, mine = next(e for e in _evals(run) if e["tag"] == "after"), _evals(run)[-1]
        assert mine["tag"] == "difrl-eval"
        assert mine["policy"] == str(run / ("lora" if name == "lora" else "transformer"))
        assert mine["reward"] == after["reward"]


@pytest.mark.slow
def test_every_difrl_eval_stays_in_eval_json(flux_runs, tmp_path):
    run, _ = flux_runs["lora"]
    kept = len(_evals(run))
    for i, prompts in enumerate((["a red dog", "a blue cat"], ["a green tree"])):
        (tmp_path / f"p{i}.txt").write_text("\n".join(prompts) + "\n")
        assert main(["eval", str(run), "eval.per_digit=2", "--prompts", str(tmp_path / f"p{i}.txt")]) == 0
    rows = _evals(run)[kept:]
    assert [(r["tag"], r["eval_prompts"], r["samples"]) for r in rows] == [
        ("difrl-eval", str(tmp_path / "p0.txt"), 4), ("difrl-eval", str(tmp_path / "p1.txt"), 2)]


@pytest.mark.slow
def test_eval_hints_name_the_option_the_user_sets(flux_runs, tmp_path, capsys):
    run, _ = flux_runs["lora"]
    (tmp_path / "ref").mkdir()
    assert main(["eval", str(run), "--reference", str(tmp_path / "ref"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "set eval.fid.weights" in err and "weights_path" not in err
    (tmp_path / "p.txt").write_text("a red dog\n")
    assert main(["eval", str(run), "--preset", "hpsv2", "--prompts", str(tmp_path / "p.txt"),
                 "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "--preset-options '{\"checkpoint\": ...}'" in err and "reward.options" not in err


def test_geneval_preset_refuses_up_front_without_a_detector(tmp_path, capsys):
    """Before any model is loaded (model.path does not even exist): GenEval needs a real detector."""
    (tmp_path / "meta.jsonl").write_text('{"prompt": "a photo of a cat", "tag": "single_object", "include": []}\n')
    assert main(["eval", str(FLUX), "model.path=/nowhere", "--preset", "geneval", "--prompts",
                 str(tmp_path / "meta.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--preset geneval needs an object detector" in err and "/nowhere" not in err


# ----------------------------------------------------------------------------- failures at start-up
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["train", "eval"])
def test_reward_server_down_at_start_is_one_line_and_exit_2(tmp_path, command, flux_pipe):
    """A run (digits) and an eval (tiny FLUX: the digits eval scores its own classifier) whose reward server is down."""
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    config = [str(DIGITS), "--out", str(tmp_path / "run")] if command == "train" else [str(FLUX), f"model.path={flux_pipe}"]
    proc = _difrl(command, *config, "reward.weights={remote: 1.0}",
                  f"reward.options={{remote: {{url: '{url}', retries: 0}}}}", "eval.per_digit=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"difrl {command}: error: reward 'remote': no usable reward server at start-up")
    assert url in lines[0]


@pytest.mark.parametrize("flag,value", [("--budget", "-5"), ("--budget", "0"), ("--samples", "0"),
                                        ("--children", "0"), ("--root-children", "-1"), ("--lam", "0")])
def test_sample_refuses_non_positive_counts(capsys, flag, value):
    assert main(["sample", str(DIGITS), flag, value]) == 2
    assert f"difrl sample: error: {flag} must be" in capsys.readouterr().err


def test_custom_reward_module_in_the_current_directory_is_found(tmp_path, capsys, monkeypatch):
    """The custom reward of docs/guides/rewards.md (a file next to the user) without PYTHONPATH: `difrl` is a console script,
    so unlike `python -m` the current directory is not on sys.path by itself."""
    (tmp_path / "my_reward_mod.py").write_text(
        "def brightness():\n    return lambda images, prompts, metadata: images.float().flatten(1).mean(1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    one = ["--samples", "1", "--prompt", "a handwritten 3"]
    assert main(["sample", str(DIGITS), "--reward", "my_reward_mod:brightness", *one]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reward"] == "my_reward_mod:brightness" and 0.0 < res["results"][0]["reward_mean"] < 1.0
    assert main(["sample", str(DIGITS), "--reward", "no_such_mod:f", *one]) == 2
    assert "in the current directory or on PYTHONPATH" in capsys.readouterr().err


def test_eval_writes_null_not_nan(tmp_path, capsys):
    """One sample per digit has no diversity (NaN): printed (--json) and written as null, both valid JSON."""
    out = tmp_path / "e.json"
    assert main(["eval", str(DIGITS), "--out", str(out), "--json", "eval.per_digit=1"]) == 0  # overrides after options
    strict = lambda text: json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))  # noqa: E731
    assert strict(out.read_text())["diversity"] is None
    assert strict(capsys.readouterr().out)["diversity"] is None


@pytest.mark.slow  # a one-iteration run in a fresh process (about 10 s)
@pytest.mark.parametrize("world", ["digits", "text_lora", "digits_accelerate"])
def test_short_runs_print_no_third_party_warnings(tmp_path, world):
    """`make demo`'s command, shortened, a LoRA text dLLM run and the `accelerate launch` line of docs/guides/scale.md: stderr
    holds difrl's progress bar only (no torch _pytree / torchao lines, no loading bars, no peft / transformers
    FutureWarning, no accelerate defaults warning); the closing line names what was written."""
    run = tmp_path / "run"
    # threads=1 (as TEXT_RUN has): digits.yaml takes every core, which a pytest worker shares with the other one
    args = ([str(TEXT), *TEXT_RUN, "train.iterations=1", "train.lora.enabled=true"] if world == "text_lora"
            else [str(DIGITS), "threads=1", "train.iterations=1", "eval.per_digit=2"])
    if world == "digits_accelerate":
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines",
                               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "difrl", "train", *args,
                               "--out", str(run)], capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    else:
        proc = _difrl("train", *args, "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _only_progress_bars(proc.stderr) == []
    assert (f"samples: {run / 'samples'}" in proc.stdout) == (world != "text_lora")


# ----------------------------------------------------------------------------- issue 39 item 7: refused before any work
def test_a_reward_that_does_not_fit_the_world_stops_before_the_before_evaluation(tmp_path, capsys):
    """A Sudoku reward on digit images, an RGB reward on 1-channel digits, an image reward on Sudoku grids: one
    line naming the reward and the samples, no drop_group hint (no on_error makes it fit), nothing written."""
    for config, reward, said in ((DIGITS, "sudoku_cells", "images [2, 1, 8, 8]"), (DIGITS, "color", "images [2, 1, 8, 8]"),
                                 (ROOT / "configs" / "sudoku.yaml", "digit_prob", "samples [2, 16]")):
        out = tmp_path / reward
        assert main(["train", str(config), f"reward.weights={{{reward}: 1.0}}", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: reward '{reward}' cannot score this world's samples ({said})" in err, err
        assert "drop_group" not in err and "eval before" not in capsys.readouterr().out and not out.exists()


def test_eval_of_a_checkpoint_of_another_masked_world_names_it(capsys):
    other = ROOT / "difrl" / "assets" / "digit_tokens_base.safetensors"
    assert main(["eval", str(ROOT / "configs" / "sudoku.yaml"), "--checkpoint", str(other)]) == 2
    err = capsys.readouterr().err
    assert "is not a sudoku masked transformer checkpoint: it has num_labels 10, vocab_size 18" in err
    assert "block_length" not in err


def test_a_run_directory_where_a_config_belongs_points_to_resume(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((DIGITS).read_text())
    assert main(["train", str(run)]) == 2
    assert f"{run} is a directory, not a YAML config; it is a run directory: continue that run with resume={run}" \
        in capsys.readouterr().err
    from difrl.train.entry import main as script_main  # scripts/train_flux.py's body

    assert script_main("flux", [str(run)]) == 2
    assert f"resume={run}" in capsys.readouterr().err


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a difrl run directory (no config.yaml" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


def test_a_train_script_given_another_worlds_config_names_what_exists(capsys, monkeypatch):
    from difrl.train.entry import main as script_main

    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "train_flux.py")])
    assert script_main("flux", [str(DIGITS)]) == 2
    err = capsys.readouterr().err
    assert "model.kind=digits config; this script trains flux (use difrl train" in err and "train_digits.py" not in err
    assert script_main("flux", [str(ROOT / "configs" / "sd3_tiny.yaml")]) == 2
    assert "use scripts/train_sd3.py" in capsys.readouterr().err


def test_import_difrl_then_peft_prints_nothing():
    """A library user's imports: torchao (which peft imports) registers Enums with torch's pytree, and torch logs a
    deprecation notice about torchao's code; `import difrl` drops that one record and nothing else."""
    code = ("import logging, difrl, peft; logging.getLogger('torch.utils._pytree').warning('a real warning')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    lines = proc.stderr.strip().splitlines()  # torch's log format: "W1205 05:35:15.114000 1071 <string>:1] ..."
    assert proc.returncode == 0 and len(lines) == 1 and lines[0].endswith("] a real warning"), proc.stderr


def test_fsdp_view_outputs_checked_out_of_place_do_not_warn(tmp_path):
    """torch warns when an FSDP2 unit returns a view (an in-place write to it would lose the gradient's all-gather);
    the masked transformer's output is such a view, read out of place (mask_logit): no warning, and a module that
    is not checked still warns."""
    import warnings

    import torch
    import torch.distributed as dist

    from difrl.train.dist.sharding import FSDPSettings, shard
    from difrl.worlds.sudoku import load_base

    policy = load_base()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            policy.module = shard(policy.module, policy.block_classes, FSDPSettings())
            policy.logits(torch.full((2, 16), 4)).sum().backward()
            warnings.warn("FSDP2-wrapped module (FSDPOther) returned a view tensor. ...", UserWarning)
    finally:
        dist.destroy_process_group()
    views = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    assert views == ["FSDP2-wrapped module (FSDPOther) returned a view tensor. ..."]
