"""The reward stage of a recipe: build the rewards, score (stop or drop on failure), advantages over the groups
whose rewards did not fail, and the log's reward columns.

    rewards, weights = build_rewards(cfg.reward, world.default_reward)
    scores, bad = score_rewards(lambda: score_all(...), N, cfg.reward.on_error, stop, where, run_dir,
                                gather=across_processes(accelerator))   # a failure on any process stops them all
    frac = track_reward_failures(run.state, int(bad.sum()), N, cfg.reward.max_failed_frac, where, stop, run_dir)
    adv, failed = valid_group_advantages(scores, weights, group_ids, bad, cfg.advantage, cfg.reward.aggregate)
    row.update(reward_stats(adv.reward, scores, weights, group_ids, cfg.advantage))

A failed reward is NaN, never 0: it reaches no mean, std or loss (docs/reference/specs/rewards-eval.md §2.5).
"""

from __future__ import annotations

from pathlib import Path

import torch

from difrl.algos import Advantages, group_advantages, group_normalize
from difrl.rewards import RewardError, build_reward, reward_key


def build_rewards(reward_cfg, default: str | None, probe: tuple | None = None) -> tuple[dict, dict[str, float]]:
    """(name -> reward fn, score key -> weight) from the config's reward section; weights=None means the world's
    own reward `default`. With `probe` (probe_batch(world)) each reward scores that tiny batch of the world's
    samples once, so a reward that does not fit the world stops the run here, before any work."""
    weights = reward_cfg.weights
    if weights is None:
        if default is None:
            from difrl.config import ConfigError

            raise ConfigError("config key 'reward.weights' is null but this world has no reward of its own: name one, "
                              "e.g. reward.weights={brightness: 1.0} or a module:function", "reward.weights")
        weights = {default: 1.0}
    rewards = {name: build_reward(name, **reward_cfg.options.get(name, {})) for name in weights}
    for fn in rewards.values():
        fn.timeout = reward_cfg.timeout  # seconds per call on one chunk (None: no timeout)
    keys = [reward_key(name) for name in weights]
    if len(set(keys)) < len(keys):
        from difrl.config import ConfigError

        raise ConfigError(f"config key 'reward.weights': two rewards file their scores under the same name ({keys}); "
                          "give one an alias, name@alias", "reward.weights")
    if probe is not None:
        check_rewards_fit(rewards, *probe, default)
    return rewards, dict(zip(keys, weights.values()))


def probe_batch(world, n: int = 2) -> tuple:
    """(samples, prompts, metadata): `n` samples of the world as its rewards receive them, made without sampling
    (a flow world's decoded zero latents, a masked world's decoded start tokens) under its first prompts."""
    if callable(world.prompts):  # a masked world: prompts(n, seed) -> MaskedPrompts
        batch = world.prompts(n, 0)
        return world.decode(batch.tokens), batch.texts, batch.metadata
    from difrl.models.base import policy_device

    policy, ids = world.policy, [i % len(world.prompts) for i in range(n)]
    with torch.no_grad():
        samples = policy.decode(torch.zeros(n, *policy.latent_shape, device=policy_device(policy)))
    return samples, [world.prompts[i] for i in ids], [world.metadata(i) for i in ids]


def check_rewards_fit(rewards: dict, samples, prompts: list[str], metadata: list[dict], default: str | None) -> None:
    """Each reward scores the probe batch once; one that raises a shape or type error (another modality, the wrong
    channels, a Sudoku reward on images, a broken contract) is a RewardConfigError naming it and the samples it got.
    No reward.on_error policy makes such a reward fit, so the message suggests none. Other failures (a server that
    is unreachable just now: OSError) are left to the scoring of the first iteration, which names its samples; a
    probe that times out stops the run (the reward refuses further calls)."""
    from difrl.rewards import RewardConfigError, RewardError, RewardTimeoutError

    what = (f"{type(samples).__name__} of {len(samples)} texts" if not torch.is_tensor(samples)
            else f"{'videos' if samples.ndim == 5 else 'images' if samples.ndim == 4 else 'samples'} "
                 f"{list(samples.shape)}")
    for name, fn in rewards.items():
        try:
            fn(samples, prompts, metadata)
        except RewardTimeoutError as e:
            raise RewardError(f"reward {name!r} on {len(prompts)} probe samples before the run: {e}",
                              torch.ones(len(prompts), dtype=torch.bool), contract=True) from e
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError) as e:
            own = f"; this world's own reward is {default!r}" if default else ""
            raise RewardConfigError(f"reward {name!r} cannot score this world's samples ({what}): {type(e).__name__}: "
                                    f"{e}. Choose a reward for these samples (difrl rewards lists each one's input)"
                                    f"{own}") from e
        except Exception:  # noqa: BLE001: not a misfit (e.g. OSError): the first iteration's scoring reports it
            pass


def score_rewards(score, num_samples: int, on_error: str, stop, where: str, run_dir: Path,
                  log=print, gather=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`score()` (difrl.rewards.score_all or Scoring.result) -> every reward's [B] scores and `bad` [B] bool,
    the samples whose reward raised or was NaN/inf. on_error="stop": call stop() (a checkpoint: nothing is
    lost) and raise a RewardError naming the reward, the samples and how to resume; "drop_group": log it and
    return with the failed samples' scores NaN (the caller drops their groups). A contract violation or a
    timeout (RewardContractError, RewardTimeoutError) stops under either policy. A failed reward never
    becomes a score: not 0, not a sentinel.

    `gather` (several processes: accelerate's gather_object, see across_processes) is the one collective
    right after scoring, before any other: every process learns whether any process must stop, and then all
    of them call stop() and raise the same message (each failing process's reason), instead of one raising
    while the others wait in the next collective until it times out."""
    try:
        scores, bad, error = score(), torch.zeros(num_samples, dtype=torch.bool), None
    except RewardError as e:
        scores, bad, error = e.scores, e.bad, e
    except Exception as e:  # a bug in the reward stage itself: with several processes it must reach them all
        if gather is None:
            raise
        scores, bad, error = None, None, e
    is_reward_error = isinstance(error, RewardError)
    fatal = error is not None and (not is_reward_error or error.contract or on_error == "stop")
    mine = (fatal, is_reward_error and error.contract,
            "" if error is None else str(error) if is_reward_error else repr(error))
    verdicts = [mine] if gather is None else gather([mine])  # [(fatal, contract, message)] per process
    failing = [(rank, contract, msg) for rank, (f, contract, msg) in enumerate(verdicts) if f]
    if failing:
        stop()  # every process: a checkpoint (its barrier needs them all)
        detail = "; ".join(msg if gather is None else f"process {rank}: {msg}" for rank, _, msg in failing)
        contract = any(c for _, c, _ in failing)
        if contract:
            why = (f"A reward that breaks its contract or hangs (reward.timeout) stops the run under every "
                   f"reward.on_error (a checkpoint was saved; fix the reward, then resume={run_dir}).")
        elif on_error == "stop":
            why = (f"The run stopped (reward.on_error=stop) after saving a checkpoint; resume with resume={run_dir}, "
                   "or set reward.on_error=drop_group.")
        else:  # drop_group, but the reward stage itself raised on some process
            why = f"The run stopped after saving a checkpoint; fix the reward stage, then resume={run_dir}."
        own_bad = bad if bad is not None else torch.zeros(num_samples, dtype=torch.bool)
        raise RewardError(f"{where}: {detail}. {why}", own_bad, scores, contract) from error
    for rank, (_, _, msg) in enumerate(verdicts):  # every process's dropped samples, logged by the main one
        if msg:
            log(f"{where}: {msg if gather is None else f'process {rank}: {msg}'}; dropping their groups "
                "(reward.on_error=drop_group)")
    return scores, bad


def across_processes(accelerator):
    """score_rewards' `gather` for a multi-process run (accelerate's gather_object: every process's list,
    concatenated in rank order), None for one process."""
    if accelerator is None or accelerator.num_processes == 1:
        return None
    from accelerate.utils import gather_object

    return gather_object


def track_reward_failures(state: dict, failed: int, total: int, max_frac: float, where: str, stop,
                          run_dir: Path) -> float:
    """Count failed samples over the run (state survives resume) and stop the run when an iteration had no
    valid reward at all or the run's failed fraction exceeds `max_frac` (reward.max_failed_frac): dropping
    groups is for a flaky reward, not a broken one. Returns the run's failed fraction so far.

    A stopping iteration's counts are not added to `state`: stop() saves a checkpoint of the iteration before
    it, and the resumed run redoes (and counts) that iteration, so adding them first would count it twice."""
    n_failed, n_scored = state["reward_failed"] + int(failed), state["reward_scored"] + int(total)
    frac = n_failed / max(1, n_scored)
    if failed and (failed == total or frac > max_frac):
        stop()
        why = ("every sample's reward failed" if failed == total else
               f"{n_failed} of {n_scored} samples ({frac:.1%}) failed so far, above reward.max_failed_frac={max_frac}")
        raise RewardError(f"{where}: {why}; the run stopped after saving a checkpoint (resume={run_dir} once the "
                          "reward is fixed)", torch.ones(total, dtype=torch.bool))
    state["reward_failed"], state["reward_scored"] = n_failed, n_scored
    return frac


def valid_group_advantages(scores: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                           bad: torch.Tensor, adv_cfg, aggregate: str, baseline: torch.Tensor | None = None):
    """group_advantages over the groups without a failed reward only (a failed sample's NaN never reaches
    another group's mean or a global std); the failed groups get advantage 0, zero_spread False and reward NaN.
    Returns (Advantages over all N samples, failed_groups [N] bool)."""
    failed = torch.isin(group_ids, group_ids[bad].unique())
    ok = ~failed
    N = len(group_ids)
    advantages, zero, reward = torch.zeros(N), torch.zeros(N, dtype=torch.bool), torch.full((N,), float("nan"))
    if ok.any():
        sub = group_advantages({k: v[ok] for k, v in scores.items() if k in weights}, weights, group_ids[ok], aggregate,
                               adv_cfg.std_scope, adv_cfg.eps, adv_cfg.clip, adv_cfg.scale,
                               None if baseline is None else baseline[ok])
        advantages[ok], zero[ok], reward[ok] = sub.advantages, sub.zero_spread, sub.reward
    return Advantages(advantages, zero, reward), failed


def finite_mean_std(v: torch.Tensor) -> tuple[float, float]:
    v = v[torch.isfinite(v)]  # failed samples (NaN) have no score
    return (float(v.mean()), float(v.std(unbiased=False))) if len(v) else (float("nan"), float("nan"))


def reward_stats(reward: torch.Tensor, scores: dict[str, torch.Tensor], weights: dict[str, float],
                 group_ids: torch.Tensor, adv_cfg) -> dict[str, float]:
    """The log's reward columns: the aggregated reward's mean and std, each reward's (and extra's) raw mean,
    and with several rewards each one's group-normalised |value| (how much of the advantage it drives), all
    over the samples whose rewards did not fail. A verifiable flag (a score named `<reward>/correct`, 0 or 1) also
    gets `reward/<reward>/correct/uniform_groups`: the share of groups in which it does not vary (all right or all
    wrong), the groups whose advantages can teach nothing about it (DAPO's dynamic-sampling motive)."""
    mean, std = finite_mean_std(reward)  # reward [N]: the aggregated (weighted-sum) reward, NaN where failed
    row = {"reward_mean": mean, "reward_std": std, **{f"reward/{k}": finite_mean_std(v)[0] for k, v in scores.items()}}
    ok = torch.isfinite(reward)
    for k, v in scores.items():
        if k.endswith("/correct") and ok.any():
            _, g = group_ids[ok].unique(return_inverse=True)  # groups renumbered 0..n-1 [N_ok]
            flag = v[ok].float()
            lo = torch.full((int(g.max()) + 1,), float("inf"), device=flag.device).scatter_reduce(0, g, flag, "amin")
            hi = torch.full_like(lo, float("-inf")).scatter_reduce(0, g, flag, "amax")
            row[f"reward/{k}/uniform_groups"] = float((lo == hi).float().mean())
    if len(weights) > 1 and ok.any():
        for k in weights:
            norm, _ = group_normalize(scores[k][ok], group_ids[ok], adv_cfg.std_scope, adv_cfg.eps, None, adv_cfg.scale)
            row[f"reward_norm/{k}"] = float(norm.abs().mean())
    return row
