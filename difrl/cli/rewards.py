"""The rewards by name: `difrl rewards` lists them (built-ins and installed entry points), `difrl reward-server`
serves some over HTTP to trainers (reward.weights={remote: 1}; difrl.rewards.server).

    difrl rewards
    difrl reward-server --reward NAME[,NAME...] [--options options.yaml] [--port 8765]
"""

from __future__ import annotations

import argparse


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    """`difrl rewards` takes none."""


def list_rewards(args) -> int:
    from difrl.rewards import describe_rewards

    print(describe_rewards())
    return 0


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reward", required=True, help="NAME[,NAME...]: rewards to serve (names as in reward.weights)")
    p.add_argument("--options", help="a YAML file: reward name -> its options (as reward.options)")
    p.add_argument("--options-json", help="the same as a JSON string (merged over --options)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=8765, help="0 = any free port (printed at start)")
    p.add_argument("--token-file", help="bearer token file (else $DIFRL_REWARD_TOKEN; none = no auth, loopback only)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="request body limit (413 beyond)")
    p.add_argument("--max-items", type=int, default=512, help="items per request (413 beyond)")
    p.add_argument("--max-pixels", type=int, default=4096 * 4096, help="pixels per item, frames together (413 beyond)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight (503 + Retry-After beyond)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request, queueing included (504 beyond)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for other requests' items")
    p.add_argument("--threads", type=int, help="torch CPU threads of the inference thread (default: torch's)")


def serve(args) -> int:
    from difrl.rewards.server import main as serve_main

    return serve_main(args)
