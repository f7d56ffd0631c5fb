"""Remote reward server: correctness under 100 concurrent clients, and remote vs in-process scoring speed.

    .venv/bin/python benchmarks/bench_reward_server.py --json benchmarks/results/bench_reward_server.json  # ~2 min, 2 cores
    .venv/bin/python benchmarks/bench_reward_server.py --quick --json /tmp/brs_quick.json                 # ~35 s, no write

One real server process (`difrl reward-server`, loopback, `--port 0`, default limits: 64 requests in
flight, 5 ms batching wait) serves the tiny `clip_score` (difrl.rewards.tiny: a random ~0.85 M parameter
CLIP in the real save_pretrained layout) and `brightness`. The images are 512² smooth colour fields
with mild noise (bicubic upsampling of 16² noise plus N(0, 0.01²); PNG/JPEG sizes depend on content,
uniform noise would be their worst case). The tiny CLIP resizes them to 32 px, so its model costs almost
nothing: what is measured is the transfer, encoding/decoding and preprocessing of 512² images (what a
server adds), not a real reward model; `brightness` (one mean per image) is pure transport overhead.

Fixed cost: GET /v1/health on a kept-alive connection vs as the first request of a fresh connection, and a
1-item 8² score request (client latency vs the server's own `timing_ms`), p50 of 20.

Part A (correctness under load): `--clients` concurrent clients (threads, each with its own httpx client,
all released together by a barrier), client c using encoding raw / raw32 / png / jpeg by c mod 4, send
`--requests` requests of `--a-batch` images each with unique request and item ids (raw httpx +
`wire.pack_request`, so the benchmark controls the ids; a 503 "busy" answer is retried after its
Retry-After). Checked: every request gets one 200 answer with its own request id; every item id comes
back exactly once across all answers (lost / duplicated / foreign ids counted); every score equals,
within 1e-5, the in-process score of the same reward on the pixels the server decodes (uint8-rounded
for raw and png, the float32 samples for raw32, the JPEG-decoded pixels for jpeg); the server's own
`served` counter grew by exactly the number of answered requests and nothing is left in flight.
Exact equality is also counted: CPU kernels give results that depend on the batch they are computed in
(up to ~1e-7 here), and the server batches items of concurrent requests together.

Part B (throughput and latency): per reward and repeat, the in-process baseline (the same reward built
in this process scoring the same float images in the same `--batch`-image calls, one after another)
and then, in a rotated order, each encoding with `--b-clients` concurrent `remote` reward clients
(`build_reward("remote", ...)`, what a trainer uses; built and warmed up before timing) plus raw with one
client (a single trainer's view), each run sending `--b-requests` requests in all. Reported: images per
second overall (wall clock from the barrier to the last answer; mean ± sample std over repeats), p50 / p99
request latency over all repeats (nearest rank), bytes per image on the wire, client-side encoding ms
per image and the server's own `timing_ms` per request (body read, decode, queueing and scoring), and
the ratio remote / in-process images/s computed per repeat against that repeat's baseline. A "faster" /
"slower" sentence is only written when the min-max ranges over repeats do not overlap (or, for the
ratio, lie on one side of 1). Client and server share the machine's cores, so the client's encoding
competes with the server's decoding and scoring; the loopback run measures no network.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish, sample_std, standard_args  # noqa: E402

from difrl.rewards import build_reward  # noqa: E402
from difrl.rewards.wire import ENCODINGS, decode_sample, encode_sample, pack_request, unpack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_reward_server:start -->", "<!-- bench_reward_server:end -->"
SIZE = 512
TOL = 1e-5
PROMPTS = ["a photo of a cat", "a red car on a street", "a bowl of fruit", "a mountain lake at dawn"]
REWARDS = ("clip_score", "brightness")


# ------------------------------------------------------------------------------- inputs and the server


def image_pool(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 3, 512, 512] in [0, 1]: smooth colour fields (bicubic 16² -> 512²) with N(0, 0.01²) noise."""
    g = torch.Generator().manual_seed(seed)
    x = F.interpolate(torch.rand(n, 3, 16, 16, generator=g), size=(SIZE, SIZE), mode="bicubic", align_corners=False)
    return (x + 0.01 * torch.randn(x.shape, generator=g)).clamp(0, 1)


def server_pixels(pool: torch.Tensor, encoding: str) -> torch.Tensor:
    """What the server scores for `encoding`: the wire's own encode then decode of every image."""
    return torch.stack([decode_sample(encode_sample(x, encoding)) for x in pool])


class Server:
    """`difrl reward-server` as a subprocess on a free loopback port; always killed by close()."""

    def __init__(self, rewards: list[str], options: dict, startup_s: float = 180.0):
        exe = Path(sys.executable).with_name("difrl")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "difrl.cli"]
        cmd += ["reward-server", "--reward", ",".join(rewards), "--options-json", json.dumps(options), "--port", "0"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log: deque[str] = deque(maxlen=200)
        self.url: str | None = None
        self._bound = threading.Event()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     cwd=str(ROOT))
        threading.Thread(target=self._drain, daemon=True).start()  # reads stderr to the end (a full pipe would block it)
        try:
            if not self._bound.wait(startup_s) or self.url is None:
                raise RuntimeError(f"the reward server did not start within {startup_s} s (exit code "
                                   f"{self.proc.poll()}): {' | '.join(self.log)}")
            self._wait_healthy(30.0)
        except BaseException:
            self.close()
            raise

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            m = re.search(r" on (http://[^\s]+:\d+)", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._bound.set()
        self._bound.set()  # the process ended (before binding, if url is still None)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        end = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/v1/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError(f"the reward server at {self.url} is not healthy: {' | '.join(self.log)}")
            time.sleep(0.1)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/v1/health", timeout=30.0).json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def run_threads(n: int, target) -> float:
    """Run target(i, barrier) in n threads released together; the wall seconds from the release to the last end."""
    barrier = threading.Barrier(n + 1)
    threads = [threading.Thread(target=target, args=(i, barrier)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------- fixed cost per request


def round_trips(server: Server, n: int) -> dict:
    """Latency of requests that carry (almost) nothing: GET /v1/health on one kept-alive connection, the same as
    the first request of a fresh connection, and a 1-item 8² `brightness` score request (client vs the server's
    own timing_ms)."""
    import httpx

    url, out = server.url, {"part": "RTT", "samples": n}
    with httpx.Client() as http:
        http.get(url + "/v1/health")
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            http.get(url + "/v1/health")
            lat.append((time.perf_counter() - t) * 1000)
        out["health_keepalive_p50_ms"] = round(percentile(lat, 50), 2)
        body = pack_request("rtt", "brightness", torch.rand(1, 3, 8, 8), ["x"], [{}])
        http.post(url + "/v1/score", content=body, headers={"Content-Type": "application/msgpack"})
        lat, srv = [], []
        for _ in range(n):
            t = time.perf_counter()
            r = http.post(url + "/v1/score", content=body, headers={"Content-Type": "application/msgpack"})
            lat.append((time.perf_counter() - t) * 1000)
            srv.append(unpack(r.content)["timing_ms"])
        out["tiny_score_keepalive_p50_ms"] = round(percentile(lat, 50), 2)
        out["tiny_score_server_p50_ms"] = round(percentile(srv, 50), 2)
    lat = []
    for _ in range(n):
        with httpx.Client() as http:
            t = time.perf_counter()
            http.get(url + "/v1/health")
            lat.append((time.perf_counter() - t) * 1000)
    out["health_fresh_connection_p50_ms"] = round(percentile(lat, 50), 2)
    print(out, flush=True)
    return out


# ------------------------------------------------------------------------------- part A: correctness


def correctness(server: Server, pool: torch.Tensor, refs: dict[str, torch.Tensor], clients: int, requests: int,
                batch: int) -> list[dict]:
    import httpx

    n_pool, url = len(pool), server.url
    sent: dict[str, list[str]] = {e: [] for e in ENCODINGS}  # item ids sent, per encoding
    got: dict[str, Counter] = {e: Counter() for e in ENCODINGS}  # item ids answered
    per_req: list[dict] = []
    lock = threading.Lock()
    before = server.health()

    def client(c: int, barrier: threading.Barrier) -> None:
        enc = ENCODINGS[c % len(ENCODINGS)]
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=30.0)) as http:
            barrier.wait()
            for r in range(requests):
                rid = f"c{c:03d}-r{r}"
                idx = [((c * requests + r) * batch + k) % n_pool for k in range(batch)]
                ids = [f"{rid}-i{k}" for k in range(batch)]
                rec = {"encoding": enc, "request_id": rid, "attempts": 0, "busy": 0, "answered": False,
                       "wrong_request_id": False, "errors": 0, "diffs": [], "exact": 0, "problem": None}
                with lock:
                    sent[enc].extend(ids)
                try:
                    body = pack_request(rid, "clip_score", pool[idx], [PROMPTS[i % len(PROMPTS)] for i in idx],
                                        [{} for _ in idx], ids, enc)
                    t0 = time.perf_counter()
                    while True:
                        resp = http.post(url + "/v1/score", content=body, headers={"Content-Type": "application/msgpack"})
                        rec["attempts"] += 1
                        if resp.status_code == 503 and rec["attempts"] < 300:
                            rec["busy"] += 1
                            time.sleep(float(resp.headers.get("retry-after", "1")))
                            continue
                        break
                    rec["latency_ms"] = (time.perf_counter() - t0) * 1000
                    if resp.status_code != 200:
                        rec["problem"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    else:
                        out = unpack(resp.content)
                        rec["answered"] = True
                        rec["wrong_request_id"] = out.get("request_id") != rid
                        rec["server_ms"] = out.get("timing_ms")
                        by_id = {}
                        for res in out.get("results", []):
                            with lock:
                                got[enc][res.get("id")] += 1
                            by_id[res.get("id")] = res
                        for i, item_id in zip(idx, ids):
                            res = by_id.get(item_id)
                            if res is None:
                                continue
                            if res.get("status") != "ok":
                                rec["errors"] += 1
                                continue
                            s, ref = res["scores"]["clip_score"], float(refs[enc][i])
                            rec["diffs"].append(abs(s - ref))
                            rec["exact"] += s == ref
                except Exception as e:  # a transport failure is a lost request, not a crash of the benchmark
                    rec["problem"] = f"{type(e).__name__}: {e}"
                with lock:
                    per_req.append(rec)

    wall = run_threads(clients, client)
    after = server.health()
    rows = []
    for enc in (*ENCODINGS, "all"):
        recs = [r for r in per_req if enc in ("all", r["encoding"])]
        sent_ids = [i for e in ENCODINGS if enc in ("all", e) for i in sent[e]]
        counts = sum((got[e] for e in ENCODINGS if enc in ("all", e)), Counter())
        diffs = [d for r in recs for d in r["diffs"]]
        lat = [r["latency_ms"] for r in recs if "latency_ms" in r]
        row = {"part": "A", "encoding": enc, "clients": clients if enc == "all" else
               len({r["request_id"].split("-")[0] for r in recs}), "batch": batch,
               "requests": len(recs), "http_attempts": sum(r["attempts"] for r in recs),
               "busy_503": sum(r["busy"] for r in recs), "answered": sum(r["answered"] for r in recs),
               "wrong_request_id": sum(r["wrong_request_id"] for r in recs),
               "lost_requests": sum(not r["answered"] for r in recs),
               "items": len(sent_ids), "items_answered": sum(counts[i] > 0 for i in sent_ids),
               "items_lost": sum(counts[i] == 0 for i in sent_ids),
               "items_duplicated": sum(counts[i] > 1 for i in sent_ids),
               "items_foreign": sum(v for k, v in counts.items() if k not in set(sent_ids)),
               "item_errors": sum(r["errors"] for r in recs),
               "scores_checked": len(diffs), "scores_mismatched": sum(d > TOL for d in diffs),
               "scores_exact": sum(r["exact"] for r in recs), "max_abs_diff": max(diffs, default=float("nan")),
               "p50_ms": round(percentile(lat, 50), 1) if lat else None,
               "p99_ms": round(percentile(lat, 99), 1) if lat else None,
               "problems": [r["problem"] for r in recs if r["problem"]][:5]}
        if enc == "all":
            row.update(wall_s=round(wall, 2), served_delta=after["served"] - before["served"],
                       in_flight_after=after["in_flight"])
        rows.append(row)
        print({k: v for k, v in row.items() if k != "problems"} | ({"problems": row["problems"]} if row["problems"] else {}),
              flush=True)
    return rows


# ------------------------------------------------------------------------------- part B: throughput


def wire_costs(pool: torch.Tensor) -> dict[str, dict]:
    """Per encoding: bytes per image in a request body, and client encode / server decode ms per image (one thread
    of this process; the server runs the same decode)."""
    out = {}
    n = len(pool)
    for enc in ENCODINGS:
        t0 = time.perf_counter()
        body = pack_request("x", "clip_score", pool, [PROMPTS[i % 4] for i in range(n)], [{} for _ in range(n)],
                            encoding=enc)
        t1 = time.perf_counter()
        for it in unpack(body)["items"]:
            decode_sample(it["sample"])
        t2 = time.perf_counter()
        out[enc] = {"bytes_per_image": len(body) / n, "encode_ms": (t1 - t0) * 1000 / n, "decode_ms": (t2 - t1) * 1000 / n}
    return out


def batches(pool: torch.Tensor, n_requests: int, batch: int) -> list[tuple[torch.Tensor, list[str], list[int]]]:
    out = []
    for r in range(n_requests):
        idx = [(r * batch + k) % len(pool) for k in range(batch)]
        out.append((pool[idx], [PROMPTS[i % len(PROMPTS)] for i in idx], idx))
    return out


def in_process_run(reward, work) -> dict:
    lat = []
    t0 = time.perf_counter()
    for x, prompts, _ in work:
        t = time.perf_counter()
        reward(x, prompts, [{} for _ in prompts])
        lat.append((time.perf_counter() - t) * 1000)
    wall = time.perf_counter() - t0
    return {"images_per_s": sum(len(p) for _, p, _ in work) / wall, "lat": lat, "server_ms": [], "mismatched": 0}


def remote_run(clients: list, work, refs: torch.Tensor) -> dict:
    """len(clients) threads share the requests of `work` round robin; each returns its latencies and scores."""
    lat, server_ms, mismatched = [], [], [0]
    lock = threading.Lock()
    errors = []

    def client(c: int, barrier: threading.Barrier) -> None:
        reward = clients[c][0]
        mine = work[c::len(clients)]
        barrier.wait()
        for x, prompts, idx in mine:
            t = time.perf_counter()
            try:
                out = reward(x, prompts, [{} for _ in prompts])["remote"]  # a `remote` reward files its score there
            except Exception as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            dt = (time.perf_counter() - t) * 1000
            bad = int(((out - refs[idx]).abs() > TOL).sum())
            with lock:
                lat.append(dt)
                mismatched[0] += bad
    for _, log in clients:
        log.clear()
    wall = run_threads(len(clients), client)
    if errors:
        raise RuntimeError(f"{len(errors)} remote calls failed, e.g. {errors[0]}")
    for _, log in clients:
        server_ms.extend(log)
    return {"images_per_s": sum(len(p) for _, p, _ in work) / wall, "lat": lat, "server_ms": server_ms,
            "mismatched": mismatched[0]}


def remote_client(url: str, reward: str, encoding: str):
    """A `remote` reward as a trainer builds it, with the server's timing_ms of each answer recorded in `log`."""
    r = build_reward("remote", url=url, reward=reward, encoding=encoding)
    inner, log = r.fn, []
    request = inner._request

    def recording(method, path, body=None, what=""):
        resp = request(method, path, body, what)
        if path == "/v1/score":
            log.append(float(resp["timing_ms"]))
        return resp

    inner._request = recording
    return r, log


def throughput(server: Server, options: dict, pool: torch.Tensor, refs: dict, args) -> list[dict]:
    work = batches(pool, args.b_requests, args.batch)
    configs = [(enc, args.b_clients) for enc in ENCODINGS] + [("raw", 1)]
    costs = wire_costs(pool[: min(len(pool), 16)])
    rows = []
    for name in REWARDS:
        local = build_reward(name, **options.get(name, {}))
        clients = {cfg: [remote_client(server.url, name, cfg[0]) for _ in range(cfg[1])] for cfg in configs}
        for cfg, cl in clients.items():  # warm-up: connections, the server's text cache, first-call costs
            remote_run(cl, work[: len(cl)], refs[name][cfg[0]])
        in_process_run(local, work[:1])
        runs: dict = {"in-process": []} | {cfg: [] for cfg in configs}
        for rep in range(args.repeats):
            runs["in-process"].append(in_process_run(local, work))
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]  # rotate against drift
            for cfg in order:
                runs[cfg].append(remote_run(clients[cfg], work, refs[name][cfg[0]]))
            print(f"{name} repeat {rep}: " + ", ".join(
                f"{k if isinstance(k, str) else f'{k[0]}x{k[1]}'} {v[-1]['images_per_s']:.1f}/s" for k, v in runs.items()),
                flush=True)
        base = [r["images_per_s"] for r in runs["in-process"]]
        for cfg, rs in runs.items():
            rates = [r["images_per_s"] for r in rs]
            lat = [x for r in rs for x in r["lat"]]
            srv = [x for r in rs for x in r["server_ms"]]
            ratios = [a / b for a, b in zip(rates, base)]
            enc, n_cl = ("in-process", 1) if cfg == "in-process" else cfg
            row = {"part": "B", "reward": name, "scoring": "in-process" if cfg == "in-process" else "remote",
                   "encoding": enc, "clients": n_cl, "batch": args.batch, "requests": args.b_requests,
                   "repeats": args.repeats, "images_per_s": round(statistics.mean(rates), 2),
                   "images_per_s_std": round(sample_std(rates), 2), "images_per_s_min": round(min(rates), 2),
                   "images_per_s_max": round(max(rates), 2), "latency_samples": len(lat),
                   "p50_ms": round(percentile(lat, 50), 1), "p99_ms": round(percentile(lat, 99), 1),
                   "server_ms_p50": round(percentile(srv, 50), 1) if srv else None,
                   "bytes_per_image": None if cfg == "in-process" else round(costs[enc]["bytes_per_image"]),
                   "encode_ms_per_image": None if cfg == "in-process" else round(costs[enc]["encode_ms"], 2),
                   "decode_ms_per_image": None if cfg == "in-process" else round(costs[enc]["decode_ms"], 2),
                   "scores_mismatched": sum(r["mismatched"] for r in rs),
                   "ratio_mean": round(statistics.mean(ratios), 3), "ratio_min": round(min(ratios), 3),
                   "ratio_max": round(max(ratios), 3)}
            rows.append(row)
            print(row, flush=True)
        for cl in clients.values():
            for r, _ in cl:
                r.fn.close()
    return rows


# ------------------------------------------------------------------------------- report


def fmt_bytes(b: float) -> str:
    return f"{b / 1024:.0f} KiB" if b < 1 << 20 else f"{b / (1 << 20):.2f} MiB"


def label(r: dict) -> str:
    return "in-process" if r["scoring"] == "in-process" else f"remote {r['encoding']} × {r['clients']}"


def compare(a: dict, b: dict) -> str:
    """Faster / slower only when the min-max ranges over repeats do not overlap."""
    ra, rb = f"{a['images_per_s_min']:.1f}-{a['images_per_s_max']:.1f}", f"{b['images_per_s_min']:.1f}-{b['images_per_s_max']:.1f}"
    if a["images_per_s_min"] > b["images_per_s_max"]:
        return f"{label(a)} is faster than {label(b)} ({ra} vs {rb} images/s over repeats)"
    if a["images_per_s_max"] < b["images_per_s_min"]:
        return f"{label(a)} is slower than {label(b)} ({ra} vs {rb} images/s over repeats)"
    return f"no clear difference between {label(a)} and {label(b)} ({ra} vs {rb} images/s over repeats overlap)"


def ratio_sentence(r: dict) -> str:
    spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    if r["ratio_max"] < 1:
        return f"{label(r)} is slower than in-process (remote / in-process {r['ratio_mean']:.2f}, every repeat {spread})"
    if r["ratio_min"] > 1:
        return f"{label(r)} is faster than in-process (remote / in-process {r['ratio_mean']:.2f}, every repeat {spread})"
    return f"{label(r)}: no clear difference from in-process (ratios {spread} straddle 1)"


def report(rtt: dict, a_rows: list[dict], b_rows: list[dict], args, jpeg_shift: float, min_gap: float) -> list[dict]:
    total = a_rows[-1]
    ok = (total["lost_requests"] == 0 and total["items_lost"] == 0 and total["items_duplicated"] == 0
          and total["items_foreign"] == 0 and total["wrong_request_id"] == 0 and total["item_errors"] == 0
          and total["scores_mismatched"] == 0 and total["served_delta"] == total["answered"]
          and total["in_flight_after"] == 0 and total["answered"] == total["requests"])
    lines = [f"One `difrl reward-server` process on loopback (default limits: 64 requests in flight, 5 ms batching "
             f"wait) serving the tiny `clip_score` (random ~0.85 M-parameter CLIP in the real file layout; it resizes "
             f"to 32 px, so the model costs almost nothing and the numbers are transfer, encode/decode and "
             f"preprocessing of {SIZE}² images) and `brightness` (pure transport). Images: smooth colour fields with "
             f"mild noise (PNG/JPEG sizes depend on content). Client threads and the server share this machine's cores.",
             "",
             f"Fixed cost per request (p50 of {rtt['samples']}): GET /v1/health {rtt['health_keepalive_p50_ms']:.1f} ms on a "
             f"kept-alive connection, {rtt['health_fresh_connection_p50_ms']:.1f} ms as the first request of a fresh one; "
             f"a 1-item 8² `brightness` score request {rtt['tiny_score_keepalive_p50_ms']:.1f} ms at the client, of which "
             f"{rtt['tiny_score_server_p50_ms']:.1f} ms inside the server's handler (`timing_ms`). The `remote` client keeps "
             "its connection alive.",
             "",
             f"Part A, correctness: {total['clients']} concurrent clients (encoding by client: raw / raw32 / png / jpeg), "
             f"{args.requests} requests of {args.a_batch} images each, unique ids; a score is \"off\" when it differs by "
             f"more than {TOL:g} from the in-process score of the same pixels (those the encoding delivers).", "",
             "| encoding | clients | requests | HTTP attempts (503 busy) | answered | lost requests | items lost / "
             "duplicated / foreign | scores off | exactly equal | max abs diff | latency p50 / p99 ms (retries included) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in a_rows:
        lines.append(f"| {r['encoding']} | {r['clients']} | {r['requests']} | {r['http_attempts']} ({r['busy_503']}) | "
                     f"{r['answered']} | {r['lost_requests']} | {r['items_lost']} / {r['items_duplicated']} / "
                     f"{r['items_foreign']} | {r['scores_mismatched']} / {r['scores_checked']} | "
                     f"{r['scores_exact']} / {r['scores_checked']} | {r['max_abs_diff']:.2g} | "
                     f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} |")
    busy = (f"{total['busy_503']} answers were 503 busy (more clients than the 64-request limit) and were retried "
            "after Retry-After; " if total["busy_503"] else "no request was refused as busy; ")
    if ok:
        lines += ["", f"- Part A: {busy}every one of the {total['requests']} requests was answered exactly once "
                  f"(the server's own `served` count grew by {total['served_delta']}, none left in flight), each of "
                  f"the {total['items']} item ids came back exactly once, and no score was lost, duplicated or off "
                  f"(max abs diff {total['max_abs_diff']:.2g}; {total['scores_exact']} of {total['scores_checked']} "
                  f"exactly equal, the rest differ only by batch-dependent CPU rounding; the smallest gap between "
                  f"two different images' scores is {min_gap:.2g}, so a swapped score would show). "
                  f"{total['wall_s']:.1f} s wall for all of them."]
    else:
        lines += ["", f"- Part A FAILED: {total['lost_requests']} requests lost, {total['items_lost']} items lost, "
                  f"{total['items_duplicated']} duplicated, {total['items_foreign']} foreign, "
                  f"{total['scores_mismatched']} scores off, {total['item_errors']} item errors, served count "
                  f"{total['served_delta']} for {total['answered']} answered, {total['in_flight_after']} left in flight; "
                  f"e.g. {total['problems'][:2]}"]
    lines += ["", f"Part B, throughput: {args.b_requests} requests of {args.batch} {SIZE}² images per run, "
              f"{args.repeats} repeats (encodings in rotated order); images/s mean ± sample std (n - 1) over the n={args.repeats} repeats; latency "
              f"percentiles (nearest rank) over all {args.b_requests * args.repeats} requests of the repeats; server ms: "
              "the server's own `timing_ms` (body read, decode, queueing, scoring), median; encode / decode ms per "
              "image measured single-threaded in this process. Ratio: remote / in-process images/s per repeat, "
              "mean (min-max).", "",
              "| reward | scoring | bytes/image | encode / decode ms/image | images/s | latency p50 / p99 ms | "
              "server ms p50 | remote / in-process | scores off |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in b_rows:
        remote = r["scoring"] == "remote"
        wire = f"{fmt_bytes(r['bytes_per_image'])}" if remote else "-"
        codec = f"{r['encode_ms_per_image']:.1f} / {r['decode_ms_per_image']:.1f}" if remote else "-"
        ratio = f"{r['ratio_mean']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})" if remote else "1"
        lines.append(f"| {r['reward']} | {label(r)} | {wire} | {codec} | {r['images_per_s']:.1f} ± "
                     f"{r['images_per_s_std']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
                     f"{r['server_ms_p50'] if remote else '-'} | {ratio} | {r['scores_mismatched'] if remote else '-'} |")
    lines.append("")
    for name in REWARDS:
        rs = {(r["encoding"], r["clients"]): r for r in b_rows if r["reward"] == name}
        c = args.b_clients
        sentences = [ratio_sentence(rs["raw", 1]), ratio_sentence(rs["raw", c]),
                     compare(rs["raw", c], rs["png", c]), compare(rs["raw", c], rs["jpeg", c]),
                     compare(rs["jpeg", c], rs["png", c]), compare(rs["raw", c], rs["raw32", c])]
        if c != 1:
            sentences.append(compare(rs["raw", c], rs["raw", 1]))
        off = sum(r["scores_mismatched"] for r in rs.values())
        lines.append(f"- {name}: " + "; ".join(sentences) + f"; {off} remote scores off by more than {TOL:g}.")
    wire = {(r["encoding"], r["clients"]): r for r in b_rows if r["reward"] == REWARDS[0] and r["scoring"] == "remote"}
    c = args.b_clients
    raw, png, jpeg = wire["raw", c], wire["png", c], wire["jpeg", c]
    size = (f"- On the wire per {SIZE}² image: raw {fmt_bytes(raw['bytes_per_image'])}, raw32 "
            f"{fmt_bytes(wire['raw32', c]['bytes_per_image'])}, png {fmt_bytes(png['bytes_per_image'])} "
            f"({raw['bytes_per_image'] / png['bytes_per_image']:.1f}x smaller than raw), jpeg "
            f"{fmt_bytes(jpeg['bytes_per_image'])} ({raw['bytes_per_image'] / jpeg['bytes_per_image']:.1f}x smaller)")
    slower = [e for e, r in (("png", png), ("jpeg", jpeg)) if r["images_per_s_max"] < raw["images_per_s_min"]]
    if slower:
        size += (f"; yet {' and '.join(slower)} {'is' if len(slower) == 1 else 'are'} slower than raw on this "
                 f"loopback (clip_score, {c} clients): per image, encoding takes {png['encode_ms_per_image']:.1f} ms "
                 f"(png), {jpeg['encode_ms_per_image']:.1f} ms (jpeg), {raw['encode_ms_per_image']:.1f} ms (raw) and "
                 f"decoding {png['decode_ms_per_image']:.1f} / {jpeg['decode_ms_per_image']:.1f} / "
                 f"{raw['decode_ms_per_image']:.1f} ms")
    lines.append(size + f". JPEG (lossy, opt-in) moved the tiny clip_score by up to {jpeg_shift:.2g} against the "
                 "exact pixels (a random model at 32 px: this says nothing about a real reward's sensitivity).")
    one = wire["raw", 1]
    stall = rtt["health_keepalive_p50_ms"] - rtt["health_fresh_connection_p50_ms"]
    if stall > 5 and rtt["health_keepalive_p50_ms"] > 2 * rtt["health_fresh_connection_p50_ms"]:
        lines.append(f"- A request on a kept-alive connection waits about {stall:.0f} ms longer than the first request "
                     f"of a fresh connection (fixed cost above), which the `remote` client pays on every call: with one "
                     f"client, clip_score requests of {args.batch} images take {one['p50_ms']:.0f} ms p50 at the client "
                     f"and {one['server_ms_p50']:.0f} ms inside the server.")
    lines.append("- Measured on one machine, CPU only: the client's encoding and the server's decoding and scoring "
                 "share its cores, and no network is involved.")
    return lines


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    standard_args(ap, "24 clients in part A, 2 repeats of 8 requests of 4 images in part B (about 35 s); "
                      "never writes BENCHMARKS.md")
    ap.add_argument("--clients", type=int, default=100, help="part A: concurrent clients")
    ap.add_argument("--requests", type=int, default=4, help="part A: requests per client")
    ap.add_argument("--a-batch", type=int, default=2, help="part A: images per request")
    ap.add_argument("--b-clients", type=int, default=4, help="part B: concurrent clients")
    ap.add_argument("--b-requests", type=int, default=16, help="part B: requests per run (all clients together)")
    ap.add_argument("--batch", type=int, default=8, help="part B: images per request (and per in-process call)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pool", type=int, default=32, help="distinct images")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.a_batch = 24, 2, 2
        args.b_requests, args.batch, args.repeats, args.pool = 8, 4, 2, 16

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        from difrl.rewards.tiny import tiny_reward_options

        options = {"clip_score": tiny_reward_options(Path(d))["clip_score"]}
        pool = image_pool(args.pool)
        pixels = {enc: server_pixels(pool, enc) for enc in ENCODINGS}
        refs = {}
        for name in REWARDS:
            local = build_reward(name, **options.get(name, {}))
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(pool))]
            refs[name] = {enc: local(pixels[enc], prompts, [{} for _ in prompts])[local.key] for enc in ENCODINGS}
        clip = refs["clip_score"]
        jpeg_shift = float((clip["jpeg"] - clip["raw"]).abs().max())
        min_gap = min(float((clip[e][:, None] - clip[e][None, :]).abs()
                            .masked_fill(torch.eye(len(pool), dtype=torch.bool), float("inf")).min()) for e in ENCODINGS)
        server = Server(list(REWARDS), options)
        try:
            print(f"server at {server.url} ({time.perf_counter() - t_start:.1f} s)", flush=True)
            rtt = round_trips(server, 10 if args.quick else 20)
            a_rows = correctness(server, pool, clip, args.clients, args.requests, args.a_batch)
            b_rows = throughput(server, options, pool, refs, args)
        finally:
            server.close()
    rows = [rtt] + a_rows + b_rows
    lines = report(rtt, a_rows, b_rows, args, jpeg_shift, min_gap)
    publish(args, BEGIN, END, "Remote reward server: correctness under concurrency, remote vs in-process speed",
            "bench_reward_server.py", argv, lines, rows)
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
