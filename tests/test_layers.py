"""The layers of difrl, enforced: `lint-imports` checks the contracts in pyproject.toml ([tool.importlinter]).

    .venv/bin/lint-imports                      # from the repository root; docs/architecture.md explains the layers
    pytest tests/test_layers.py

The contracts: the layers (a module imports only from its own layer or below), difrl.correct alone (it imports
nothing of difrl or of the diffusion stack), and no import cycle between sibling modules. The planted cases copy
the package's Python files to a temporary directory, add one offending import and check that the linter fails
on that contract and names the import (an upward import also closes a cycle, so it breaks no-cycles too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytest.importorskip("importlinter", reason="the dev extra installs import-linter (pip install -e '.[dev]')")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy's difrl, not the installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "difrl", tmp_path / "difrl", ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = root / module.replace(".", "/") / "__init__.py"
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def test_the_repository_keeps_every_contract():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("difrl layers", "difrl.correct imports nothing", "no import cycles"):
        assert name in res.stdout
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("module, line, contract, shown", [
    # a leaf reaching up to the trainer
    ("difrl.quant.formats", "import difrl.train.config  # planted", "difrl layers", "difrl.quant.formats -> difrl.train.config"),
    # rewards below worlds: a reward may not import a world
    ("difrl.rewards.digits", "from difrl.worlds import digits as _w  # planted", "difrl layers",
     "difrl.rewards.digits -> difrl.worlds.digits"),
    # the corrector core must stay free of difrl (an LLM trainer imports it alone)
    ("difrl.correct.core", "import difrl.utils.io  # planted", "difrl.correct imports nothing", "difrl.correct.core"),
    # two siblings of one package importing each other
    ("difrl.algos.losses", "import difrl.algos.guard  # planted", None, None),
])
def test_a_planted_import_breaks_its_contract(tmp_path, module, line, contract, shown):
    root = _copy(tmp_path)
    assert _lint(root).returncode == 0  # the copy itself is clean
    if contract is None:  # the cycle: guard already imports nothing of losses, so plant both directions
        _plant(root, "difrl.algos.guard", "import difrl.algos.losses  # planted")
        contract, shown = "no import cycles", "No cycles are allowed in difrl.algos."
    _plant(root, module, line)
    res = _lint(root)
    assert res.returncode != 0
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and shown in broken, res.stdout
    if contract == "no import cycles":  # a cycle inside one layer breaks only that contract
        assert "1 broken" in res.stdout, res.stdout
