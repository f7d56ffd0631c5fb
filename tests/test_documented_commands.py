"""Every command the documentation shows is run here, or is in SKIP with the reason it cannot be (issue 39).

    .venv/bin/python -m pytest tests/test_documented_commands.py -q -s      # -s lists what was found and run
    DIFRL_DOCUMENTED='digits_branch' .venv/bin/python -m pytest tests/test_documented_commands.py -q -s   # only these

The commands are read from the files, so a new one is picked up by itself: fenced ```bash blocks and inline
`difrl ...` / `python ...` / `accelerate launch ...` / `torchrun ...` / `make ...` code of README.md and docs/**/*.md,
the command lines that head each configs/*.yaml, and the indented command lines of the entry scripts' docstrings
(scripts/train_*.py). `[...]` groups are optional parts and are left out; `#` starts a comment.

Each command runs as documented, in a scratch directory that holds links to configs/ and scripts/ (so `runs/...`
paths land there), with overrides appended that make it short without leaving its path: one or two iterations,
a small evaluation, one thread (SMALL). `difrl` and `python -m difrl` commands and `python scripts/*.py` run in this
process (difrl.cli.main, or the script file itself), launchers (`torchrun`, `accelerate launch`) as subprocesses.
Order: tiny pipelines first, then trainings, resumed trainings, the rest (evaluations of the runs just made), then
launchers. An invocation runs once: a command, or a part of one after `&&` (the tiny pipeline three commands build
first), that already ran is not run again. A command that cannot run here (or that another test already launches as
written) is in SKIP with its reason; a training command among them still has its
config loaded and its iteration planned (difrl.train.flow.plan) at the number of processes it starts, so a batch
that does not split over them fails here, without a GPU or a model. The test fails on a command that is neither run
nor skipped, on a skip entry that no documented command matches any more, and on every command that fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from doc_pages import doc_pages

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ("difrl", "python", "python3", "accelerate", "torchrun", "make", "pytest")
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")  # RUN_DIR, CONFIG, PATH, DIR

# ---------------------------------------------------------------------------------- what cannot run here, and why

GPU_MODEL = "needs a real model directory and GPUs (placeholder paths); its config and batch plan are checked here"
SKIP = {
    # real models, GPUs, downloads
    "difrl plan configs/flux_flow_grpo.yaml train.lora.enabled=false train.grad_accum=24 train.kl_beta=0.04 --gpus 8 "
    "--gpu-memory 80 --json plan.json": "simulates FLUX.1-dev at real size (about 2 minutes of CPU); tests/test_planner.py "
    "runs difrl plan on the tiny FLUX pipeline and benchmarks/bench_plan.py this config at real size",
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 8 scripts/train_flux.py "
    "configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev model.prompt_file=prompts.txt train.grad_accum=24": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_sd3.py configs/sd3_flow_grpo.yaml "
    "model.path=... train.grad_accum=72": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_zimage.py "
    "configs/zimage_flow_grpo.yaml model.path=/models/Z-Image model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_wan.py configs/wan_dance_grpo.yaml "
    "model.path=... train.grad_accum=24": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_flux.py "
    "configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev train.lora.enabled=false train.grad_accum=24": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml -m difrl train configs/text_arithmetic.yaml "
    "model.path=...": "needs a local masked LM directory (model.path=...) and GPUs for FSDP; FSDP on 2 CPU processes "
                      "is tests/test_masked_dp.py",
    "difrl train configs/text_arithmetic.yaml model.path=/models/LLaDA-8B-Instruct model.trust_remote_code=true "
    "model.gen_length=64 sampler.block_length=32 sampler.steps=32 train.lora.enabled=true "
    "model.gradient_checkpointing=true": "needs LLaDA-8B-Instruct on disk (8B parameters, remote code)",
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 16 scripts/train_flux.py "
    "configs/flux_dance_grpo.yaml model.path=/models/FLUX.1-dev model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 32 scripts/train_flux.py "
    "configs/flux_flow_grpo.yaml model.path=/models/FLUX.1-dev model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 32 scripts/train_flux.py "
    "configs/flux_mix_grpo.yaml model.path=/models/FLUX.1-dev model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 32 scripts/train_sd3.py "
    "configs/sd3_flow_grpo.yaml model.path=/models/stable-diffusion-3.5-medium model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 32 scripts/train_sd3.py "
    "configs/sd3_flow_grpo_fast.yaml model.path=/models/stable-diffusion-3.5-medium "
    "model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 16 scripts/train_wan.py "
    "configs/wan_dance_grpo.yaml model.path=/models/Wan2.1-T2V-1.3B-Diffusers model.prompt_file=/data/prompts.txt": GPU_MODEL,
    # the entry scripts' docstrings
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux.py configs/flux_flow_grpo.yaml "
    "model.path=/models/FLUX.1-dev model.prompt_file=prompts.txt train.grad_accum=24": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_flux.py configs/flux_dance_grpo.yaml "
    "model.path=... train.grad_accum=24": GPU_MODEL,
    "python scripts/train_flux.py configs/flux_mix_grpo.yaml model.path=... train.grad_accum=96": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_sd3.py configs/sd3_flow_grpo.yaml "
    "model.path=/models/sd3.5-medium model.prompt_file=prompts.txt train.grad_accum=72": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_sd3.py configs/sd3_flow_grpo_fast.yaml "
    "model.path=... train.grad_accum=24": GPU_MODEL,
    "python scripts/train_sd3.py configs/sd3_flow_grpo.yaml model.path=... train.grad_accum=576": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_wan.py configs/wan_dance_grpo.yaml "
    "model.path=/models/Wan2.1-T2V-1.3B-Diffusers model.prompt_file=prompts.txt train.grad_accum=24": GPU_MODEL,
    "python scripts/train_wan.py configs/wan_dance_grpo.yaml model.path=... train.grad_accum=192": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 8 scripts/train_sana.py "
    "configs/sana_sol_rl.yaml model.path=/models/Sana_1600M_1024px_diffusers model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "python scripts/train_sana.py configs/sana_sol_rl.yaml model.path=... train.grad_accum=72": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 32 scripts/train_qwenimage.py "
    "configs/qwenimage_flow_grpo.yaml model.path=/models/Qwen-Image model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_qwenimage.py configs/qwenimage_flow_grpo.yaml "
    "model.path=/models/Qwen-Image model.prompt_file=prompts.txt train.grad_accum=16": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_qwenimage_edit.py "
    "configs/qwenimage_edit_flow_grpo.yaml model.path=/models/Qwen-Image-Edit model.prompt_file=/data/edits/train.jsonl":
        GPU_MODEL,
    "python benchmarks/bench_gpu.py": "needs a CUDA GPU (~8 min on an H200); its --quick run is "
                                      "tests/test_benchmarks.py::test_bench_gpu_quick_rows",
    "difrl reward-server --reward hpsv2,ocr --options rewards.yaml": "serves HPSv2 and OCR from checkpoint files a "
        "rewards.yaml names (none here); the server runs on loopback with tiny rewards in tests/test_reward_server.py",
    "difrl reward-server --reward hpsv2 --options rewards.yaml --host 0.0.0.0 --token-file ~/.difrl_token": "as above, "
        "on a public address with a token file",
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux.py configs/flux_flow_grpo.yaml "
    "model.path=/models/FLUX.1-dev train.grad_accum=24 reward.weights={remote@hps: 1.0} reward.options={remote@hps: "
    "{url: \"http://gpu7:8765\", reward: hpsv2, token_file: ~/.difrl_token}}": "FLUX.1 on GPUs and a reward server "
        "on another machine (gpu7); training through a loopback server is tests/test_reward_server.py",
    "difrl eval runs/flux": "runs/flux is a FLUX.1 run (no command here makes one); `difrl eval RUN_DIR` on tiny FLUX "
                            "runs is tests/test_cli_paths.py::test_eval_of_diffusers_runs_lora_and_full_fine_tune",
    "difrl eval runs/flux --prompts heldout.jsonl --reference /data/coco_val512 --out runs/flux/eval_coco.json":
        "a FLUX.1 run, a held-out prompt file and COCO reference images; --prompts / --reference on tiny runs are "
        "tests/test_eval_panel.py and tests/test_eval_fid.py",
    "difrl eval runs/flux --preset geneval --prompts evaluation_metadata.jsonl --preset-options {\"detector\": "
    "\"torchvision\", \"detector_weights\": \"/w/maskrcnn_v2.pth\"}": "a FLUX.1 run, GenEval's metadata and Mask R-CNN "
        "weights; the preset's refusal without a detector is tests/test_cli_paths.py",
    # synopses: placeholders or alternatives, not commands
    "difrl eval RUN_DIR": "synopsis (RUN_DIR); run as `difrl eval runs/cps` and `difrl eval runs/sudoku ...`",
    "difrl export RUN_DIR": "synopsis (RUN_DIR); run on a sharded tiny FLUX run and on a bundled world by "
                            "tests/test_dcp.py (test_export_writes_plain_diffusers_files, "
                            "test_export_of_a_bundled_world_is_its_final_policy)",
    "difrl eval CONFIG --checkpoint PATH": "synopsis; run as `difrl eval configs/text_arithmetic.yaml --checkpoint ...`",
    "difrl report RUN_DIR": "synopsis; every training run here writes report.html the same way (difrl.report), and "
                            "`difrl report` itself is tests/test_report.py",
    "difrl sample --search dts|dts-star|best-of-n|none": "synopsis of the alternatives; run as `difrl sample "
                                                         "configs/digits.yaml --search dts-star ...`",
    "difrl sample RUN_DIR": "synopsis; run as `difrl sample runs/moving_digits ...` and `difrl sample runs/sudoku ...`",
    "difrl sample configs/flux_flow_grpo.yaml --checkpoint runs/flux/lora --prompt a red bicycle --grid red.png":
        "a FLUX.1 model and a FLUX.1 run's LoRA; `difrl sample CONFIG --checkpoint` on tiny runs of every world is "
        "tests/test_cli_run_dirs.py::test_sample_of_a_config_takes_a_checkpoint_and_prompts_each_world_reads",
    "difrl train / eval / config / rewards / reward-server ...": "docs/architecture.md's list of subcommands",
    "difrl train resume=DIR": "synopsis (DIR); resuming a run with its own config.yaml is tests/test_run_dir.py and "
                              "tests/test_interrupt.py",
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_flux.py "
    "resume=runs/flux": "continues a FLUX.1 run on 8 GPUs; the same launch on 2 gloo processes (tiny FLUX), stopped and "
                        "continued with the command its stop line printed, is tests/test_resume_command.py",
    "python -m difrl train": "the name of the process a signal is sent to in tests/test_interrupt.py, not a command",
    "python scripts/pretrain_digits.py --out DIR": "placeholder DIR; the script is run by "
                                                   "tests/test_digits_world.py::test_pretrain_script_reproduces_bundled_assets",
    # long runs whose reduced form is a test of its own
    "make test": "the whole suite (this file is part of it)",
    "make test-fast": "the suite without the slow tests (this file's fast tests are part of it)",
    "make docs": "builds the documentation site (mkdocs build --strict); tests/test_docs_site.py builds it the same way",
    "make demo": "creates .venv with pip, then runs `difrl train configs/digits.yaml`, which is run here (its header)",
    "make bench": "= python benchmarks/bench_rollout.py (a full benchmark run); its --quick run is "
                  "tests/test_benchmarks.py::test_bench_rollout_rows_and_markdown",
    "python benchmarks/bench_rollout.py": "a full benchmark run (publishes BENCHMARKS.md); its --quick run is "
                                          "tests/test_benchmarks.py::test_bench_rollout_rows_and_markdown",
    "python benchmarks/bench_eb.py --world digit_tokens --threads 2": "a full benchmark run (publishes BENCHMARKS.md); "
        "its --quick run is tests/test_benchmarks.py::test_bench_eb_digit_tokens_rows",
    "python scripts/overoptimisation.py --json benchmarks/results/overoptimisation.json": "two 400-iteration digits "
        "runs (~2 x 1 min of training); its runs are configs/digits.yaml with kl_beta 0 and 0.5, run here as the header",
    "pytest tests/test_precision.py::test_memory_per_trained_parameter -s": "a test of the suite itself",
    "HF_HUB_OFFLINE=1 python -m pytest tests/test_diffusers_models.py -q": "a test file of the suite itself",
    # the same run as another command that is run, with another seed / run directory / timer
    "difrl train configs/moving_digits.yaml seed=1 --out runs/moving_digits_s1": "configs/moving_digits.yaml as run, seed 1",
    "difrl train configs/moving_digits.yaml seed=2 --out runs/moving_digits_s2": "configs/moving_digits.yaml as run, seed 2",
    "/usr/bin/time -v difrl train configs/moving_digits.yaml --out runs/md_timed": "configs/moving_digits.yaml as run, "
                                                                                   "under /usr/bin/time",
    "difrl train configs/moving_digits.yaml --out runs/moving_digits_s0": "configs/moving_digits.yaml as run (its "
                                                                          "header), into another run directory",
    # launchers of 2 processes that another test already launches (the same launcher, flags, script and config, with
    # smaller sizes), so this file does not pay for them twice; their 2-process plans are checked here
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_flux.py configs/flux_tiny.yaml train.grad_accum=2": "launched as written (2 iterations, smaller "
        "batches) by tests/test_train_diffusers.py::test_accelerate_launch_two_processes_equal_one, against one process; "
        "`accelerate launch --multi_gpu --num_processes 2 scripts/train_flux.py configs/flux_tiny.yaml` is run here",
    "torchrun --standalone --nproc_per_node 2 -m difrl train configs/digits.yaml": "launched as written (40 small "
        "iterations, three times) by tests/test_interrupt.py::test_sigterm_to_a_torchrun_group_stops_both_processes_together",
    # launchers of 2 processes: the flux_tiny ones are run; these start the same code on another tiny model
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_sd3.py configs/sd3_tiny.yaml train.grad_accum=2": "2 gloo processes like the flux_tiny command, "
        "which is run; SD3 on 2 processes is benchmarks/bench_models.py's full run; the 2-process plan is checked here",
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_wan.py configs/wan_tiny.yaml train.grad_accum=2": "as the sd3_tiny line, for Wan",
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 2 -m difrl train configs/sudoku.yaml":
        "2 gloo processes: tests/test_masked_dp.py runs this launch (with DDP and FSDP, Sudoku and the text task) and "
        "checks that it equals one process; the 2-process plan is checked here",
    # FLUX.2 [dev] and [klein]: the real models' commands, and the tiny configs' 2-process launches
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 8 scripts/train_flux2.py "
    "configs/flux2_flow_grpo.yaml model.path=/models/FLUX.2-dev model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes 8 scripts/train_flux2_klein.py "
    "configs/flux2_klein_flow_grpo.yaml model.path=/models/FLUX.2-klein-base-9B model.prompt_file=/data/prompts.txt":
        GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux2.py configs/flux2_flow_grpo.yaml "
    "model.path=/models/FLUX.2-dev model.prompt_file=prompts.txt": GPU_MODEL,
    "python scripts/train_flux2.py configs/flux2_flow_grpo.yaml model.path=/models/FLUX.2-dev "
    "model.prompt_file=prompts.txt train.grad_accum=384": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/ddp.yaml scripts/train_flux2_klein.py "
    "configs/flux2_klein_flow_grpo.yaml model.path=/models/FLUX.2-klein-base-9B model.prompt_file=prompts.txt": GPU_MODEL,
    "python scripts/train_flux2_klein.py configs/flux2_klein_flow_grpo.yaml model.path=/models/FLUX.2-klein-base-9B "
    "model.prompt_file=prompts.txt train.grad_accum=384": GPU_MODEL,
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_flux2.py configs/flux2_tiny.yaml train.grad_accum=2": "as the sd3_tiny line, for FLUX.2 [dev] "
        "(tests/test_fsdp_families.py launches it on 2 processes under FSDP)",
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_flux2_klein.py configs/flux2_klein_tiny.yaml train.grad_accum=2": "as the sd3_tiny line, for FLUX.2 "
        "[klein] (tests/test_fsdp_families.py launches it on 2 processes under FSDP)",
    "accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 16 scripts/train_wan22.py "
    "configs/wan22_dance_grpo.yaml model.path=/models/Wan2.2-TI2V-5B-Diffusers model.prompt_file=/data/prompts.txt": GPU_MODEL,
    "accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train_wan22.py configs/wan22_dance_grpo.yaml "
    "model.path=/models/Wan2.2-TI2V-5B-Diffusers model.prompt_file=prompts.txt train.grad_accum=24": GPU_MODEL,
    "python scripts/train_wan22.py configs/wan22_dance_grpo.yaml model.path=... train.grad_accum=192": GPU_MODEL,
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "scripts/train_wan22.py configs/wan22_tiny.yaml train.grad_accum=2": "as the sd3_tiny line, for Wan 2.2 TI2V",
}
# appended to every run of a world's training / evaluation: short, one thread, small evaluations
SMALL = {
    "flow": ["train.iterations=1", "eval.every=0", "eval.per_digit=2", "eval.num_steps=2", "threads=1"],
    "masked": ["train.iterations=1", "eval.every=0", "eval.count=4", "eval.per_digit=2", "threads=1"],
}
MASKED_CONFIGS = ("sudoku.yaml", "digit_tokens.yaml", "text_arithmetic.yaml")


# ---------------------------------------------------------------------------------- reading the documentation


@dataclass
class Documented:
    text: str  # as written (joined lines, comment and optional [...] parts removed)
    where: str  # file
    parts: list[list[str]]  # its commands, split on &&, each as argv


def _normalize(raw: str) -> tuple[str, list[list[str]]] | None:
    raw = re.sub(r"\s+\[[^\]]*\]", "", raw)  # [--quick] [key=value ...]: optional
    raw = re.sub(r"\s{2,}\([^)]*\)\s*$", "", raw)  # a config header's "(make demo runs exactly this)"
    try:
        tokens = shlex.split(raw, comments=True)
    except ValueError:
        return None
    if not tokens:
        return None
    parts, cur = [], []
    for t in tokens:
        if t == "&&":
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return " ".join(tokens), parts


def _is_command(tokens: list[str], inline: bool) -> bool:
    rest = _strip(tokens)
    if not rest or rest[0] not in LAUNCHERS:
        return False
    if not inline:
        return True
    # inline code in prose: a name (`difrl train`, `torchrun`) is not a command; arguments make one
    if rest[0] == "difrl":
        return len(rest) >= 3 or (len(rest) == 2 and rest[1] in ("config", "rewards"))
    if rest[0] == "accelerate":
        return len(rest) >= 3 and rest[1] == "launch"
    return len(rest) >= 2


def documented_commands() -> list[Documented]:
    found: list[Documented] = []

    def add(raw: str, where: str, inline: bool = False) -> None:
        got = _normalize(raw)
        if got and _is_command(got[1][0], inline):
            found.append(Documented(got[0], where, got[1]))

    for path in doc_pages(ROOT):  # README.md and every page of the site (docs/**/*.md)
        text, name = path.read_text(), str(path.relative_to(ROOT))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
            if m.group(1) in ("bash", "sh", "shell"):
                for line in re.sub(r"\\\n\s*", " ", m.group(2)).splitlines():
                    add(line, name)
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for m in re.finditer(r"`([^`\n]+)`", prose):
            add(m.group(1), name, inline=True)
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        for line in path.read_text().splitlines():  # the command line(s) at the top
            got = _normalize(line[2:]) if line.startswith("# ") else None
            if not got or not _is_command(got[1][0], False):
                break
            found.append(Documented(got[0], str(path.relative_to(ROOT)), got[1]))
    for path in sorted((ROOT / "scripts").glob("train_*.py")):
        doc = (re.match(r'\s*"""(.*?)"""', path.read_text(), re.S) or [None, ""])[1]
        for line in doc.splitlines():
            if line.startswith("    "):
                add(line.strip(), str(path.relative_to(ROOT)))
    return found


def unique(commands: list[Documented]) -> dict[str, Documented]:
    out: dict[str, Documented] = {}
    for c in commands:
        out.setdefault(c.text, c)
    return out


# ---------------------------------------------------------------------------------- running one


def _strip(argv: list[str]) -> list[str]:
    """Without leading VAR=value assignments and a /usr/bin/time -v wrapper."""
    while argv and ENV_ASSIGN.match(argv[0]):
        argv = argv[1:]
    return argv[2:] if argv[:2] == ["/usr/bin/time", "-v"] else argv


def _program(argv: list[str]) -> tuple[str, list[str], int]:
    """(kind, program argv, processes): kind difrl (difrl.cli argv), script (path + args), or launcher."""
    argv = _strip(argv)
    if argv[0] == "difrl":
        return "difrl", argv[1:], 1
    if argv[0] in ("python", "python3") and argv[1:3] == ["-m", "difrl"]:
        return "difrl", argv[3:], 1
    if argv[0] in ("python", "python3") and argv[1].endswith(".py"):
        return "script", argv[1:], 1
    if argv[0] in ("torchrun", "accelerate"):
        rest = argv[2:] if argv[0] == "accelerate" else argv[1:]
        procs, i = None, 0
        while i < len(rest) and rest[i].startswith("-"):
            flag = rest[i]
            if rest[i] == "-m":
                break
            takes = flag not in ("--multi_gpu", "--standalone", "--cpu")
            if flag in ("--num_processes", "--nproc_per_node"):
                procs = int(rest[i + 1])
            if flag == "--config_file" and procs is None:
                procs = int(yaml.safe_load((ROOT / rest[i + 1]).read_text()).get("num_processes", 1))
            i += 2 if takes else 1
        program = rest[i:]
        if program[:2] == ["-m", "difrl"]:
            return "launcher", program[2:], procs or 1
        return "launcher", program, procs or 1
    raise ValueError(f"no way to run {' '.join(argv)!r} here: add it to SKIP with the reason")


def _train_parts(kind: str, program: list[str]) -> tuple[str, list[str]] | None:
    """(config, overrides) of a training command (difrl train, an entry script), else None."""
    if kind in ("difrl", "launcher") and program[:1] == ["train"]:
        args = program[1:]
    elif program and Path(program[0]).name.startswith("train_"):
        args = program[1:]
    else:
        return None
    config = next((a for a in args if a.endswith(".yaml")), None)
    return (config, [a for a in args if "=" in a and not a.startswith("-")]) if config else None


def _small(kind: str, program: list[str]) -> list[str]:
    """The overrides that shorten this command (a training or an evaluation), or none."""
    if kind == "difrl" and program[:1] in (["config"], ["rewards"], ["check"]):  # nothing runs long: as written
        return []
    config = next((a for a in program if a.endswith(".yaml")), None)
    if program[:1] == ["sample"]:
        return ["threads=1"]
    resume = next((a.partition("=")[2] for a in program if a.startswith("resume=")), None)
    if config is None and (program[:1] == ["eval"] or resume):  # a run directory: its config's world
        run = Path(resume or program[1]) / "config.yaml"
        config = "masked" if run.is_file() and yaml.safe_load(run.read_text())["model"]["kind"] in (
            "sudoku", "digit_tokens", "hf_masked") else "flow"
    if config is None:
        return []
    small = SMALL["masked" if Path(config).name in MASKED_CONFIGS or config == "masked" else "flow"]
    if program[:1] == ["eval"]:
        return [s for s in small if not s.startswith(("train.", "eval.every"))]
    if resume:  # one iteration more than the run made (a resume names no config: it used to run all 400 of them)
        return ["train.iterations=2", *small[1:]]
    # the examples share default run directories (runs/flux_tiny, runs/digits): run one after another, the second
    # is refused as it would be for a user (tests/test_run_dir.py); each is run here as a fresh run of its own
    return [*small, "--overwrite"]


@contextlib.contextmanager
def _argv(argv):
    old = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = old


def _key(argv: list[str]) -> tuple:
    """One invocation, whatever its spelling (python -m difrl X == difrl X)."""
    kind, program, _ = _program(argv)
    return tuple(_strip(argv)) if kind == "launcher" else (kind, *program)


def launcher_command(argv: list[str], small: list[str]) -> list[str]:
    """A documented `accelerate launch ...` / `torchrun ...` as this Python runs it: the launcher's own module, its
    arguments as documented, then `small`. accelerate's port, unless the command names one, is 0 (a free one): its
    default, 29500, may be held by another test's launch (two pytest-xdist workers, tests/conftest.py); torchrun's
    documented `--standalone` picks a free one itself."""
    launch = _strip(argv)
    if launch[0] == "accelerate":
        port = [] if any(a.startswith("--main_process_port") for a in launch) else ["--main_process_port", "0"]
        return [sys.executable, "-m", "accelerate.commands.launch", *port, *launch[2:], *small]
    return [sys.executable, "-m", "torch.distributed.run", *launch[1:], *small]


def run_one(parts: list[list[str]], work: Path, ran: set | None = None) -> tuple[bool, str]:
    """Run a documented command (its && parts in order) in `work`; (ok, output tail). A part in `ran` (the same
    invocation already ran in `work`, e.g. the tiny pipeline another command built) is not run again; each part that
    succeeds is added to it."""
    log = io.StringIO()
    for argv in parts:
        if ran is not None and _key(argv) in ran:
            log.write(f"(already ran: {' '.join(argv)})\n")
            continue
        kind, program, procs = _program(argv)
        small = _small(kind, program)
        program = [*program, *small]
        threads = torch.get_num_threads()
        if kind == "launcher":  # the launcher's own module, its arguments as documented, then SMALL
            cmd = launcher_command(argv, small)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
            log.write(p.stdout[-3000:] + p.stderr[-3000:])
            code = p.returncode
        else:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                try:
                    if kind == "difrl":
                        from difrl.cli import main

                        code = main(program)
                    else:
                        with _argv(program):
                            runpy.run_path(str(work / program[0]), run_name="__main__")
                        code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except Exception as e:  # noqa: BLE001  (a traceback is a failure of the command)
                    import traceback

                    traceback.print_exc()
                    code = f"{type(e).__name__}: {e}"
                finally:
                    torch.set_num_threads(threads)
        if code != 0:
            return False, f"{' '.join(argv)} -> exit {code}\n{log.getvalue()[-4000:]}"
        if ran is not None:
            ran.add(_key(argv))
    return True, log.getvalue()[-300:]


def _phase(c: Documented) -> int:
    text = c.text
    launcher = _strip(c.parts[0])[0] in ("torchrun", "accelerate")
    if "make_tiny_pipeline.py" in text:
        return 0 if not launcher else 4
    if launcher:
        return 4
    if " train " in f" {text} " or "scripts/train_" in text:
        return 2 if "resume=" in text else 1
    return 3


def _workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    for name in ("configs", "scripts", "benchmarks", "difrl"):  # difrl/assets: the tiny edit set configs name
        (work / name).symlink_to(ROOT / name)
    return work


# ---------------------------------------------------------------------------------- the tests


def test_every_page_of_the_documentation_is_read():
    # README's sections moved to the site's pages (docs/guides/, issue 49): each page that shows a command is read
    where = {c.where for c in documented_commands()}
    for path in doc_pages(ROOT):
        if re.search(r"^```(bash|sh|shell)\n", path.read_text(), re.M):
            assert str(path.relative_to(ROOT)) in where, f"{path.relative_to(ROOT)} shows commands that are not read"
    assert any(w.startswith("docs/guides/") for w in where)


def test_every_documented_command_is_run_or_skipped_with_a_reason():
    commands = unique(documented_commands())
    assert len(commands) >= 40, sorted(commands)  # README and the docs pages show dozens: the extraction works
    stale = sorted(set(SKIP) - set(commands))
    assert not stale, f"SKIP entries that no documented command matches any more (remove or update them): {stale}"
    for text, c in commands.items():
        if text in SKIP:
            continue
        for argv in c.parts:
            _program(argv)  # raises for a command form this test cannot run
            holes = [t for t in argv if PLACEHOLDER.match(t) or t == "..." or t.endswith("=...")]
            assert not holes, f"{text!r} ({c.where}) has placeholders {holes}: a synopsis? add it to SKIP with the reason"


def test_every_documented_launch_runs_on_a_free_port():
    # the suite runs as two pytest-xdist workers (tests/conftest.py): a launch on accelerate's default port 29500
    # fails ("port 29500 is already in use") while the other worker's launch holds it
    launches = [launcher_command(argv, []) for t, c in unique(documented_commands()).items() if t not in SKIP
                for argv in c.parts if _program(argv)[0] == "launcher"]
    assert launches  # README runs `accelerate launch --multi_gpu --num_processes 2 scripts/train_flux.py ...`
    for cmd in launches:
        if cmd[2] == "accelerate.commands.launch":  # 0 (a free port) unless the command names its own
            assert "--main_process_port" in cmd, f"accelerate on its default port 29500: {cmd}"
        else:
            assert "--standalone" in cmd, f"torchrun on its default port 29500: {cmd}"


def _plan(program: list[str], procs: int) -> str:
    """Load a training command's config with its overrides and plan its iteration on `procs` processes."""
    from difrl.samplers import sigma_schedule
    from difrl.train.config import FlowConfig
    from difrl.train.flow.plan import plan_flow_iteration
    from difrl.train.recipes import load_train_config

    config, overrides = _train_parts("difrl", ["train", *program[1:]] if program[0].endswith(".py") else program)
    overrides = [re.sub(r"=\.\.\.$", "=/placeholder", o) for o in overrides]  # model.path=... (a placeholder)
    cfg = load_train_config(ROOT / config, overrides)
    if not isinstance(cfg, FlowConfig):  # the masked trainer's split (difrl/train/masked/plan.py)
        from difrl.train.masked.plan import plan_masked_iteration

        split = plan_masked_iteration(cfg, procs, 0)
        return (f"masked: {split.per_proc} samples per process, {split.updates} update(s) of {split.micro} x "
                f"{cfg.train.grad_accum} per pass")
    lines = []
    plan_flow_iteration(cfg, SimpleNamespace(sigmas=lambda n, shift: sigma_schedule(n, shift)), procs, Path("/tmp/plan"), lines.append)
    return lines[0]


def test_training_commands_load_and_plan_at_their_process_count():
    # what can be checked of every training command, also one that needs a GPU and a model: its config, its
    # overrides, and that its samples split over its processes and into its updates (the start-up check that failed
    # for documented commands in issue 39)
    checked, failures = [], []
    for text, c in unique(documented_commands()).items():
        for argv in c.parts:
            try:
                kind, program, procs = _program(argv)
            except ValueError:  # make, pytest: not a training command (and in SKIP: the test above)
                continue
            if _train_parts(kind, program) is None:
                continue
            try:
                _plan(program, procs)
                checked.append(f"{procs:>2} process(es): {text}")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{text}\n    on {procs} process(es): {type(e).__name__}: {e}")
    print(f"\n{len(checked)} training commands planned (config + batch plan at the command's process count):\n  "
          + "\n  ".join(checked))
    assert checked and not failures, "\n".join(failures)


@pytest.mark.slow  # every runnable documented command, shortened: ~2 min of CPU on 2 cores
def test_every_documented_command_runs(tmp_path, monkeypatch):
    commands = unique(documented_commands())
    only = re.compile(os.environ.get("DIFRL_DOCUMENTED", ""))  # e.g. DIFRL_DOCUMENTED=sliding_window while editing
    todo = sorted((c for t, c in commands.items() if t not in SKIP and only.search(t)), key=_phase)
    work = _workdir(tmp_path)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    done: dict[tuple, str] = {}  # one run per distinct invocation (python -m difrl X == difrl X)
    ran: set = set()  # and per distinct part of one: `make_tiny_pipeline.py flux runs/tiny_flux && ...` builds it once
    report, failures = [], []
    for c in todo:
        key = tuple(_key(p) for p in c.parts)
        if key in done or all(k in ran for k in key):
            report.append(f"  same as above   {c.text}   ({c.where})")
            continue
        t0 = time.perf_counter()
        ok, out = run_one(c.parts, work, ran)
        done[key] = c.text
        report.append(f"  {'ran' if ok else 'FAILED':6s} {time.perf_counter() - t0:5.1f} s  {c.text}   ({c.where})")
        if not ok:
            failures.append(f"{c.text}   ({c.where})\n{out}")
    print(f"\n{len(commands)} documented commands; {len(done)} distinct ones run, {len(todo) - len(done)} the same as "
          f"one run, {len(SKIP)} skipped:\n" + "\n".join(report)
          + "\nskipped:\n" + "\n".join(f"  {t}\n      {r}" for t, r in SKIP.items()))
    assert not failures, "documented commands that fail:\n\n" + "\n\n".join(failures)
