"""What a world declares to the trainers beyond its evaluation: the line that shows an evaluation, the metrics it
reports before / after training, the early-stop rule, the final save. The trainers (difrl/train/flow/trainer.py,
masked.py), `difrl train`'s table and `difrl export` use these members of the World / MaskedWorld and name no world.

    print("eval after:  " + world.eval_line(metrics))          # format_eval, or the world's own line
    summary["before_after"] = world.before_after_keys()          # the rows of difrl train's before / after table
    reason = world.stop(cfg, metrics, run.state)                 # FDRise (digits, moving digits), or None: no rule
    world.save_final(policy, net, lora, out_dir, write_merged)   # save_merged / save_merged_and_adapter / the model's

A stop rule keeps its counters in the run's state (checkpointed, so a resumed run continues them): its
``initial_state()`` gives their keys and start values, ``lift(state)`` restarts them when a resume changes the stop
rule (difrl.train.run.rundir.held_stop). A final save writes the world's own files into `out_dir` on the main process,
inside the trainer's gather of the full weights; `write_merged(path)` writes the plain checkpoint of the trained
network, LoRA merged, in the adapter's own format (difrl.train.scaffold.save_policy: the train layer's, passed in).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

WriteMerged = Callable[[Path], None]  # path -> the merged plain checkpoint written there


def before_after_keys(declared: tuple[str, ...], headline: tuple[str, ...]) -> list[str]:
    """The eval keys of the before / after table (`difrl train`, difrl/cli/train.py): the world's `declared` ones
    (World.before_after), in its order, then its `headline` keys not among them. The CLI prints those the evaluation
    has, then the named rewards."""
    return list(dict.fromkeys((*declared, *headline)))


def format_eval(ev: dict, keys: tuple[str, ...], note: str | None = None) -> str:
    """One line of an evaluation: `keys` present in `ev` to 3 decimals, the FD features when the metrics carry them,
    then `note` in brackets, or the sample count when the metrics give one."""
    text = ", ".join(f"{k} {ev[k]:.3f}" for k in dict.fromkeys(keys) if k in ev)
    if "fd_extractor" in ev:
        text += f" (FD features: {ev['fd_extractor']})"
    if note is not None:
        text += f" ({note})"
    elif "samples" in ev:
        text += f" ({ev['samples']} samples)"
    return text


class FDRise:
    """stop.fd_rise: stop once `stop.patience` evaluations in a row have a Fréchet distance above stop.fd_rise x the
    best so far while the accuracy is at least stop.min_accuracy. Quality is watched on the reward's own features
    (the eval's "fd"), never the held-out judge. An evaluation without "fd" (a diffusers world without eval.fid)
    changes nothing."""

    def initial_state(self) -> dict:
        return {"best_fd": None, "bad_evals": 0}

    def lift(self, state: dict) -> None:
        state["bad_evals"] = 0  # counted against the old rule; the best FD is kept

    def __call__(self, cfg, ev: dict, state: dict) -> str | None:
        if "fd" not in ev:
            return None
        fd, best = ev["fd"], state["best_fd"]
        state["best_fd"] = fd if best is None else min(best, fd)
        stop = cfg.stop
        if stop.fd_rise is None or best is None:
            return None
        if fd > stop.fd_rise * best and ev["accuracy"] >= stop.min_accuracy:
            state["bad_evals"] += 1
        else:
            state["bad_evals"] = 0
        if state["bad_evals"] >= stop.patience:
            return (f"Fréchet distance {fd:.2f} above {stop.fd_rise:g} x its best {best:.2f} for "
                    f"{state['bad_evals']} evaluation(s) (stop.fd_rise)")
        return None


def save_merged(policy, net, lora: bool, out_dir: Path, write_merged: WriteMerged) -> None:
    """A bundled flow world's final weights: policy.safetensors, LoRA merged, usable as model.path."""
    write_merged(Path(out_dir) / "policy.safetensors")


def save_merged_and_adapter(policy, net, lora: bool, out_dir: Path, write_merged: WriteMerged) -> None:
    """A masked world's final weights: policy.safetensors (LoRA merged, usable as model.path) and under LoRA also the
    adapter alone in peft's own format (PeftModel.from_pretrained(base, out_dir / "lora"))."""
    write_merged(Path(out_dir) / "policy.safetensors")
    if lora:
        net.save_pretrained(str(Path(out_dir) / "lora"))


__all__ = ["FDRise", "WriteMerged", "before_after_keys", "format_eval", "save_merged", "save_merged_and_adapter"]
