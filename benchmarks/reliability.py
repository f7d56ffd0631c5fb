"""Reliability campaign: kill -9 and resume, damaged checkpoints, reward faults, bad configs, LoRA memory.

    .venv/bin/python benchmarks/reliability.py --json benchmarks/results/reliability.json   # full; writes RELIABILITY.md
    .venv/bin/python benchmarks/reliability.py --quick --json /tmp/rel.json                 # reduced; never writes

Every figure is counted from this run's rows; RELIABILITY.md gets the command, date, machine and git
commit. The training runs are `configs/digits.yaml` shrunk to 4 iterations of 8 samples with an
evaluation after iteration 2 and a checkpoint after every iteration (RUN below).

(a) kill -9: a child process (this script's --child mode, which wraps the trainer's functions without
    changing them) SIGKILLs itself at a random point: the k-th call of the rollout, the rewards, a
    policy-update micro-step or an evaluation, after a random 0-50 ms delay (a timer thread), or right
    before the k-th file write of a checkpoint (every write of save_checkpoint is a point: weights,
    optimizer, RNG, state, manifest, `latest`, the old checkpoint's removal). The run is then resumed
    (`resume=DIR`; started again when it died before its first checkpoint) and its metrics, evaluations
    and final weights (checkpoint, EMA, policy.safetensors) compared bit for bit with an uninterrupted run.
(b) damaged checkpoints: the newest checkpoint of a finished run is truncated, has random bytes of one
    file's tensor data flipped, loses a file, gets a garbage state.json, or loses its manifest.json (so
    nothing can verify it: damaged unless resume_unverified=true); `load_latest_checkpoint` must report
    it (naming the checkpoint and file) and return the previous one; one resume per kind is run to the
    end and compared bit for bit with the uninterrupted run.
(c) reward faults: a reward (`fault` below) that raises, returns NaN, inf, the wrong length, the
    wrong key, not scores, or hangs (reward.timeout=3), from its second call on, under both
    reward.on_error policies, and, in 2 processes (torchrun, gloo), raises or hangs on process 1 only.
    Each run must exit non-zero within its time limit, name the reward, the prompt ids and the seeds,
    and log no row for the failing iteration.
(d) bad configs: hypothesis draws mutations of the digits config (an unknown key at a random depth,
    a wrong type, an out-of-range value, a value outside a key's choices) for the config loader
    (ConfigError naming the key; anything else is a traceback), and a sample through `difrl train` in
    a subprocess (exit 2, the key in the message, no "Traceback").
(e) memory: peak RSS (VmHWM) of a LoRA training run of the tiny FLUX pipeline
    (scripts/make_tiny_pipeline.py flux), against the resident model weights (all modules' tensors),
    the optimizer state + gradients, and the activations saved for backward in one micro-step
    (measured with autograd's saved-tensor hooks), plus the process's RSS after its imports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
DIGITS = ROOT / "configs" / "digits.yaml"
RUN = ["seed=5", "threads=1", "sampler.num_steps=4", "rollout.prompts_per_iter=2", "rollout.group_size=4",
       "train.micro_batch=6", "train.grad_accum=2", "train.iterations=4", "train.ema_decay=0.7", "train.kl_beta=0.1",
       "eval.every=2", "eval.per_digit=3", "eval.num_steps=3", "checkpoint_every=1"]
PHASES = ("rollout", "reward", "update", "checkpoint", "eval")
CHILD_TIMEOUT = 300  # seconds: a child still running then counts as a hang


# ---------------------------------------------------------------------------------- a reward that misbehaves


def fault(kind: str = "none", rank: int | None = None, after: int = 0, seconds: float = 3600.0):
    """Mean brightness, misbehaving on purpose from call number `after` + 1 on, on process `rank` only (RANK,
    None: every process): raise | nan | inf | wrong_length | wrong_key | not_scores | hang (sleeps `seconds`).
    Found as `reliability:fault` with benchmarks/ on PYTHONPATH."""
    calls = [0]

    def fn(images, prompts, metadata):
        calls[0] += 1
        score = images.float().flatten(1).mean(1)
        if calls[0] <= after or (rank is not None and int(os.environ.get("RANK", "0")) != rank):
            return score
        if kind == "raise":
            raise RuntimeError("injected fault: the reward model crashed")
        if kind in ("nan", "inf"):
            return score + float(kind)
        if kind == "wrong_length":
            return score[:-1]
        if kind == "wrong_key":
            return {"not_fault": score}
        if kind == "not_scores":
            return "a string, not scores"
        if kind == "hang":
            time.sleep(seconds)
        return score

    return fn


# ---------------------------------------------------------------------------------- child mode (instrumented run)


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(spec: dict) -> int:
    """Run `difrl <argv>` with its phases counted; SIGKILL at spec["kill"] = {phase, call, delay}; write the
    counts (and the memory figures when spec["memory"]) to spec["report"] on a normal exit."""
    import torch

    import difrl.rewards as rewards
    import difrl.train.flow.trainer as flow
    import difrl.train.run.state as state
    from difrl.cli import main

    counts = dict.fromkeys(PHASES, 0)
    kill = spec.get("kill")
    report = {"rss_after_imports": _vm("VmRSS"), "activations": 0, "diffusers_imported": "diffusers" in sys.modules}

    def hit(phase):
        counts[phase] += 1
        if kill and kill["phase"] == phase and counts[phase] == kill["call"]:
            if kill["delay"] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
            timer = threading.Timer(kill["delay"], os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()

    def wrap(module, name, phase, measure=False):
        inner = getattr(module, name)

        def wrapped(*a, **k):
            hit(phase)
            if not measure:
                return inner(*a, **k)
            report.setdefault("rss_first_update", _vm("VmRSS"))  # libraries and models loaded, rollout done
            # the activations autograd saves for backward in this micro-step, parameters left out
            params = {p.untyped_storage().data_ptr() for p in a[0].module.parameters()}
            saved = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    saved[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = inner(*a, **k)
            report["activations"] = max(report["activations"], sum(saved.values()))
            for key, value in resident_tensors().items():  # while the model and optimizer are alive
                report[key] = max(report.get(key, 0), value)
            return out

        setattr(module, name, wrapped)

    wrap(flow, "rollout", "rollout")
    wrap(rewards, "call_rewards", "reward")
    wrap(flow, "grpo_micro_loss", "update", measure=bool(spec.get("memory")))
    wrap(flow, "evaluate", "eval")
    for name in ("save_safetensors", "save_torch_state", "atomic_write_json", "write_manifest", "atomic_write_text",
                 "_discard"):
        wrap(state, name, "checkpoint")
    rc = main(spec["argv"])
    report["counts"] = counts
    if spec.get("memory"):
        report["peak_rss"] = _vm("VmHWM")
    Path(spec["report"]).write_text(json.dumps(report))
    return rc


def resident_tensors() -> dict:
    """Bytes of every nn.Module's parameters and buffers (unique storages), and of the optimizers' state plus
    one gradient per trainable parameter (the trained LoRA weights)."""
    import gc

    import torch

    weights, trainable, opt_state = {}, 0, {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(recurse=False), *obj.buffers(recurse=False)]:
                weights[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                    trainable += t.numel() * t.element_size()
        elif isinstance(obj, torch.optim.Optimizer):  # accelerate's wrapper shares the state: unique storages
            opt_state.update({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                              for s in obj.state.values() for v in s.values() if torch.is_tensor(v)})
    return {"weights": sum(weights.values()), "trainable": trainable, "optimizer_state": sum(opt_state.values())}


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid` (children, their children, ...), read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we read
            continue
        ppid = int(text[text.rindex(")") + 2:].split()[1])  # "pid (comm) state ppid ...": comm may hold spaces
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant. Killing its process group is not enough: torchrun starts each worker in
    a session of its own (start_new_session), so a SIGKILLed agent, which cannot forward the signal, leaves its
    workers running. The tree is frozen first (SIGSTOP, repeated until no new process appears) because a process
    whose parent dies is re-parented and drops out of the tree."""
    frozen: set[int] = set()
    while new := [p for p in (pid, *descendants(pid)) if p not in frozen]:
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
            frozen.add(p)
    for p in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def spawn(argv: list[str], out: Path, kill: dict | None = None, memory: bool = False, nproc: int = 1,
          timeout: float = CHILD_TIMEOUT, env: dict | None = None) -> dict:
    """Run the trainer (instrumented, 1 process; or torchrun with `nproc`) in a subprocess; returns its exit
    code, output, wall time, whether it hung, and the child's report (None when it was killed or failed)."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / f"report-{time.monotonic_ns()}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    if nproc == 1:
        spec = out / f"spec-{time.monotonic_ns()}.json"
        spec.write_text(json.dumps({"argv": argv, "kill": kill, "memory": memory, "report": str(report)}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "difrl", *argv]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, hung = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        text, hung = proc.communicate()[0], True
    rep = json.loads(report.read_text()) if report.exists() else None
    return {"rc": proc.returncode, "text": text, "seconds": time.perf_counter() - t0, "hung": hung, "report": rep}


# ---------------------------------------------------------------------------------- comparing runs


def run_fingerprint(d: Path) -> dict:
    """What must be bit-identical between a resumed and an uninterrupted run: the metric rows (timings left
    out), the evaluations, the final summary's evaluations, the final checkpoint's weights, EMA and optimizer,
    and policy.safetensors (SHA-256 of the bytes)."""
    from difrl.train.flow.trainer import TIMING_KEYS
    from difrl.train.run.state import checkpoint_dirs

    rows = [{k: v for k, v in json.loads(ln).items() if k not in TIMING_KEYS}
            for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    evals = [{k: v for k, v in e.items() if not k.startswith("seconds")} for e in json.loads((d / "eval.json").read_text())]
    summary = json.loads((d / "summary.json").read_text())
    last = checkpoint_dirs(d / "checkpoints")[0]
    files = {f"{last.name}/{n}": tensor_digest(last / n) for n in ("trainable.safetensors", "ema.safetensors")}
    files["policy.safetensors"] = tensor_digest(d / "policy.safetensors")
    return {"rows": rows, "evals": evals, "after": summary["eval_after"], "before": summary["eval_before"], **files}


def tensor_digest(path: Path) -> str:
    """SHA-256 over a safetensors file's metadata (sorted) and its tensors (name, dtype, shape, bytes, by name).
    Not the file's bytes: safetensors writes the metadata map in a per-process random order."""
    import hashlib

    from difrl.utils.io import load_safetensors_checked

    tensors, meta = load_safetensors_checked(path, "compared weights")
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch_uint8()).numpy().tobytes())
    return h.hexdigest()


def torch_uint8():
    import torch

    return torch.uint8


def differences(a: dict, b: dict) -> list[str]:
    return [k for k in a if a[k] != b.get(k)]


# ---------------------------------------------------------------------------------- (a) kill -9 and resume


def reference_run(work: Path) -> tuple[Path, dict, dict]:
    ref = work / "reference"
    r = spawn(["train", str(DIGITS), *RUN, "--out", str(ref)], work)
    if r["rc"] != 0:
        raise RuntimeError("the uninterrupted reference run failed:\n" + r["text"][-3000:])
    return ref, run_fingerprint(ref), r["report"]["counts"]


def kill_points(counts: dict, n: int, rng: random.Random) -> list[dict]:
    """n points spread over the phases round-robin (shuffled order), each at a random call of its phase."""
    phases = [PHASES[i % len(PHASES)] for i in range(n)]
    rng.shuffle(phases)
    return [{"phase": p, "call": rng.randint(1, counts[p]), "delay": 0.0 if p == "checkpoint" else rng.uniform(0, 0.05)}
            for p in phases]


def kill_campaign(work: Path, ref_print: dict, counts: dict, n: int, seed: int) -> list[dict]:
    rows = []
    for i, point in enumerate(kill_points(counts, n, random.Random(seed))):
        d = work / f"kill-{i:02d}"
        first = spawn(["train", str(DIGITS), *RUN, "--out", str(d)], work, kill=point)
        killed = first["rc"] == -signal.SIGKILL
        has_ckpt = any((d / "checkpoints").glob("iter-*")) if (d / "checkpoints").exists() else False
        resume_args = [f"resume={d}"] if has_ckpt else ["--out", str(d), "--overwrite"]  # died before a checkpoint
        second = spawn(["train", str(DIGITS), *RUN, *resume_args], work)
        same, diff, note = False, [], ""
        if second["rc"] == 0:
            diff = differences(ref_print, run_fingerprint(d))
            same = not diff
        else:
            note = second["text"].strip().splitlines()[-1][:200] if second["text"].strip() else "no output"
        resumed_from = next((ln.split("resumed from ")[1] for ln in second["text"].splitlines() if "resumed from" in ln), "")
        rows.append({"part": "kill", "phase": point["phase"], "call": point["call"], "of": counts[point["phase"]],
                     "delay_ms": round(point["delay"] * 1000, 1), "killed": killed,
                     "resumed_from": resumed_from.split("/")[-1] if resumed_from else ("fresh start" if not has_ckpt else ""),
                     "resume_rc": second["rc"], "bit_identical": same, "differs_in": diff, "note": note,
                     "seconds": round(first["seconds"] + second["seconds"], 1)})
        print(f"kill {i + 1}/{n}: {point['phase']} call {point['call']} +{point['delay'] * 1000:.0f} ms: killed={killed} "
              f"resumed {rows[-1]['resumed_from']!r} bit-identical={same} {diff or ''} {note}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------- (b) damaged checkpoints


def _flip(path: Path, rng: random.Random) -> str:
    import struct

    raw = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0] if path.suffix == ".safetensors" else 0
    n = rng.randint(1, min(64, len(raw) - start))
    lo = rng.randint(start, len(raw) - n)
    raw[lo:lo + n] = bytes(b ^ 0xFF for b in raw[lo:lo + n])
    path.write_bytes(bytes(raw))
    return f"{n} bytes at {lo}"


def damage(ckpt: Path, kind: str, rng: random.Random) -> str:
    """Damage one checkpoint directory in place; returns the file touched and how."""
    files = sorted(f.name for f in ckpt.iterdir() if f.name != "manifest.json")
    if kind == "flipped bytes":
        name = rng.choice([f for f in files if f.endswith(".safetensors")])
        return f"{name}: {_flip(ckpt / name, rng)} inverted"
    if kind == "truncated":
        name = rng.choice(files)
        size = (ckpt / name).stat().st_size
        keep = rng.randint(0, size - 1)
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[:keep])
        return f"{name}: cut to {keep} of {size} bytes"
    if kind == "deleted file":
        name = rng.choice(files)
        (ckpt / name).unlink()
        return f"{name}: deleted"
    if kind == "deleted manifest":
        (ckpt / "manifest.json").unlink()
        return "manifest.json: deleted"
    if kind == "garbage state":
        garbage = rng.choice(['{"iteration": 4', "", "null", '{"iteration": 2}', "\x00" * 32, '{"iteration": "4"}'])
        (ckpt / "state.json").write_text(garbage)
        return f"state.json: {garbage[:20]!r}"
    raise ValueError(kind)


DAMAGES = ("truncated", "flipped bytes", "deleted file", "garbage state", "deleted manifest")


def damage_campaign(work: Path, ref: Path, ref_print: dict, trials: int, seed: int) -> list[dict]:
    from difrl.train.run.state import load_latest_checkpoint

    rng = random.Random(seed)
    rows = []
    for i in range(trials):
        kind = DAMAGES[i % len(DAMAGES)]
        d = work / f"damage-{i:02d}"
        shutil.copytree(ref, d)
        newest = sorted((d / "checkpoints").glob("iter-*"))[-1]
        what = damage(newest, kind, rng)
        said: list[str] = []
        try:
            ckpt = load_latest_checkpoint(d, log=said.append)
            loaded, err = ckpt.path.name, ""
        except Exception as e:  # noqa: BLE001 - counted as not detected / no fall back
            loaded, err = "", f"{type(e).__name__}: {e}"
        touched = what.split(":")[0]
        detected = any(newest.name in s and touched in s for s in said)
        row = {"part": "damage", "kind": kind, "what": what, "detected": detected, "loaded": loaded,
               "fell_back": loaded == sorted((d / "checkpoints").glob("iter-*"))[-2].name, "error": err[:200]}
        if i < len(DAMAGES):  # one full resume per kind: the continued run equals the uninterrupted one
            row["resume"] = resume_after_damage(d, ref, ref_print, newest.name)
        rows.append(row)
        print(f"damage {i + 1}/{trials}: {kind}: {what}: detected={detected} loaded={loaded} "
              f"{row.get('resume', '')}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return rows


def resume_after_damage(d: Path, ref: Path, ref_print: dict, newest: str) -> dict:
    """Resume the damaged run from the previous checkpoint and redo the rest up to the reference's last
    iteration; compare with the reference bit for bit."""
    # the reference's last checkpoint is the end of training: remove what the finished run wrote after it
    for name in ("summary.json", "policy.safetensors"):
        (d / name).unlink(missing_ok=True)
    r = spawn(["train", str(DIGITS), *RUN, f"resume={d}"], d.parent)
    if r["rc"] != 0:
        return {"rc": r["rc"], "bit_identical": False, "note": r["text"].strip().splitlines()[-1][:200]}
    diff = differences(ref_print, run_fingerprint(d))
    return {"rc": 0, "bit_identical": not diff, "differs_in": diff}


# ---------------------------------------------------------------------------------- (c) reward faults


FAULTS = ("raise", "nan", "inf", "wrong_length", "wrong_key", "not_scores", "hang")
FAULT_ARGS = ["seed=5", "threads=1", "sampler.num_steps=3", "rollout.prompts_per_iter=2", "rollout.group_size=4",
              "train.micro_batch=4", "train.grad_accum=2", "train.iterations=3", "eval.every=0", "eval.per_digit=2",
              "eval.num_steps=2", "reward.timeout=3", "reward.weights={\"reliability:fault\": 1.0}",
              "train.updates_per_epoch=null"]  # digits.yaml's 2 updates: 2 processes of 4 samples make 1


def fault_campaign(work: Path, policies: tuple[str, ...], kinds: tuple[str, ...], two_process: tuple[str, ...]) -> list[dict]:
    cases = [(k, p, 1) for p in policies for k in kinds] + [(k, "stop", 2) for k in two_process]
    rows = []
    for kind, policy, nproc in cases:
        d = work / f"fault-{kind}-{policy}-{nproc}"
        options = {"kind": kind, "after": 1, "seconds": 3600}
        if nproc == 2:
            options["rank"] = 1
        # call 1 is iteration 0's rewards (the evaluation uses no reward): the fault starts at iteration 1
        argv = ["train", str(DIGITS), *FAULT_ARGS, f"reward.on_error={policy}",
                "reward.options=" + json.dumps({"reliability:fault": options}), "--out", str(d)]
        r = spawn(argv, work, nproc=nproc, timeout=180 if nproc == 2 else 120)
        text = r["text"]
        logged = [json.loads(ln)["iteration"] for ln in (d / "metrics.jsonl").read_text().splitlines()
                  if ln.strip()] if (d / "metrics.jsonl").exists() else []
        rows.append({"part": "fault", "fault": kind, "on_error": policy, "processes": nproc,
                     "exit_code": r["rc"], "hung": r["hung"], "seconds": round(r["seconds"], 1),
                     "names_reward": "'reliability:fault'" in text, "prompt_ids": "prompt ids [" in text,
                     "seeds": "seeds [" in text, "traceback_only": "Traceback" in text and "error:" not in text,
                     "rows_logged": logged, "scored_failing_iteration": 2 in logged,
                     "checkpoint": (d / "checkpoints" / "iter-000001").is_dir(),
                     "message": next((ln for ln in text.splitlines() if "error:" in ln), "")[:300]})
        row = rows[-1]
        row["ok"] = (row["exit_code"] not in (0, None) and not row["hung"] and row["names_reward"] and row["prompt_ids"]
                     and row["seeds"] and not row["scored_failing_iteration"])
        print(f"fault {kind} ({policy}, {nproc} process(es)): exit {r['rc']} in {r['seconds']:.0f} s, ok={row['ok']}: "
              f"{row['message'][:160]}", flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------- (d) bad configs


def config_leaves():
    """(dotted key, python type, field metadata) for every scalar key of the flow trainer's config."""
    import dataclasses
    import typing

    from difrl.train.config import FlowConfig

    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
                continue
            args = [a for a in typing.get_args(t) if a is not type(None)]
            base = args[0] if args and typing.get_origin(t) in (typing.Union, getattr(__import__("types"), "UnionType")) else t
            if base in (int, float, bool, str):
                out.append((f"{prefix}{f.name}", base, f.metadata))
    walk(FlowConfig, "")
    return out


def bad_config_strategy():
    """hypothesis: (kind, dotted key, override text) for a config mutation that must be refused."""
    from hypothesis import strategies as st

    leaves = config_leaves()
    keys = [k for k, _, _ in leaves]
    sections = sorted({k.rsplit(".", 1)[0] for k in keys if "." in k})
    name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)

    @st.composite
    def mutation(draw):
        kind = draw(st.sampled_from(["unknown key", "wrong type", "out of range", "bad choice"]))
        if kind == "unknown key":
            where = draw(st.sampled_from(["", *[s + "." for s in sections]]))
            key = where + draw(name)
            if key in keys or any(k.startswith(key + ".") for k in keys) or key.rstrip(".") in sections:
                key += "_x"
            return kind, key, f"{key}={draw(st.integers(0, 9))}"
        if kind == "wrong type":
            key, typ, _ = draw(st.sampled_from([leaf for leaf in leaves if leaf[1] is not str]))
            value = draw(st.sampled_from(["[1, 2]", "{a: 1}", "'text'" if typ is not bool else "maybe"]))
            return kind, key, f"{key}={value}"
        if kind == "out of range":
            bounded = [leaf for leaf in leaves if leaf[1] in (int, float) and any(leaf[2].get(m) is not None
                                                                                for m in ("ge", "gt", "le", "lt"))]
            key, typ, meta = draw(st.sampled_from(bounded))
            lows = [meta[m] for m in ("ge", "gt") if meta.get(m) is not None]
            highs = [meta[m] for m in ("le", "lt") if meta.get(m) is not None]
            side = draw(st.sampled_from((["low"] if lows else []) + (["high"] if highs else [])))
            gap = draw(st.integers(1, 1000))
            value = (min(lows) - gap) if side == "low" else (max(highs) + gap)
            if meta.get("gt") is not None and side == "low" and draw(st.booleans()):
                value = meta["gt"]  # the bound itself, excluded by gt
            value = int(value) if typ is int else float(value)
            return kind, key, f"{key}={value}"
        key, _, meta = draw(st.sampled_from([leaf for leaf in leaves if leaf[2].get("choices")]))
        value = draw(name)
        if value in meta["choices"]:
            value += "_x"
        return kind, key, f"{key}={value}"

    return mutation()


def config_campaign(n: int, cli_sample: int, work: Path, seed: int) -> list[dict]:
    from hypothesis import HealthCheck, given, settings

    from difrl.config import ConfigError
    from difrl.train.config import load_flow_config

    rows = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(bad_config_strategy())
    def check(case):
        kind, key, override = case
        try:
            load_flow_config(DIGITS, [override])
            outcome, msg = "accepted", ""
        except ConfigError as e:
            outcome, msg = "ConfigError", str(e)
        except Exception as e:  # noqa: BLE001 - a traceback a user would see
            outcome, msg = f"traceback: {type(e).__name__}", str(e)
        rows.append({"part": "config", "kind": kind, "key": key, "override": override, "outcome": outcome,
                     "names_key": key in msg, "message": msg[:200]})

    check()
    rng = random.Random(seed)
    for row in rng.sample(rows, min(cli_sample, len(rows))):
        r = subprocess.run([sys.executable, "-m", "difrl", "train", str(DIGITS), row["override"], "--out",
                            str(work / "config-cli")], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        row["cli"] = {"rc": r.returncode, "names_key": row["key"] in r.stderr, "traceback": "Traceback" in r.stderr,
                      "wrote_run_dir": (work / "config-cli").exists()}
        shutil.rmtree(work / "config-cli", ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------- (e) memory of tiny FLUX LoRA


def memory_run(work: Path, iterations: int) -> dict:
    pipe = work / "tiny_flux"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_pipeline.py"), "flux", str(pipe)], check=True,
                   capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    r = spawn(["train", str(ROOT / "configs" / "flux_tiny.yaml"), f"model.path={pipe}", f"train.iterations={iterations}",
               "--out", str(work / "flux_run")], work, memory=True)
    if r["rc"] != 0 or r["report"] is None:
        raise RuntimeError("the tiny FLUX run failed:\n" + r["text"][-3000:])
    rep = r["report"]
    grads = rep["trainable"]  # one gradient per trained weight
    total = rep["weights"] + rep["optimizer_state"] + grads + rep["activations"]
    return {"part": "memory", "iterations": iterations, "peak_rss": rep["peak_rss"],
            "rss_after_imports": rep["rss_after_imports"], "weights": rep["weights"], "trainable": rep["trainable"],
            "optimizer_state": rep["optimizer_state"], "gradients": grads, "activations": rep["activations"],
            "model_terms": total, "unexplained": rep["peak_rss"] - rep["rss_after_imports"] - total,
            "diffusers_imported": rep["diffusers_imported"], "rss_first_update": rep["rss_first_update"],
            "seconds": round(r["seconds"], 1)}


# ---------------------------------------------------------------------------------- RELIABILITY.md


def pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100.0 * k / n:.0f}%)" if n else "0/0"


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB" if abs(b) >= 2**20 else f"{b / 1024:.1f} KiB"


def render(rows: list[dict], args, elapsed: float | None = None) -> list[str]:
    """RELIABILITY.md from the campaign's rows. Every number is computed from `rows` (the --json file); the
    sentences around them are fixed text of this function, as the file's preamble says. `elapsed` (seconds)
    is recorded as a "campaign" row when given."""
    sys.path.insert(0, str(HERE))
    from common import command_line, stamp

    if elapsed is not None and not any(r["part"] == "campaign" for r in rows):
        rows.append({"part": "campaign", "wall_minutes": round(elapsed / 60, 1)})
    camp = next((r for r in rows if r["part"] == "campaign"), None)
    lines = ["# Reliability", "", *stamp(command_line("reliability.py", args.argv)), "",
             "Written whole by `benchmarks/reliability.py` (a full run; `--quick` never writes this file). Computed: "
             "every number, count and table row below, from the run's rows (the --json file). Fixed text: the "
             "sentences that describe each part (what was killed, damaged, faulted or mutated, and how it is judged) "
             "and the closing remark of the memory part. No GPU was used"
             + (f"; campaign wall time {camp['wall_minutes']} min on a shared CPU (timings are inflated by other work)."
                if camp else "."), ""]
    kills = [r for r in rows if r["part"] == "kill"]
    if kills:
        resumed = [r for r in kills if r["resumed_from"] != "fresh start"]
        fresh = [r for r in kills if r["resumed_from"] == "fresh start"]
        lines += ["## kill -9 and resume", "",
                  f"`configs/digits.yaml` with `{' '.join(RUN)}`, killed (SIGKILL) at {len(kills)} random points, then "
                  f"resumed with `resume=DIR`, or started again when it died before its first checkpoint (a fresh "
                  f"start, not a resume). Compared with an uninterrupted run: metric rows (timings left out), "
                  f"evaluations, the final checkpoint's weights and EMA, policy.safetensors. "
                  f"**{pct(sum(r['bit_identical'] for r in resumed), len(resumed))} of the runs that resumed from a "
                  f"checkpoint bit-identical**; {pct(sum(r['bit_identical'] for r in fresh), len(fresh))} of the "
                  f"{len(fresh)} fresh starts too; {sum(r['killed'] for r in kills)} of the {len(kills)} children died "
                  "by the signal. A point is the k-th call of its phase in the run (of the calls the uninterrupted run "
                  "made); checkpoint points are file writes of save_checkpoint, killed right before that write.", "",
                  "| phase | points | calls killed at (of) | killed | bit-identical | resumed from |",
                  "|---|---:|---|---:|---:|---|"]
        for p in PHASES:
            sub = [r for r in kills if r["phase"] == p]
            if sub:
                resumed = sorted({(r["resumed_from"] or "?").split(" after")[0] for r in sub})
                lines.append(f"| {p} | {len(sub)} | {', '.join(str(c) for c in sorted(r['call'] for r in sub))} "
                             f"({sub[0]['of']}) | {sum(r['killed'] for r in sub)} | {sum(r['bit_identical'] for r in sub)} | "
                             f"{', '.join(resumed)} |")
        bad = [r for r in kills if not r["bit_identical"]]
        lines += [""] + [f"- not identical: {r['phase']} call {r['call']}: {r['differs_in'] or r['note']}" for r in bad]
        lines += ([""] if bad else [])
    dam = [r for r in rows if r["part"] == "damage"]
    if dam:
        res = [r["resume"] for r in dam if "resume" in r]
        lines += ["## Damaged checkpoints", "",
                  f"The newest of a finished run's two checkpoints damaged {len(dam)} times at random (kind in turn; "
                  f"file, offset, length drawn): **{pct(sum(r['detected'] for r in dam), len(dam))} detected** (a message naming the "
                  f"checkpoint and the file), **{pct(sum(r['fell_back'] for r in dam), len(dam))} loaded the previous "
                  f"intact checkpoint**; resumed to the end once per kind: {pct(sum(r['bit_identical'] for r in res), len(res))} "
                  "bit-identical to the uninterrupted run.", "",
                  "| damage | trials | detected | previous used |", "|---|---:|---:|---:|"]
        for k in DAMAGES:
            sub = [r for r in dam if r["kind"] == k]
            if sub:
                lines.append(f"| {k} | {len(sub)} | {sum(r['detected'] for r in sub)} | {sum(r['fell_back'] for r in sub)} |")
        missing = [k for k in DAMAGES if not any(r["kind"] == k for r in dam)]
        lines += ["", f"Damage kinds of the campaign that this run did not try: {', '.join(missing)}."] if missing else []
        lines.append("")
    flt = [r for r in rows if r["part"] == "fault"]
    if flt:
        lines += ["## Reward faults", "",
                  f"A reward failing from iteration 1 on (`reliability:fault`, reward.timeout=3 s; with 2 processes "
                  f"on process 1 only): **{pct(sum(r['ok'] for r in flt), len(flt))} stopped non-zero, named the "
                  f"reward, the prompt ids and the seeds in their output, and logged no row for the failing "
                  f"iteration**; hangs (no exit within 120 s, 180 s with 2 processes): "
                  f"{sum(r['hung'] for r in flt)}; failing iterations scored: {sum(r['scored_failing_iteration'] for r in flt)}.", "",
                  "| fault | reward.on_error | processes | exit | seconds | prompt ids + seeds | rows logged | ok |",
                  "|---|---|---:|---:|---:|---|---|---|"]
        for r in flt:
            lines.append(f"| {r['fault']}{' (process 1 only)' if r['processes'] == 2 else ''} | {r['on_error']} | "
                         f"{r['processes']} | {r['exit_code']} | {r['seconds']} | {r['prompt_ids'] and r['seeds']} | "
                         f"{r['rows_logged']} | {r['ok']} |")
        lines.append("")
    cfg = [r for r in rows if r["part"] == "config"]
    if cfg:
        clear = sum(r["outcome"] == "ConfigError" and r["names_key"] for r in cfg)
        tb = sum(r["outcome"].startswith("traceback") for r in cfg)
        acc = sum(r["outcome"] == "accepted" for r in cfg)
        cli = [r["cli"] for r in cfg if "cli" in r]
        lines += ["## Bad configs", "",
                  f"{len(cfg)} mutations of `configs/digits.yaml` drawn by hypothesis (derandomized) through the flow "
                  f"trainer's config loader: **{pct(clear, len(cfg))} a ConfigError naming the key**, {tb} other "
                  f"exceptions (tracebacks), {acc} accepted. Through `difrl train` in a subprocess, {len(cli)} of them: "
                  f"{pct(sum(c['rc'] == 2 and c['names_key'] and not c['traceback'] for c in cli), len(cli))} exit 2 "
                  f"with the key named and no traceback; run directory written: {sum(c['wrote_run_dir'] for c in cli)}.", "",
                  "| mutation | drawn | clear error naming the key |", "|---|---:|---:|"]
        for k in ("unknown key", "wrong type", "out of range", "bad choice"):
            sub = [r for r in cfg if r["kind"] == k]
            lines.append(f"| {k} | {len(sub)} | {sum(r['outcome'] == 'ConfigError' and r['names_key'] for r in sub)} |")
        odd = [r for r in cfg if not (r["outcome"] == "ConfigError" and r["names_key"])]
        lines += [""] + [f"- `{r['override']}`: {r['outcome']}: {r['message'][:150]}" for r in odd[:10]]
        lines += ([""] if odd else [])
    mem = [r for r in rows if r["part"] == "memory"]
    for m in mem:
        lines += ["## Memory of a LoRA training run (tiny FLUX)", "",
                  f"`configs/flux_tiny.yaml` ({m['iterations']} iteration(s), LoRA rank 4, 1 process, CPU) on the pipeline "
                  "of `scripts/make_tiny_pipeline.py flux`. Peak RSS is the process's VmHWM; the model terms are "
                  "measured in the process (unique tensor storages of every module; AdamW state; one gradient per "
                  "trained weight; the largest set of activations autograd saved in one micro-step).", "",
                  "| term | bytes |", "|---|---:|",
                  f"| peak RSS (VmHWM) | {mib(m['peak_rss'])} |", f"| RSS after imports (Python, torch, difrl{', diffusers' if m['diffusers_imported'] else ''}) | {mib(m['rss_after_imports'])} |",
                  f"| RSS when the first policy-update micro-step starts (models loaded, rollout done) | "
                  f"{mib(m['rss_first_update'])} |",
                  f"| weights (all modules) | {mib(m['weights'])} |", f"| trained LoRA weights | {mib(m['trainable'])} |",
                  f"| optimizer state (AdamW) | {mib(m['optimizer_state'])} |", f"| gradients | {mib(m['gradients'])} |",
                  f"| activations saved for backward (one micro-step) | {mib(m['activations'])} |",
                  f"| weights + optimizer + gradients + activations | {mib(m['model_terms'])} |",
                  f"| peak - after imports - model terms | {mib(m['unexplained'])} |", "",
                  f"The model terms are {100.0 * m['model_terms'] / m['peak_rss']:.1f}% of the peak; "
                  f"{100.0 * m['rss_after_imports'] / m['peak_rss']:.0f}% is resident right after the imports and "
                  f"{100.0 * m['rss_first_update'] / m['peak_rss']:.0f}% when the first update starts (libraries "
                  "imported lazily, e.g. diffusers and transformers, the models, the rollout); the peak adds "
                  f"{mib(m['peak_rss'] - m['rss_first_update'])} after that. On this tiny model the process's memory "
                  "is almost all libraries and allocator slack: the figure is difrl's and its libraries' overhead, "
                  "not what a real-size model needs (none was run).", ""]
    return lines


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> list[dict]:
    sys.path.insert(0, str(HERE))
    from common import standard_args, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "5 kill points, 5 damaged checkpoints, 4 reward faults, 30 configs, no memory run")
    ap.add_argument("--kills", type=int, help="kill points (default 20; --quick 5)")
    ap.add_argument("--damages", type=int, help="damaged checkpoints (default 40; --quick 5: one per kind)")
    ap.add_argument("--configs", type=int, help="generated bad configs (default 200; --quick 30)")
    ap.add_argument("--cli-configs", type=int, help="of those, through `difrl train` (default 10; --quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="kill,damage,fault,config,memory", help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=ROOT / "RELIABILITY.md")
    args = ap.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    parts = set(args.parts.split(","))
    for name, full, quick in (("kills", 20, 5), ("damages", 40, 5), ("configs", 200, 30), ("cli_configs", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    t0 = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="difrl-reliability-") as tmp:
        work = Path(tmp)
        if parts & {"kill", "damage"}:
            ref, ref_print, counts = reference_run(work)
            print(f"reference run: phase calls {counts}", flush=True)
            if "kill" in parts:
                rows += kill_campaign(work, ref_print, counts, args.kills, args.seed)
            if "damage" in parts:
                rows += damage_campaign(work, ref, ref_print, args.damages, args.seed)
        if "fault" in parts:
            if args.quick:
                rows += fault_campaign(work, ("stop",), ("raise", "wrong_key", "hang"), ("raise",))
            else:
                rows += fault_campaign(work, ("stop", "drop_group"), FAULTS, ("raise", "hang"))
        if "config" in parts:
            rows += config_campaign(args.configs, args.cli_configs, work, args.seed)
        if "memory" in parts and not args.quick:
            rows.append(memory_run(work, 1))
    lines = render(rows, args, time.perf_counter() - t0)  # adds the "campaign" row (wall time)
    print("\n".join(lines))
    write_json(args.json, rows)
    if not args.no_write:
        args.out.write_text("\n".join(lines).rstrip() + "\n")
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child(json.loads(Path(sys.argv[2]).read_text())))
    main()
