"""The client of `difrl reward-server`: a reward like any other, scored on another process or machine.

    reward:
      weights: {remote@hps: 1.0}              # name@alias: the scores are logged as reward/hps
      options:
        remote@hps: {url: "http://127.0.0.1:8765", reward: hpsv2, token_file: ~/.difrl_token}

Fail-closed (docs/reference/specs/rewards-eval.md §2.5): httpx with one connection pool per reward, bounded retries with
exponential backoff and jitter only for transient failures (connection refused or reset, 502 / 503,
429, honouring Retry-After) under an overall `deadline`. A hung or stuck scorer is not retried:
neither the server's own 504 (no scores within its `--timeout`; a retry would wait as long again) nor
a read that exceeds the client's `timeout`. That read timeout defaults to the server's timeout (from
/v1/info) + 10 s, so the server's 504, which says why, arrives first. Every response is checked:
the protocol, the request id, one result per item with the same ids in the same order, numeric
scores, and the scorer's version and weights SHA-256 as at start-up (a server restarted with other
weights under the same version label stops the run). Any failure raises, naming the items; the
trainer then stops after a checkpoint or drops those groups (`reward.on_error`) — a failure is never a
score of 0. At start-up the client reads /v1/info and fails fast when the server is down, the token
is wrong or the reward is not served. With `rollout.chunks > 1` and `reward.overlap=true` the
requests of one chunk run while the next chunk samples.
"""

from __future__ import annotations

import random
import time
import uuid

import torch

from difrl.rewards import register_reward
from difrl.rewards.base import RewardConfigError, RewardModel, optional_import
from difrl.rewards.wire import ENCODINGS, PROTOCOL, pack_request, unpack

TRANSIENT_STATUS = (429, 502, 503)  # 504 is the server's own timeout: a stuck scorer, not retried
READ_MARGIN_S = 10.0  # the client's default read timeout: the server's timeout + this


class RemoteRewardError(RuntimeError):
    """The reward server did not give valid scores for some items (named in the message)."""


class RemoteStartupError(RemoteRewardError, RewardConfigError):
    """No usable reward server at start-up (down, wrong url or token): a setting of the run, reported like every
    config error (one line, exit status 2), and still a RemoteRewardError."""


@register_reward("remote")
class RemoteReward(RewardModel):
    """A reward served by `difrl reward-server` (see the module docstring)."""

    required, packages = ("url",), (("httpx", "server"), ("msgpack", "server"))

    def __init__(self, url: str | None = None, reward: str | None = None, token_file: str | None = None,
                 encoding: str = "raw", timeout: float | None = None, connect_timeout: float = 5.0, deadline: float = 600.0,
                 retries: int = 3, batch_size: int | None = None, expect_version: str | None = None):
        httpx = optional_import("httpx", "server", "remote")
        optional_import("msgpack", "server", "remote")
        super().__init__(device=None, dtype=None, batch_size=batch_size)
        if not url:
            raise RewardConfigError("reward 'remote' needs url: the reward server's address, e.g. http://127.0.0.1:8765")
        if encoding not in ENCODINGS:
            raise RewardConfigError(f"reward 'remote': encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.url, self.encoding = url.rstrip("/"), encoding
        self.deadline, self.retries = float(deadline), int(retries)
        from difrl.rewards.server import read_token

        try:
            token = read_token(token_file)
        except ValueError as e:
            raise RewardConfigError(f"reward 'remote': {e}") from e
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # /v1/info answers at once; the scoring timeout is set from it below
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout or 120.0, connect=connect_timeout))
        self.device, self.dtype = None, None  # samples are sent as they come; the server has its own device

        try:
            info = self._request("GET", "/v1/info", what="start-up")
        except RemoteRewardError as e:  # a setting of this run (server down, wrong url or token): exit 2
            raise RemoteStartupError(f"reward 'remote': no usable reward server at start-up: {e}; start one "
                                     "(difrl reward-server --reward NAME --port PORT) or check the reward's url and "
                                     "token_file options") from e
        if timeout is None:
            timeout = float(info.get("timeout_s", 120.0)) + READ_MARGIN_S
        self.client.timeout = httpx.Timeout(float(timeout), connect=connect_timeout)
        served = info.get("rewards", {})
        if reward is None:
            if len(served) != 1:
                raise RewardConfigError(f"reward 'remote': {self.url} serves {sorted(served)}; name one with "
                                        "reward.options.<name>.reward")
            reward = next(iter(served))
        if reward not in served:
            raise RewardConfigError(f"reward 'remote': {self.url} does not serve {reward!r} (it serves {sorted(served)})")
        self.remote = reward
        meta = served[reward]
        self.remote_key, self.version = meta["key"], meta["version"]
        if expect_version is not None and expect_version != self.version:
            raise RewardConfigError(f"reward 'remote': {reward!r} at {self.url} is version {self.version!r}, the "
                                    f"config expects {expect_version!r}")
        self.weights_sha256 = meta.get("weights_sha256", "")
        self.modality = meta.get("modality", "any")
        self.max_items = int(info.get("max_items", 512))
        if self.batch_size is None:
            self.batch_size = min(self.max_items, meta.get("batch_size") or 64)

    # ---------------------------------------------------------------------------------- HTTP with retries

    def _request(self, method: str, path: str, body: bytes | None = None, what: str = "") -> dict:
        """One call with bounded retries for transient failures under the deadline; the decoded body."""
        import httpx

        start, attempt = time.monotonic(), 0
        while True:
            wait = None
            try:
                r = self.client.request(method, self.url + path, content=body,
                                        headers={"Content-Type": "application/msgpack"} if body is not None else None)
            except httpx.TimeoutException as e:
                if isinstance(e, httpx.ConnectTimeout):
                    problem = f"could not connect within {self.client.timeout.connect} s"
                else:  # a hung server: retrying would hang again
                    raise RemoteRewardError(f"{self.url}{path} ({what}): no answer within {self.client.timeout.read} s "
                                            f"({type(e).__name__}); the server hangs or is overloaded") from e
            except httpx.TransportError as e:  # refused, reset, closed mid-request (a killed server)
                problem = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return unpack(r.content) if r.headers.get("content-type", "").startswith("application/msgpack") \
                        else r.json()
                message = _error_text(r)
                if r.status_code not in TRANSIENT_STATUS:
                    raise RemoteRewardError(f"{self.url}{path} ({what}) answered {r.status_code}: {message}"
                                            + (" (not retried: the scorer is stuck or overloaded past the server's "
                                               "timeout)" if r.status_code == 504 else ""))
                problem = f"{r.status_code}: {message}"
                if r.headers.get("retry-after", "").isdigit():
                    wait = float(r.headers["retry-after"])
            attempt += 1
            wait = wait if wait is not None else 0.5 * 2 ** (attempt - 1) * (1 + random.random() * 0.5)
            left = self.deadline - (time.monotonic() - start)
            if attempt > self.retries or wait >= left:
                raise RemoteRewardError(f"{self.url}{path} ({what}) failed after {attempt} attempt(s) in "
                                        f"{time.monotonic() - start:.1f} s: {problem}")
            time.sleep(wait)

    # ---------------------------------------------------------------------------------- scoring

    def score(self, samples, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        request_id = uuid.uuid4().hex
        ids = [f"{request_id[:8]}:{i}" for i in range(len(prompts))]
        body = pack_request(request_id, self.remote, samples, prompts, metadata, ids, self.encoding, self.version)
        resp = self._request("POST", "/v1/score", body, what=f"{len(prompts)} items of {self.remote!r}")
        return self._check(resp, request_id, ids, prompts)

    def _check(self, resp, request_id: str, ids: list[str], prompts: list[str]) -> dict[str, torch.Tensor]:
        where = f"{self.url} ({self.remote!r})"
        if not isinstance(resp, dict) or resp.get("protocol") != PROTOCOL or resp.get("request_id") != request_id:
            raise RemoteRewardError(f"{where}: the response is not the answer to request {request_id} "
                                    f"(protocol {resp.get('protocol') if isinstance(resp, dict) else '?'})")
        scorer = resp.get("reward") or {}
        version, sha = scorer.get("version"), scorer.get("weights_sha256", "")
        if version != self.version or sha != self.weights_sha256:
            raise RemoteRewardError(f"{where}: the scorer is now version {version!r} with weights SHA-256 {sha!r}; at "
                                    f"start-up it was {self.version!r} with {self.weights_sha256!r} (restarted with "
                                    "other weights?); scores of two scorers must not mix in one run")
        results = resp.get("results")
        if not isinstance(results, list) or len(results) != len(ids):
            raise RemoteRewardError(f"{where}: {len(results) if isinstance(results, list) else 'no'} results for "
                                    f"{len(ids)} items")
        got_ids = [r.get("id") if isinstance(r, dict) else None for r in results]
        if got_ids != ids:
            raise RemoteRewardError(f"{where}: result ids {got_ids[:4]}... do not match the items' {ids[:4]}... in order")
        failed = [(i, r.get("error", "?")) for i, r in enumerate(results) if r.get("status") != "ok"]
        if failed:
            raise RemoteRewardError(f"{where}: {len(failed)} of {len(ids)} items failed on the server, e.g. item "
                                    f"{failed[0][0]} (prompt {prompts[failed[0][0]]!r}): {failed[0][1]}")
        keys = list(results[0].get("scores", {}))
        if self.remote_key not in keys:
            raise RemoteRewardError(f"{where}: the results carry no {self.remote_key!r} score (keys {keys})")
        out = {}
        for k in keys:
            vals = [r["scores"].get(k) for r in results]
            bad = [i for i, v in enumerate(vals) if not isinstance(v, (int, float)) or isinstance(v, bool)]
            if bad:
                raise RemoteRewardError(f"{where}: score {k!r} of items {bad[:8]} is not a number ({vals[bad[0]]!r})")
            out["remote" if k == self.remote_key else k] = torch.tensor(vals, dtype=torch.float32)
        return out  # NaN/inf pass through: the trainer's check names those samples' prompt ids and seeds

    def close(self) -> None:
        self.client.close()


def _error_text(r) -> str:
    try:
        body = r.json()
        return str(body.get("error", body))
    except Exception:
        return r.text[:300] or r.reason_phrase
