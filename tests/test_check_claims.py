"""scripts/check_claims.py: every figure of README.md / docs/ / BENCHMARKS.md / RELIABILITY.md has its command, and the
figures of generated blocks are the numbers of their JSON results.

    .venv/bin/python -m pytest tests/test_check_claims.py -q

The first test runs the check on the repository's documents; the others feed it small documents that break
one rule each, so that a check that stopped looking would fail here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("check_claims", ROOT / "scripts" / "check_claims.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_claims"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


cc = _load()


def test_the_repositorys_documents_pass():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_claims.py")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _repo(tmp_path: Path, readme: str = "", bench: str = "", results: dict | None = None, known: str = "") -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "benchmarks" / "bench_x.py").write_text("STEPS = 10\nGOAL = 1.05  # goal\n")
    (tmp_path / "scripts" / "make_x.py").write_text("")
    for name, rows in (results or {}).items():
        (tmp_path / "benchmarks" / "results" / name).write_text(json.dumps(rows))
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "BENCHMARKS.md").write_text(bench)
    (tmp_path / "RELIABILITY.md").write_text("# Reliability\n\nCommand: `python benchmarks/bench_x.py --json "
                                             "benchmarks/results/rel.json`  \n\n| a | 3 |\n")
    (tmp_path / "benchmarks" / "results" / "rel.json").write_text(json.dumps([{"a": 3}]))
    (tmp_path / "known.txt").write_text(known)
    return tmp_path


def _problems(root: Path) -> list[str]:
    return [str(p) for p in cc.check(root, known_path=root / "known.txt")]


BLOCK = """# Benchmarks

<!-- bench_x:start -->
## X

Command: `python benchmarks/bench_x.py --json benchmarks/results/bench_x.json`  
Date: 2026-12-04 09:43 UTC  
Machine: AMD EPYC, 2 cores available

{body}
<!-- bench_x:end -->
"""


def test_a_section_with_a_figure_and_no_command_is_named_with_file_line_and_figure(tmp_path):
    readme = ("# T\n\nIntro without figures.\n\n## Speed\n\nIt ran 8 min 2 s, accuracy 0.984.\n\n"
              "## Named\n\nAccuracy 0.91 (`difrl eval configs/x.yaml`).\n\n"
              "## Test\n\nWithin 1e-6 (`tests/test_nothing_here.py`).\n")
    probs = _problems(_repo(tmp_path, readme=readme))
    assert "README.md:7: '8': section 'Speed' names no command that produces its figures" in probs
    assert any(p.startswith("README.md:7: '0.984'") for p in probs)
    assert not any("Named" in p for p in probs)  # a command span names its command
    assert any("README.md:15: '1e-6'" in p for p in probs)  # a test path counts only if the test exists


def test_the_docs_pages_are_checked_like_the_readme(tmp_path):
    # README's sections moved to docs/ (issue 49): a page's figures need their command as README's did; a link in
    # docs/ to a root document (docs/BENCHMARKS.md, which puts it in the site) is not read a second time
    root = _repo(tmp_path, bench="# B\n\n## S\n\nIt took 9 s.\n")
    (root / "docs" / "guides").mkdir(parents=True)
    (root / "docs" / "guides" / "x.md").write_text("# X\n\n## Speed\n\nIt ran 8 min.\n\n## Named\n\n"
                                                 "Accuracy 0.91 (`difrl eval configs/x.yaml`).\n")
    (root / "docs" / "BENCHMARKS.md").symlink_to(root / "BENCHMARKS.md")
    (root / "docs" / "reference" / "specs").mkdir(parents=True)  # others' published numbers: not ours to re-run
    (root / "docs" / "reference" / "specs" / "paper.md").write_text("# Paper\n\nThe paper's lr is 3e-4.\n")
    probs = _problems(root)
    assert "docs/guides/x.md:5: '8': section 'Speed' names no command that produces its figures" in probs
    assert not any("Named" in p for p in probs)
    assert not any(p.startswith("docs/reference/") for p in probs)
    assert [p for p in probs if "'9'" in p] == ["BENCHMARKS.md:5: '9': section 'S' names no command that produces "
                                                "its figures"]


def test_numbers_that_are_not_figures_are_left_alone(tmp_path):
    readme = ("# T\n\n## Names\n\nSD3, FLUX.1 and Wan 2.1 on 8x8 digits (ViT-H-14, HPSv2.1, §2.8), on 2026-12-04 at "
              "09:43; `train.lr=3e-4` and a [link](https://x.org/2.5).\n\n1. a list item\n")
    assert _problems(_repo(tmp_path, readme=readme)) == []


def test_generated_block_figures_must_be_json_numbers_at_the_printed_precision(tmp_path):
    body = ("| method | accuracy | share | size | steps |\n|---|---:|---:|---:|---:|\n"
            "| a | 0.984 ± 0.002 | 40% | 768 KiB | 10 |\n| b | 0.985 | 12.5% | 1.2e+05 | 1.05 |")
    rows = [{"m": "a", "acc": 0.98412, "std": 0.0021, "share": 0.4, "bytes": 786432},
            {"m": "b", "acc": 0.9861, "share": 0.125, "n": 121000}]
    probs = _problems(_repo(tmp_path, bench=BLOCK.format(body=body), results={"bench_x.json": rows}))
    # 0.985 is not 0.9861 at three decimals; everything else matches (10 and 1.05 are the script's constants)
    assert probs == ["BENCHMARKS.md:13: '0.985': neither a number of benchmarks/results/bench_x.json at the precision "
                     "printed nor a constant of benchmarks/bench_x.py (generated block 'bench_x')"]


def test_generated_block_commands_must_be_runnable_from_a_clean_checkout(tmp_path):
    bench = BLOCK.format(body="Model trained into `/work/main/runs/x`: 0.5.").replace(
        "--json benchmarks/results/bench_x.json", "--only-finished --out /tmp/t23/x --reuse --json "
                                                  "benchmarks/results/bench_x.json")
    probs = _problems(_repo(tmp_path, bench=bench, results={"bench_x.json": [{"v": 0.5}]}))
    assert any("BENCHMARKS.md:6:" in p and "--only-finished" in p for p in probs), probs
    assert any("BENCHMARKS.md:6:" in p and "machine-specific path" in p for p in probs), probs
    assert any("BENCHMARKS.md:10:" in p and "machine-specific path" in p for p in probs), probs


def test_generated_block_without_command_or_json_is_a_problem(tmp_path):
    no_cmd = "# B\n\n<!-- y:start -->\n## Y\n\nJust 0.5.\n<!-- y:end -->\n"
    probs = _problems(_repo(tmp_path, bench=no_cmd))
    assert probs == ["BENCHMARKS.md:6: generated block 'y' does not start with its command (a 'Command: `...`' line)"]
    missing = BLOCK.format(body="0.5")
    probs = _problems(_repo(tmp_path / "b", bench=missing))
    assert probs == ["BENCHMARKS.md:6: generated block 'bench_x': benchmarks/results/bench_x.json does not exist"]


def test_known_figures_are_accepted_and_stale_entries_fail(tmp_path):
    body = "Per leaf 4.81 and total 2.73e+05."
    known = "bench_x 4.81 | NFE per leaf, divided when printed\nbench_x 7.77 | gone\nother 1 | no such block\n"
    probs = _problems(_repo(tmp_path, bench=BLOCK.format(body=body), results={"bench_x.json": [{"v": 1}]},
                            known=known))
    assert any("'2.73e+05'" in p for p in probs)  # not known
    assert not any("'4.81'" in p for p in probs)
    assert any(p.startswith("scripts/check_claims_known.txt:2: '7.77': stale known entry for 'bench_x'") for p in probs)
    assert any("'1': stale known entry for 'other': no such generated block" in p for p in probs)


def test_unbalanced_markers_name_the_line(tmp_path):
    with pytest.raises(ValueError, match=r"BENCHMARKS.md:3: end of 'z' without its start"):
        _problems(_repo(tmp_path, bench="# B\n\n<!-- z:end -->\n"))
    with pytest.raises(ValueError, match=r"generated block 'z' has no end marker"):
        _problems(_repo(tmp_path / "b", bench="# B\n\n<!-- z:start -->\n"))
