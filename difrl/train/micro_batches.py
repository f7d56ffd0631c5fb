"""The micro-batch solver both plans share: which values of train.micro_batch, train.grad_accum and
train.updates_per_epoch cut a process's rollout, and the nearest ones to offer when the config's do not.

    options = auto_options(n, U, ga)                       # ['train.grad_accum=4 or 8', 'train.updates_per_epoch=2']
    options = explicit_options(X, mb, ga, want, auto, whole)  # micro_batch (keeping grad_accum), grad_accum, auto
    options = updates_options(X, mb, ga, want, whole) + [auto, own_updates(got)]
    raise ConfigError(what_is_wrong + ": use " + ", or ".join(options), key)

Both trainers cut a process's X units per pass (the flow trainer's transitions, difrl/train/flow/plan.py; the masked
trainer's sequences, difrl/train/masked/plan.py) as

    train.micro_batch x train.grad_accum x train.updates_per_epoch = X

and refuse a config that does not, naming the values next to the config's that do (the largest below and the
smallest above, `nearest`), each with the keys it keeps. What is wrong is said by each plan in its own unit
(samples, sequences, transitions); the search and the advice are here. `whole`: a micro-batch must hold a multiple
of this many units (the flow trainer's T trained steps of a sample when its loss needs them together; else 1).
"""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    """The positive divisors of n in increasing order ([] for n <= 0)."""
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def nearest(valid, x: int) -> list[int]:
    """The valid values next to x: the largest below and the smallest above (x itself if valid)."""
    valid = list(valid)
    below, above = [v for v in valid if v <= x], [v for v in valid if v >= x]
    return sorted({*(below[-1:] if below else []), *(above[:1] if above else [])})


def either(key: str, values: list[int]) -> str:
    """'train.KEY=a or b'."""
    return f"train.{key}=" + " or ".join(map(str, values))


def auto_options(n: int, U: int, ga: int) -> list[str]:
    """train.micro_batch=auto takes n / (U x ga) whole units per micro-batch; when U updates x ga micro-batches do
    not divide n: the nearest grad_accum (keeping U) and updates_per_epoch (keeping ga) that do, those that exist."""
    ok_ga = [g for g in divisors(n) if n % (U * g) == 0]
    ok_u = [u for u in divisors(n) if n % (u * ga) == 0]
    return ([either("grad_accum", nearest(ok_ga, ga))] if ok_ga else []) + \
        ([either("updates_per_epoch", nearest(ok_u, U))] if ok_u else [])


def explicit_options(X: int, mb: int, ga: int, want: int | None, auto: str = "", whole: int = 1) -> list[str]:
    """An explicit micro_batch `mb` x grad_accum `ga` that does not cut X units: the nearest micro_batch (keeping ga)
    and grad_accum (keeping mb) whose micro-batches are a multiple of `whole` units and cut X into `want` updates
    per pass (any number when want is None), then `auto` (the plan's 'train.micro_batch=auto ...' when auto cuts
    this rollout, else ''); those that exist."""
    def ok(m: int, g: int) -> bool:
        return X % (m * g) == 0 and m % whole == 0 and want in (None, X // (m * g))

    mbs, gas = [m for m in divisors(X) if ok(m, ga)], [g for g in divisors(X) if ok(mb, g)]
    options = [f"{either('micro_batch', nearest(mbs, mb))} (with train.grad_accum={ga})" if mbs else "",
               f"{either('grad_accum', nearest(gas, ga))} (with train.micro_batch={mb})" if gas else "", auto]
    return [o for o in options if o]


def updates_options(X: int, mb: int, ga: int, want: int, whole: int = 1) -> list[str]:
    """mb x ga cut X units into another number of updates per pass than `want`: the grad_accum (keeping mb) and the
    micro_batch (keeping ga, a multiple of `whole` units) that make `want`, those that exist."""
    options = []
    if X % (want * mb) == 0:
        options.append(f"train.grad_accum={X // (want * mb)} (with train.micro_batch={mb})")
    m = X // (want * ga)
    if X % (want * ga) == 0 and m % whole == 0:
        options.append(f"train.micro_batch={m} (with train.grad_accum={ga})")
    return options


def own_updates(got: int) -> str:
    """The last option when the updates per pass disagree: take the ones the micro-batches make."""
    return f"train.updates_per_epoch={got} (or null) to take these"
