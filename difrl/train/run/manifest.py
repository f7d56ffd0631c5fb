"""Checkpoint manifests (size and SHA-256 of every file), hashed and verified by every process, each its own share.

    record = file_record(path)                          # {"bytes": n, "sha256": hex}
    report = check(ckpt_dir, allow_unverified, index, count)   # this process's share of the verification
    verified, problem = verdict(ckpt_dir, all_gather_objects(report))   # the same on every process

Why: a sharded checkpoint of a FLUX full fine-tune (weights, EMA, AdamW's moments: ~190 GB) hashed by one process
while the others wait takes minutes, against NCCL's 10-minute watchdog and against the point of sharding (nothing
passes through one host). So a sharded save has each process hash the files it wrote (difrl.train.run.state.save_sharded
gathers the small records into the manifest), and a resume has each process hash its share of the listed files
(`shares`: a shard file to the process that wrote it, the rest by size) while every process checks that
every listed file exists where it looks (a stat each: under resharding a process may read any shard file). The
reports are gathered (`all_gather_objects`, a few hundred bytes each) and `verdict` turns them into one message,
identical on every process, so that all fall back or all stop together and none is left waiting in a collective.

A file some processes see and others do not means the run directory is not shared (node-local disks on several
nodes): the message says so (SHARED). With one process the messages are those of a single-process verification.
"""

from __future__ import annotations

import json
from pathlib import Path

from difrl.utils.io import sha256_file

MANIFEST = "manifest.json"
SHARED = ("the files of a sharded checkpoint must all lie in one directory that every process reads and writes: a run "
          "on several nodes needs a shared run directory, on storage every node mounts (docs/guides/scale.md, sharded training)")


def all_gather_objects(obj) -> list:
    """`obj` from every process, in rank order (torch.distributed.all_gather_object: one small pickle each; under NCCL
    it travels on the current CUDA device, which accelerate sets); [obj] without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def file_record(f: Path) -> dict:
    """A manifest entry, from the bytes on disk (so it also catches a write that did not land as written)."""
    return {"bytes": f.stat().st_size, "sha256": sha256_file(f)}


def shares(listed: dict[str, tuple[int, str]], count: int) -> list[list[str]]:
    """The listed files cut into `count` shares of about equal bytes, the same on every process (every process reads
    the same manifest): DCP's ``__R_n.distcp`` to process R mod count (with as many processes as wrote it, each
    verifies what it wrote), then the rest largest first, each to the share with the fewest bytes so far (ties to
    the lower index)."""
    load, out = [0] * count, [[] for _ in range(count)]
    rest = []
    for name, (size, _) in sorted(listed.items(), key=lambda kv: (-kv[1][0], kv[0])):
        writer = name[2:].split("_", 1)[0] if name.startswith("__") and name.endswith(".distcp") else ""
        if writer.isdigit():
            i = int(writer) % count
            load[i] += size
            out[i].append(name)
        else:
            rest.append((name, size))
    for name, size in rest:
        i = min(range(count), key=lambda j: (load[j], j))
        load[i] += size
        out[i].append(name)
    return out


def check(path: Path, allow_unverified: bool, index: int = 0, count: int = 1) -> dict:
    """This process's part of verifying checkpoint `path` against its manifest (process `index` of `count`): every
    listed file's presence and size, the SHA-256 of its own share, and (process 0) files the manifest does not list.
    Never raises: a report for `verdict`, {"verified": bool, "problems": [[order, name, text]], "missing": [name]}."""
    report = {"verified": True, "problems": [], "missing": []}
    if not path.is_dir():  # another process sees it (it is one of the main process's checkpoints): not shared
        report["missing"].append("its directory")
        return report
    if not (path / MANIFEST).exists():
        report["verified"] = False
        if not allow_unverified:
            report["problems"].append([-1, "", f"{MANIFEST} is missing, so its bytes cannot be verified (deleted, or "
                                       "written before difrl wrote manifests); to load such a checkpoint unchecked pass "
                                       "resume_unverified=true"])
        return report
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
        listed = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        report["problems"].append([-1, "", f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"])
        return report
    mine = set(shares(listed, count)[index])
    for name, (size, digest) in sorted(listed.items()):
        f = path / name
        if not f.is_file():
            report["missing"].append(name)
        elif f.stat().st_size != size:
            report["problems"].append([0, name, f"{name} has {f.stat().st_size} bytes, the manifest says {size} "
                                       "(truncated or overwritten)"])
        elif name in mine and sha256_file(f) != digest:
            report["problems"].append([0, name, f"{name} does not match its SHA-256 in the manifest (its bytes changed)"])
    if index == 0:
        report["problems"] += [[1, f.name, f"{f.name} is not in the manifest"] for f in sorted(path.iterdir())
                               if f.is_file() and f.name != MANIFEST and f.name not in listed]
    return report


def verdict(path: Path, reports: list[dict]) -> tuple[bool, str | None]:
    """Every process's report of checkpoint `path` (in rank order) as (verified, the message naming each problem
    or None): a file missing on every process "is missing", one that only some processes see names them and the
    shared-directory requirement, as does a missing DCP shard file."""
    problems = {tuple(p) for r in reports for p in r["problems"]}
    missing_on: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        for name in r["missing"]:
            missing_on.setdefault(name, []).append(i)
    shared = False
    for name, ranks in missing_on.items():
        if len(ranks) == len(reports):
            problems.add((0, name, f"{name} is missing"))
            shared |= name.endswith(".distcp")
        else:
            problems.add((0, name, f"{name} is missing on process(es) {', '.join(map(str, ranks))}, though the "
                                   "others see it"))
            shared = True
    if not problems:
        return all(r["verified"] for r in reports), None
    texts = [t for _, _, t in sorted(problems)] + ([SHARED] if shared else [])
    return False, f"checkpoint {path}: " + "; ".join(texts)
