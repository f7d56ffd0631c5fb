"""Check that every figure in README.md, the documentation pages (docs/**/*.md), BENCHMARKS.md and RELIABILITY.md
comes with a command that produces it.

    python scripts/check_claims.py              # exit 1, one line per problem: FILE:LINE: 'figure': why
    python scripts/check_claims.py --list       # also every block: its lines, its command(s), its figures

What a block is. Each document is cut into blocks, and every figure belongs to exactly one:
- a *generated block*: the lines between ``<!-- NAME:start -->`` (or ``NAME:begin``) and ``<!-- NAME:end -->``,
  which a script writes (benchmarks/common.py's write_block; scripts/overoptimisation.py). RELIABILITY.md is
  written whole by benchmarks/reliability.py, so the whole file is one generated block (NAME reliability).
- a *section*: outside generated blocks, the lines from a markdown heading (any level) to the next heading;
  the lines before the first heading are a section too. A section's command may also be the one of a
  generated block inside it (the prose right after a table reads that table).

What a figure is: a number in the text, e.g. ``0.984``, ``1,336``, ``8e-8``, ``+31.4``, ``0.33×``, ``40%``,
``8 min``. Not figures: anything in a code span or code block (commands, keys, paths), in an HTML comment or a
link target; a number glued to a letter or an underscore (``SD3``, ``FLUX.1``, ``ViT-H-14``, ``v2.1``, ``8x8``), a
section sign (``§2.8``), a date or a time of day, and the number of an ordered-list item.

What is checked:
1. every block holding a figure names a command: a code span or code block that starts with a command
   (``python``, ``difrl``, ``make``, ``torchrun``, ``accelerate launch``, ``pytest``, ``.venv/bin/python``) or is the
   path of a script or test of this repository that exists (``benchmarks/x.py``, ``scripts/x.py``,
   ``tests/test_x.py[::name]``);
2. a generated block starts with its command (``Command: `...` `` or a first line that is a command span); the
   command must be runnable from a clean checkout: no ``--only-finished`` (a partial table), and no absolute
   path (a temporary or machine-specific directory, e.g. ``--out /tmp/...``) in the command or anywhere in the
   block (a model trained into such a directory is not something a user has);
3. a generated block's command names ``--json benchmarks/results/NAME.json`` (RELIABILITY.md and the
   over-optimisation block too), that file exists, and every figure of the block outside its
   Command / Date / Machine / Commit lines equals a number of that JSON at the precision printed
   (``0.984`` matches any value in [0.9835, 0.9845]; a percentage also matches a fraction; integers match
   exactly). A figure the script derives from several rows (a ratio, a sum) must be in the JSON too.

Known gaps. A figure that a script derives from several rows (a count of rows, a ratio, a per-leaf figure)
and does not store is not in its JSON. scripts/check_claims_known.txt lists such figures per generated block,
each entry with the reason; they are reported as known (``--list``), not as problems. An entry that no
longer matches a figure of its block is a problem (so the list can only shrink: a script that starts
storing its derived figures, or a re-run, removes entries). A new unmatched figure is never known.

Exit status 0 when nothing is wrong. tests/test_check_claims.py runs this on the repository's documents.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "BENCHMARKS.md", "RELIABILITY.md")  # and every page under docs/ (documents_of)
WHOLE_FILE_BLOCKS = {"RELIABILITY.md": "reliability"}  # written whole by one script
COMMAND_WORDS = ("python ", "python3 ", "difrl ", "make ", "torchrun ", "accelerate launch ", "pytest ",
                 ".venv/bin/python ", "HF_HUB_OFFLINE=1 ", "/usr/bin/time ")
MARKER = re.compile(r"^<!--\s*([\w.-]+):(start|begin|end)\s*-->\s*$")
HEADING = re.compile(r"^#{1,6} ")
# a number: optional sign, digits with optional thousands commas, optional decimals, optional exponent
NUMBER = re.compile(r"(?<![\w.§/:-])([+−-]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][+−-]?\d+)?(?![\w.:]\w|\w)")
UNITS = {"KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "ms": 1e-3}
MODEL_NAMES = re.compile(r"\b(Wan|Python|python3|CUDA|torch) \d+(\.\d+)*")


@dataclass
class Figure:
    line: int  # 1-based line in its file
    text: str  # as printed
    value: float
    decimals: int | None  # printed decimals (None: an exponent form)
    percent: bool
    scale: float = 1.0  # a unit printed after it: KiB / MiB / GiB (the JSON holds bytes), ms (it may hold seconds)


@dataclass
class Block:
    file: str
    kind: str  # "generated" or "section"
    name: str  # the marker name, or the heading text
    start: int  # 1-based first line
    lines: list[tuple[int, str]] = field(default_factory=list)
    inner: list["Block"] = field(default_factory=list)  # generated blocks inside a section


@dataclass
class Problem:
    file: str
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.figure!r}: {self.why}" if self.figure else f"{self.file}:{self.line}: {self.why}"


# ---------------------------------------------------------------------------------- reading a document


def split_blocks(file: str, text: str) -> list[Block]:
    """Sections (with the generated blocks inside them in .inner) in document order."""
    lines = text.splitlines()
    if file in WHOLE_FILE_BLOCKS:
        return [Block(file, "generated", WHOLE_FILE_BLOCKS[file], 1, list(enumerate(lines, 1)))]
    sections: list[Block] = [Block(file, "section", "(top of the file)", 1)]
    gen: Block | None = None
    fence = False
    for n, line in enumerate(lines, 1):
        m = MARKER.match(line.strip())
        if m and not fence:
            name, edge = m.group(1), m.group(2)
            if edge in ("start", "begin"):
                if gen is not None:
                    raise ValueError(f"{file}:{n}: generated block {name!r} starts inside {gen.name!r}")
                gen = Block(file, "generated", name, n + 1)
                sections[-1].inner.append(gen)
            else:
                if gen is None or gen.name != name:
                    raise ValueError(f"{file}:{n}: end of {name!r} without its start")
                gen = None
            continue
        if line.lstrip().startswith("```"):
            fence = not fence
        if gen is not None:
            gen.lines.append((n, line))
            continue
        if HEADING.match(line) and not fence:
            sections.append(Block(file, "section", line.lstrip("#").strip(), n))
        sections[-1].lines.append((n, line))
    if gen is not None:
        raise ValueError(f"{file}: generated block {gen.name!r} has no end marker")
    return sections


def prose(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The lines with code blocks, code spans, HTML comments and link targets blanked out."""
    out, fence = [], False
    for n, line in lines:
        if line.lstrip().startswith("```"):
            fence = not fence
            out.append((n, ""))
            continue
        if fence:
            out.append((n, ""))
            continue
        line = re.sub(r"`[^`]*`", " ", line)
        line = re.sub(r"<!--.*?-->", " ", line)
        line = re.sub(r"\]\([^)]*\)", "]", line)
        line = re.sub(r"\b\d{4}-\d{2}-\d{2}\b", " ", line)  # dates
        line = re.sub(r"\b\d{1,2}:\d{2}\b", " ", line)  # times of day
        line = re.sub(r"^\s*\d+\.\s", " ", line)  # ordered-list numbers
        line = re.sub(MODEL_NAMES, " ", line)  # "Wan 2.1": a name
        line = re.sub(r"(?<=[\d%])-(?=\d)", " ", line)  # a range "2.64%-2.66%": two positive numbers
        out.append((n, line))
    return out


def figures(lines: list[tuple[int, str]]) -> list[Figure]:
    found = []
    for n, line in prose(lines):
        for m in NUMBER.finditer(line):
            sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or "", m.group(4) or ""
            after = line[m.end():]
            if after[:1] in ("x", "X") and after[1:2].isalpha():
                continue  # 8x8-like shapes glued to a word
            if after[:1] in ("x", "X") and re.match(r"^[xX]\d", after):
                continue  # 8x8
            text = f"{sign}{whole}{frac}{exp}"
            value = float((sign.replace("−", "-") + whole.replace(",", "") + frac + exp.replace("−", "-")))
            unit = re.match(r"\s?(KiB|MiB|GiB|ms)\b", after)
            found.append(Figure(n, text, value, None if exp else len(frac) - 1 if frac else 0,
                                after.lstrip().startswith("%"), UNITS[unit.group(1)] if unit else 1.0))
    return found


def commands(lines: list[tuple[int, str]], root: Path = ROOT) -> list[str]:
    """The commands a block names: code spans / code-block lines that start with a command word, or that are
    the path of an existing script or test of the repository."""
    found, fence = [], False
    for _, line in lines:
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        spans = [line.strip()] if fence else re.findall(r"`([^`]+)`", line)
        for s in spans:
            s = s.strip().lstrip("$ ").strip()
            if s.startswith(COMMAND_WORDS):
                found.append(s)
                continue
            path = s.split("::")[0].split()[0] if s else ""
            if re.fullmatch(r"(benchmarks|scripts|tests)/[\w/.-]+\.py", path) and (root / path).is_file():
                found.append(s)
    return found


# ---------------------------------------------------------------------------------- the JSON side


def json_numbers(path: Path) -> list[float]:
    out: list[float] = []

    def walk(v) -> None:
        if isinstance(v, bool):
            out.append(float(v))
        elif isinstance(v, (int, float)):
            if math.isfinite(v):
                out.append(float(v))
        elif isinstance(v, dict):
            for k, x in v.items():  # a numeric key is a figure too ({"50": eval row} of iteration 50)
                if isinstance(k, str) and re.fullmatch(r"-?\d+(\.\d+)?", k):
                    out.append(float(k))
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, str):  # numbers inside strings, e.g. a "what" column ("12 bytes at 40")
            for m in re.finditer(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", v):
                out.append(float(m.group(0)))

    walk(json.loads(path.read_text()))
    return out


def script_literals(path: Path) -> list[float]:
    """The numeric literals of the script that writes a block: its fixed parameters (steps, samples, a goal),
    which the block prints as text, not results."""
    return [float(m.group(0).replace("_", "")) for m in
            re.finditer(r"(?<![\w.])\d[\d_]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w|\.\d)", path.read_text())]


def matches(fig: Figure, values: list[float]) -> bool:
    """`fig` equals one of `values` at the precision printed (a percentage also as a fraction; a value printed
    with an exponent to its significant digits; a number printed as 1.2e+05 or 4.8e5 alike)."""
    targets = [fig.value] + ([fig.value / 100] if fig.percent else []) + [-fig.value]
    if fig.scale != 1.0:  # 768 KiB is 786432 bytes to the printed precision: compare in the printed unit
        values = values + [v / fig.scale for v in values]
    for t in targets:
        if fig.decimals is None:  # exponent form: the printed mantissa's precision
            mant = re.split(r"[eE]", fig.text)[0]
            digits = len(mant.split(".")[1]) if "." in mant else 0
            tol = 0.5 * 10 ** (math.floor(math.log10(abs(t))) - digits) if t else 0.0
        else:
            scale = 100 if (fig.percent and t is not targets[0]) else 1
            tol = 0.5 * 10 ** -fig.decimals / scale
        tol = tol * (1 + 1e-9) + 1e-12
        if any(abs(v - t) <= tol for v in values):
            return True
    return False


# ---------------------------------------------------------------------------------- the checks


STAMP = re.compile(r"^(Command|Date|Machine|Commit):")


def generated_command(block: Block) -> tuple[str | None, int]:
    for n, line in block.lines:
        if not line.strip() or line.startswith("#"):
            continue
        m = re.match(r"^Command: `([^`]+)`", line) or re.match(r"^`((?:python|difrl|make)[^`]*)`", line)
        return (m.group(1), n) if m else (None, n)
    return None, block.start


def check_generated(block: Block, problems: list[Problem], root: Path = ROOT) -> None:
    cmd, at = generated_command(block)
    if cmd is None:
        problems.append(Problem(block.file, at, "", f"generated block {block.name!r} does not start with its "
                                                    "command (a 'Command: `...`' line)"))
        return
    if "--only-finished" in cmd:
        problems.append(Problem(block.file, at, "", f"generated block {block.name!r}: its command `{cmd}` publishes "
                                                    "only the runs that had finished (--only-finished): a partial table"))
    for n, line in block.lines:
        if re.search(r"(?<![\w.])/(tmp|work|home|root|mnt|scratch|var)/", line) and not line.startswith(("Date:", "Machine:")):
            problems.append(Problem(block.file, n, "", f"generated block {block.name!r} names a machine-specific path "
                                                       "(a temporary or local directory a clean checkout does not "
                                                       "have): " + line.strip()[:120]))
    m = re.search(r"--json\s+(\S+)", cmd)
    if not m or not m.group(1).startswith("benchmarks/results/"):
        problems.append(Problem(block.file, at, "", f"generated block {block.name!r}: its command `{cmd}` writes no "
                                                    "--json under benchmarks/results/, so its figures cannot be checked"))
        return
    path = root / m.group(1)
    if not path.is_file():
        problems.append(Problem(block.file, at, "", f"generated block {block.name!r}: {m.group(1)} does not exist"))
        return
    values = json_numbers(path)
    script = re.search(r"((?:benchmarks|scripts)/\w+\.py)", cmd)
    fixed = script_literals(root / script.group(1)) if script and (root / script.group(1)).is_file() else []
    body = [(n, line) for n, line in block.lines if not STAMP.match(line)]
    for fig in figures(body):
        if not matches(fig, values) and not matches(fig, fixed):
            problems.append(Problem(block.file, fig.line, fig.text, f"neither a number of {m.group(1)} at the precision "
                                                                    f"printed nor a constant of {script.group(1) if script else 'its script'} "
                                                                    f"(generated block {block.name!r})"))


def check_section(block: Block, problems: list[Problem], root: Path = ROOT) -> None:
    figs = figures(block.lines)
    if not figs:
        return
    named = commands(block.lines, root) + [c for g in block.inner for c in
                                           [generated_command(g)[0]] + commands(g.lines, root) if c]
    if not named:
        for fig in figs:
            problems.append(Problem(block.file, fig.line, fig.text, f"section {block.name!r} names no command that "
                                                                    "produces its figures"))


KNOWN = ROOT / "scripts" / "check_claims_known.txt"


def read_known(path: Path) -> dict[str, tuple[set[str], str, int]]:
    """block name -> (figures as printed, reason, line in the file). Format, one block per line:
    ``NAME FIGURE FIGURE ... | why these are not in the JSON``; '#' starts a comment."""
    known: dict[str, tuple[set[str], str, int]] = {}
    if not path.is_file():
        return known
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, sep, why = line.partition("|")
        words = head.split()
        if not sep or len(words) < 2 or not why.strip():
            raise ValueError(f"{path}:{n}: expected 'NAME FIGURE ... | reason', got {line!r}")
        figs, old = set(words[1:]), known.get(words[0], (set(), "", n))
        known[words[0]] = (old[0] | figs, (old[1] + "; " if old[1] else "") + why.strip(), n)
    return known


def documents_of(root: Path = ROOT) -> tuple[str, ...]:
    """DOCUMENTS and the documentation pages under root/docs (relative paths), where README's sections went. Left
    out: a link (docs/BENCHMARKS.md, which puts the root's file in the site), read once as the file it points to, and
    docs/reference/ (the API from docstrings, and the specs: published numbers of others, which no command here
    produces)."""
    docs = root / "docs"
    pages = sorted(p.relative_to(root).as_posix() for p in docs.rglob("*.md")
                   if not p.is_symlink() and "reference" not in p.relative_to(docs).parts[:1]) if docs.is_dir() else []
    return (*DOCUMENTS, *pages)


def check(root: Path = ROOT, documents=None, listing: bool = False, known_path: Path | None = None) -> list[Problem]:
    documents = documents_of(root) if documents is None else documents
    known = read_known(KNOWN if known_path is None else known_path)
    used: set[tuple[str, str]] = set()
    problems: list[Problem] = []
    for doc in documents:
        path = root / doc
        if not path.is_file():
            problems.append(Problem(doc, 1, "", "document missing"))
            continue
        for block in split_blocks(doc, path.read_text()):
            blocks = [block] + block.inner
            for b in blocks:
                if listing:
                    cmds = commands(b.lines, root) if b.kind == "section" else [generated_command(b)[0]]
                    print(f"{doc}:{b.start}: {b.kind} {b.name!r}: commands {cmds}; figures "
                          f"{[f.text for f in figures(b.lines)][:12]}")
                if b.kind == "section":
                    check_section(b, problems, root)
                    continue
                found: list[Problem] = []
                check_generated(b, found, root)
                figs, why, _ = known.get(b.name, (set(), "", 0))
                for prob in found:
                    if prob.figure and prob.figure in figs:
                        used.add((b.name, prob.figure))
                        if listing:
                            print(f"  known: {prob.file}:{prob.line}: {prob.figure!r}: {why}")
                    else:
                        problems.append(prob)
    names = {b.name for doc in documents if (root / doc).is_file()
             for blk in split_blocks(doc, (root / doc).read_text()) for b in [blk, *blk.inner]}
    for name, (figs, why, n) in known.items():
        for fig in sorted(figs):
            if (name, fig) not in used:
                where = "no such generated block" if name not in names else "no unmatched figure of the block prints it"
                problems.append(Problem("scripts/check_claims_known.txt", n, fig, f"stale known entry for {name!r}: "
                                                                                  f"{where}; remove it"))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print every block with its commands and figures")
    args = ap.parse_args(argv)
    problems = check(listing=args.list)
    for p in problems:
        print(p)
    print(f"check_claims: {len(problems)} problem(s) in {', '.join(DOCUMENTS)} and docs/", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
