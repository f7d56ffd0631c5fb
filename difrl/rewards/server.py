"""The remote reward server: serve difrl rewards over HTTP to trainers on this or other machines.

    difrl reward-server --reward hpsv2,ocr --options rewards.yaml                 # 127.0.0.1:8765, no token
    difrl reward-server --reward hpsv2 --host 0.0.0.0 --token-file ~/.difrl_token  # other machines: token required

    # the trainer:  reward.weights={remote@hps: 1.0}
    #               reward.options={remote@hps: {url: "http://127.0.0.1:8765", reward: hpsv2, token_file: ...}}

Starlette + uvicorn (no hand-written HTTP), the msgpack wire format of difrl.rewards.wire (no
pickle anywhere). Endpoints: GET /v1/health (open: liveness), GET /v1/info (the rewards served: name,
version, weights SHA-256, input spec, batch size; the limits), POST /v1/score. Every endpoint but
health needs `Authorization: Bearer <token>` when a token is set (compared in constant time); the
server binds to loopback by default and refuses any other address without a token.

Limits: body size (413, Starlette's max_body_size), items per request and pixels per item (413),
concurrent requests (503 with Retry-After), a per-request timeout (504). Items of concurrent
requests are batched together up to each reward's batch size (waiting at most `max_wait_ms` for
more) and scored in one inference thread, so the event loop never runs torch. A reward that
raises fails only the items of the requests in that batch that raise on their own (the batch is
re-run request by request to find them): those items come back with status "error" and the
message, never with a score. Request bodies are decoded in a small thread pool, off the event loop;
a response's `timing_ms` covers decoding, queueing and scoring, not packing the response.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch

from difrl.rewards import Reward
from difrl.rewards.wire import PROTOCOL, LimitError, Limits, WireError, decode_metadata, decode_sample, pack, unpack_request


@dataclass
class ServerConfig:
    token: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_concurrency: int = 64  # requests in flight; more get 503
    timeout_s: float = 120.0  # per request, queueing included; then 504
    max_wait_ms: float = 5.0  # how long a batch waits for items of other requests
    threads: int | None = None  # torch intra-op threads of the inference thread (None: torch's default)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------ batching


@dataclass
class _Item:
    sample: torch.Tensor
    prompt: str
    metadata: dict
    request: str
    future: asyncio.Future


class Batcher:
    """One reward's queue: items of concurrent requests go to the inference thread in batches of at most
    `batch_size` (the reward's own, or 64), grouped by sample shape; each item's future gets its scores
    {key: float} or the exception its request raised."""

    def __init__(self, reward: Reward, executor: ThreadPoolExecutor, max_wait_s: float):
        self.reward, self.executor, self.max_wait_s = reward, executor, max_wait_s
        self.batch_size = reward.batch_size or 64
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def score(self, items: list[_Item]) -> None:
        for it in items:
            self.queue.put_nowait(it)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.batch_size:
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time())))
                except asyncio.TimeoutError:
                    break
            batch = [it for it in batch if not it.future.done()]  # requests that timed out meanwhile
            groups: dict[tuple, list[_Item]] = {}
            for it in batch:
                groups.setdefault((tuple(it.sample.shape), it.sample.dtype), []).append(it)
            for group in groups.values():
                await self._run(loop, group, isolate=True)

    async def _run(self, loop, group: list[_Item], isolate: bool) -> None:
        samples = torch.stack([it.sample for it in group])
        try:
            out = await loop.run_in_executor(self.executor, self.reward, samples, [it.prompt for it in group],
                                             [it.metadata for it in group])
        except Exception as e:
            requests = list(dict.fromkeys(it.request for it in group))
            if isolate and len(requests) > 1:  # find the request(s) that fail on their own; the others get scores
                for r in requests:
                    await self._run(loop, [it for it in group if it.request == r], isolate=False)
                return
            for it in group:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        for i, it in enumerate(group):
            if not it.future.done():
                it.future.set_result({k: float(v[i]) for k, v in out.items()})


# ------------------------------------------------------------------------------------------ the app


def make_app(rewards: dict[str, Reward], config: ServerConfig):
    """The Starlette app serving `rewards` (name -> built Reward)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    # one inference thread; torch's thread count is per OS thread, so it is set in that thread
    executor = ThreadPoolExecutor(1, thread_name_prefix="difrl-reward-server",
                                  **({"initializer": torch.set_num_threads, "initargs": (config.threads,)}
                                     if config.threads else {}))
    decode_pool = ThreadPoolExecutor(2, thread_name_prefix="difrl-reward-decode")  # msgpack, PNG/JPEG, to tensors
    batchers = {name: Batcher(r, executor, config.max_wait_ms / 1000.0) for name, r in rewards.items()}
    infos = {name: r.info() for name, r in rewards.items()}
    state = {"in_flight": 0, "served": 0}

    def error(status: int, message: str, headers: dict | None = None):
        return JSONResponse({"protocol": PROTOCOL, "error": message}, status_code=status, headers=headers)

    def authorized(request) -> bool:
        if config.token is None:
            return True
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.token.encode())

    def parse(body: bytes):
        req = unpack_request(body, config.limits)
        return req, [(decode_sample(it["sample"], config.limits), decode_metadata(it.get("metadata", {})))
                     for it in req["items"]]

    async def health(request):
        return JSONResponse({"status": "ok", "protocol": PROTOCOL, "rewards": sorted(rewards),
                             "in_flight": state["in_flight"], "served": state["served"]})

    async def info(request):
        if not authorized(request):
            return error(401, "missing or wrong bearer token")
        limits = config.limits
        return JSONResponse({"protocol": PROTOCOL, "rewards": infos, "max_items": limits.max_items,
                             "max_pixels": limits.max_pixels, "max_body_bytes": limits.max_body_bytes,
                             "max_concurrency": config.max_concurrency, "timeout_s": config.timeout_s})

    async def score(request):
        if not authorized(request):
            return error(401, "missing or wrong bearer token")
        if state["in_flight"] >= config.max_concurrency:
            return error(503, f"busy: {state['in_flight']} requests in flight (max {config.max_concurrency})",
                         {"Retry-After": "1"})
        state["in_flight"] += 1
        t0 = time.perf_counter()
        try:
            body = await request.body()
            loop = asyncio.get_running_loop()
            try:  # decoding (megabytes of msgpack, PNG / JPEG frames) off the event loop
                req, decoded = await loop.run_in_executor(decode_pool, parse, body)
            except LimitError as e:
                return error(413, str(e))
            except WireError as e:
                return error(400, str(e))
            if req["reward"] not in rewards:
                return error(404, f"reward {req['reward']!r} is not served here (serving {sorted(rewards)})")
            meta = infos[req["reward"]]
            if req.get("expect_version") not in (None, meta["version"]):
                return error(409, f"reward {req['reward']!r} is version {meta['version']!r} here, the client "
                                  f"expects {req['expect_version']!r}")
            items = [_Item(sample, it["prompt"], metadata, req["request_id"], loop.create_future())
                     for it, (sample, metadata) in zip(req["items"], decoded)]
            await batchers[req["reward"]].score(items)
            try:
                outcomes = await asyncio.wait_for(asyncio.gather(*(it.future for it in items), return_exceptions=True),
                                                  config.timeout_s)
            except asyncio.TimeoutError:
                for it in items:
                    it.future.cancel()
                return error(504, f"no scores within the server's {config.timeout_s} s timeout")
            results = []
            for it, got in zip(req["items"], outcomes):
                if isinstance(got, BaseException):
                    results.append({"id": it["id"], "status": "error", "error": f"{type(got).__name__}: {got}"})
                else:
                    results.append({"id": it["id"], "status": "ok", "scores": got})
            state["served"] += 1
            body = pack({"protocol": PROTOCOL, "request_id": req["request_id"], "reward": meta,
                         "encoding": req.get("encoding"), "results": results,
                         "timing_ms": (time.perf_counter() - t0) * 1000.0})
            return Response(body, media_type="application/msgpack")
        finally:
            state["in_flight"] -= 1

    @asynccontextmanager
    async def lifespan(app):
        for b in batchers.values():
            b.start()
        yield
        executor.shutdown(wait=False, cancel_futures=True)
        decode_pool.shutdown(wait=False, cancel_futures=True)

    return Starlette(routes=[Route("/v1/health", health), Route("/v1/info", info),
                             Route("/v1/score", score, methods=["POST"])],
                     lifespan=lifespan, max_body_size=config.limits.max_body_bytes)


# ------------------------------------------------------------------------------------------ the command


def read_token(token_file: str | None) -> str | None:
    import os

    if token_file:
        try:
            token = open(os.path.expanduser(token_file)).read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the token file {token_file!r}: {e}") from e
        if len(token) < 16:
            raise ValueError(f"the token in {token_file!r} is {len(token)} characters; use at least 16 "
                             "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        return token
    return os.environ.get("DIFRL_REWARD_TOKEN") or None


def serve(reward_names: list[str], options: dict, host: str = "127.0.0.1", port: int = 8765,
          token: str | None = None, config: ServerConfig | None = None, log=print) -> None:
    """Build the rewards (weights load before the port opens), then serve until interrupted."""
    import uvicorn

    from difrl.rewards import build_reward

    if not is_loopback(host) and token is None:
        raise ValueError(f"refusing to serve on {host!r} without a token: anyone who reaches that address could use "
                         "(and load) the reward; pass --token-file (or set DIFRL_REWARD_TOKEN), or bind 127.0.0.1")
    rewards = {name: build_reward(name, **options.get(name, {})) for name in reward_names}
    config = config or ServerConfig()
    config.token = token
    app = make_app(rewards, config)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only for that protocol number; with
    # 0, Nagle holds each response body until the client's delayed ACK (~40 ms per kept-alive request, measured)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    bound = sock.getsockname()[1]
    served = ", ".join(f"{n} ({r.info()['version']})" for n, r in rewards.items())
    log(f"difrl reward-server: serving {served} on http://{host}:{bound} "
        f"(token {'required' if token else 'off: loopback only'})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, lifespan="on"))
    server.run(sockets=[sock])


def main(args) -> int:
    """`difrl reward-server` (argparse namespace from difrl.cli)."""
    options = {}
    if args.options:
        import yaml

        try:
            with open(args.options) as f:
                options = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--options {args.options}: {e}") from e
        if not isinstance(options, dict):
            raise ValueError(f"--options {args.options}: expected a mapping reward name -> options")
    if args.options_json:
        options.update(json.loads(args.options_json))
    names = [n for n in args.reward.split(",") if n]
    config = ServerConfig(limits=Limits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_items=args.max_items,
                                        max_pixels=args.max_pixels),
                          max_concurrency=args.max_concurrency, timeout_s=args.timeout, max_wait_ms=args.max_wait_ms,
                          threads=args.threads)  # CPU kernels may round differently per thread count
    serve(names, options, args.host, args.port, read_token(args.token_file), config,
          log=lambda *a, **k: print(*a, file=sys.stderr, **k))
    return 0
