"""Cross-family checks: every kind of the adapter table (difrl.models.adapters.ADAPTERS: the built-in families and
the registered tests/model_plugins.py "example") trains with BranchGRPO trees and with Sol-RL from its low-precision
rollout copy, and the family table (docs/guides/real-models.md) names a test or benchmark row for every built-in family.

    HF_HUB_OFFLINE=1 python -m pytest tests/test_family_matrix.py -q
    HF_HUB_OFFLINE=1 python -m pytest tests/test_family_matrix.py -q -k sd3      # one family

A family added to the table gets these checks for free. Each training case is ONE iteration on the family's tiny
pipeline (tests/test_train_diffusers.py's SMALL settings: 2 prompts x 4 samples, 3 steps) with the rollout copy built
from the family's own `quant_preset` skip list, emulated on CPU (min_dim 0: at tiny widths every layer is below the
real models' size threshold, so the skip list alone decides; 2-4 s a case on 2 cores). It checks:
a. trees (nvfp4 copy): the copy quantized exactly the transformer's linear layers the preset does not skip; the tree's
   trained edges and the NFE split (tree on the copy, proximal log-probs at full precision) are the closed-form
   counts (difrl.branching); the copy is another policy (a log-prob gap) and the first micro-step's ratio against the
   recomputed proximal policy is 1; every LoRA B moved, no base weight is trainable.
b. Sol-RL (fp8 copy): the same quantized set; the candidates came from the quantized copy (deterministic, preview
   steps), the regenerated ones are a subset of their seeds sampled at full precision; the NFE counts and the trained
   samples are the configured ones; ratio 1 on the first micro-step; every LoRA B moved.
c. The family table (docs/guides/real-models.md, "What each family is checked for"): a row per built-in kind, each
   cell naming a test (`tests/<file>.py::<function>`) that runs for that kind (parametrised over "kind" with it among the values, or
   named after it, or in tests/test_<kind>.py), a bench_plan row (benchmarks/bench_plan.py CASES, whose config trains that kind), or
   "not planned yet".
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difrl.models.adapters import BUILTIN_ADAPTERS  # noqa: E402
from doc_pages import docs_text  # noqa: E402
from difrl.models.base import forwards_per_step  # noqa: E402
from difrl.train.flow import trainer as flow  # noqa: E402
from difrl.train.flow.trainer import train  # noqa: E402
from test_train_diffusers import KINDS, N_STEPS, ROOT, dead_lora, tiny_cfg, tiny_dirs, _record  # noqa: E402,F401
from tolerances import FLOW_FIRST_STEP_LOG_RATIO  # noqa: E402

# one iteration; min_dim 0: the tiny layers are all below the real models' size threshold, so the skip list decides
ONE = ["train.iterations=1", "rollout.quant_min_dim=0"]
# one tree per prompt split at steps 0 and 1 (4 leaves = the group), sampled by the NVFP4 copy; the copy is another
# policy, so the update's ratio is taken against the recomputed full-precision proximal policy, with token-level TIS
TREE = ["rollout.kind=tree", "tree.split_steps=[0,1]", "rollout.precision=nvfp4", "correct.method=token_tis"]
# 8 candidates per prompt from the fp8 copy in 2 deterministic steps, the best / worst 4 regenerated at full precision
# (Sol-RL samples each candidate from its own initial noise)
CANDIDATES, PREVIEW = 8, 2
SOLRL = ["rollout.kind=solrl", "rollout.same_init_noise=false", "rollout.precision=fp8",
         f"solrl.candidates={CANDIDATES}", f"solrl.preview_steps={PREVIEW}"]


def _spy_copy(monkeypatch) -> dict:
    """Capture the trainer's rollout copy (test-side instrumentation only)."""
    seen = {}
    build = flow.build_rollout_copy

    def spy(*a, **k):
        seen["copy"], source = build(*a, **k)
        return seen["copy"], source

    monkeypatch.setattr(flow, "build_rollout_copy", spy)
    return seen


def _check_copy(copy, policy, fmt: str) -> None:
    """The copy quantized exactly the transformer's linear layers that no skip entry of the family's preset names,
    and kept every named one in high precision (by name: min_dim 0 skips nothing by size)."""
    skip = policy.quant_preset["skip"]
    net = policy.module.get_base_model() if hasattr(policy.module, "get_base_model") else policy.module  # what the
    # copy copies: the trained network without peft's wrapper (its LoRA layers folded back into their base linears)
    linears = [n.replace(".base_layer", "") for n, m in net.named_modules()
               if isinstance(m, torch.nn.Linear) and ".lora_" not in n]
    kept = {n for n in linears if any(s in n for s in skip)}
    assert copy.fmt == fmt and len(copy.report.rows) == len(linears)
    assert set(copy.report.quantized) == set(linears) - kept and copy.report.quantized
    assert {r[0] for r in copy.report.rows if r[2] == "skipped"} == kept
    assert all(r[3].startswith("name matches") for r in copy.report.rows if r[2] == "skipped")


def _check_lora_trained(seen) -> None:
    """One update from LoRA B = 0: every LoRA B moved (its gradient is A's input projection, nonzero; A's is zero at
    B = 0, so only B is asserted) but the structurally dead one, and no base weight is trainable."""
    policy = seen["world"].policy
    after = dict(policy.module.named_parameters())
    b_init = {n: v for n, v in seen["init"].items() if "lora_B" in n}
    unchanged = {n.split(".lora_")[0].removeprefix("base_model.model.") for n, v in b_init.items()
                 if torch.equal(after[n], v)}
    assert b_init and unchanged == dead_lora(policy), unchanged
    assert all(not p.requires_grad for n, p in after.items() if "lora_" not in n)


def _rows(summary) -> list[dict]:
    return [json.loads(ln) for ln in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_rollouts_from_the_low_precision_copy_train(kind, tiny_dirs, tmp_path, monkeypatch):
    from difrl.branching import BranchSchedule, nfe, num_trained_edges

    seen, copy = _record(monkeypatch), _spy_copy(monkeypatch)
    cfg = tiny_cfg(kind, tiny_dirs(kind), *TREE, *ONE)
    summary = train(cfg, tmp_path / "tree")
    policy = seen["world"].policy
    _check_copy(copy["copy"], policy, "nvfp4")
    (row,) = _rows(summary)
    # 2 prompts, one tree each, split at steps 0 and 1 (2 x 2 = 4 leaves = the group); steps 0, 1 SDE, the last ODE
    sched, sde = BranchSchedule((0, 1)), torch.tensor([True, True, False])
    edges, fps = num_trained_edges(sched, N_STEPS, sde, trees=2), forwards_per_step(policy, cfg.sampler.guidance)
    assert row["tree/edges_sampled"] == row["tree/edges_trained"] == edges
    assert row["nfe_lowprec"] == nfe(sched, N_STEPS, trees=2) * fps  # the tree on the copy
    assert row["nfe_full"] == edges * fps  # one full-precision proximal log-prob per trained edge
    assert row["trained_samples"] == 8 and row["tree/edge_adv_abs_mean"] > 0
    # the copy is another policy (gap > 0); the ratio against the recomputed proximal policy starts at 1 (1e-6: the
    # trainer's own on-policy tolerance, float rounding of identical forwards)
    assert row["correct/copy_policy_log_prob_gap"] > 0
    assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    assert row["first_step_policy_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    _check_lora_trained(seen)


@pytest.mark.parametrize("kind", KINDS)
def test_solrl_candidates_from_the_low_precision_copy_train(kind, tiny_dirs, tmp_path, monkeypatch):
    import difrl.solrl as solrl
    from difrl.quant import quantized_layers

    calls = []
    real = flow.rollout

    def spy(policy, prompts, seeds, sigmas, kernel="flow_sde", *args, **kwargs):
        calls.append({"kernel": kernel, "seeds": seeds.clone(), "steps": len(sigmas) - 1,
                      "quantized": bool(quantized_layers(policy.module))})
        return real(policy, prompts, seeds, sigmas, kernel, *args, **kwargs)

    monkeypatch.setattr(solrl, "rollout", spy)  # stage 1: the candidate pool
    monkeypatch.setattr(flow, "rollout", spy)  # stage 2: the trained rollouts
    seen, copy = _record(monkeypatch), _spy_copy(monkeypatch)
    cfg = tiny_cfg(kind, tiny_dirs(kind), *SOLRL, *ONE)
    summary = train(cfg, tmp_path / "solrl")
    policy = seen["world"].policy
    _check_copy(copy["copy"], policy, "fp8")
    P, G = cfg.rollout.prompts_per_iter, cfg.rollout.group_size
    cand = [c for c in calls if c["quantized"]]
    regen = [c for c in calls if not c["quantized"] and c["kernel"] == cfg.sampler.kind]
    assert cand and all(c["kernel"] == "ode" and c["steps"] == PREVIEW for c in cand)
    cand_seeds = torch.cat([c["seeds"] for c in cand])
    assert len(cand_seeds) == P * CANDIDATES
    assert len(regen) == 1 and regen[0]["steps"] == N_STEPS and len(regen[0]["seeds"]) == P * G
    assert set(regen[0]["seeds"].tolist()) <= set(cand_seeds.tolist())
    (row,) = _rows(summary)
    fps = forwards_per_step(policy, cfg.sampler.guidance)
    assert row["nfe_lowprec"] == P * CANDIDATES * PREVIEW * fps and row["nfe_full"] == P * G * N_STEPS * fps
    assert row["trained_samples"] == P * G and -1.0 <= row["solrl/spearman_median"] <= 1.0
    # stage 2 is on-policy (the trainer's tolerance)
    assert row["first_step_max_abs_log_ratio"] <= FLOW_FIRST_STEP_LOG_RATIO
    _check_lora_trained(seen)


# ---- c. the family table of docs/guides/real-models.md ------------------------------------------------------------------------

COLUMNS = ("family", "pipeline parity", "LoRA loads in diffusers", "FSDP = 1 process", "low-precision copy",
           "trees / Sol-RL", "learns", "real-size plan")
NOT_PLANNED = "not planned yet"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
PLAN_REF = re.compile(r'bench_plan "([^"]+)"')


def family_table(text: str) -> dict[str, list[str]]:
    """kind -> its row's cells after the family cell, from the documentation's table headed by COLUMNS."""
    head = "| " + " | ".join(COLUMNS) + " |"
    assert head in text, f"the documentation (README.md, docs/) has no family table headed {head!r}"
    lines = text[text.index(head):].splitlines()[2:]  # after the header and its |---| line
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        kind = re.search(r"`(\w+)`", cells[0])
        assert kind and len(cells) == len(COLUMNS), f"family table: malformed row {line!r}"
        rows[kind.group(1)] = cells[1:]
    return rows


def _bench_plan_cases() -> dict[str, str]:
    """bench_plan's CASES: row name -> its config file."""
    tree = ast.parse((ROOT / "benchmarks" / "bench_plan.py").read_text())
    cases = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CASES")
    return {ast.literal_eval(t.elts[0]): ast.literal_eval(t.elts[1]) for t in cases.elts}


def _runs_for(fn, kind: str) -> bool:
    """Test function `fn` runs for `kind`: a parametrisation over "kind" holds it, or its name or its file's
    (tests/test_<kind>.py: a family's own tests) says it."""
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize" and "kind" in [a.strip() for a in str(mark.args[0]).split(",")]:
            i = [a.strip() for a in str(mark.args[0]).split(",")].index("kind")
            values = [getattr(v, "values", v) for v in mark.args[1]]  # pytest.param(...) -> its values
            if any((v[i] if isinstance(v, (tuple, list)) else v) == kind for v in values):
                return True
    return kind in fn.__name__.split("_") or fn.__module__.rsplit(".", 1)[-1] == f"test_{kind}"


def test_readme_family_table_names_a_check_for_every_family_and_cell():
    import yaml

    rows = family_table(docs_text())  # docs/guides/real-models.md, "What each family is checked for"
    assert set(BUILTIN_ADAPTERS) <= set(rows), f"the family table lacks {sorted(set(BUILTIN_ADAPTERS) - set(rows))}"
    refs = {(kind, col): (TEST_REF.findall(cell), PLAN_REF.findall(cell))
            for kind, cells in rows.items() for col, cell in zip(COLUMNS[1:], cells)}
    for (kind, col), (tests, plans) in refs.items():
        cell = rows[kind][COLUMNS.index(col) - 1]
        if col == "real-size plan":
            assert plans or cell == NOT_PLANNED, f"{kind} / {col}: name bench_plan rows or say {NOT_PLANNED!r}"
        else:
            assert tests, f"{kind} / {col}: no `tests/<file>.py::<function>` in {cell!r}"
    files = {f for tests, _ in refs.values() for f, _ in tests}
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    cases = _bench_plan_cases()
    for (kind, col), (tests, plans) in refs.items():
        for f, name in tests:  # tests/ is on sys.path (test modules import each other): the module as pytest sees it
            fn = getattr(importlib.import_module(Path(f).stem), name, None)
            assert callable(fn), f"{kind} / {col}: {f} defines no {name}"
            assert _runs_for(fn, kind), (f"{kind} / {col}: {f}::{name} is neither parametrised over {kind!r} "
                                         "nor named after it")
        for name in plans:
            assert name in cases, f"{kind} / {col}: no bench_plan row {name!r} in benchmarks/bench_plan.py CASES"
            config = yaml.safe_load((ROOT / cases[name]).read_text())
            trains = config["model"]["kind"]
            assert trains == kind, f"{kind} / {col}: bench_plan row {name!r} trains {trains}, not {kind}"
