"""The training loop's progress: a tqdm bar on a terminal, plain lines where stderr is not one (a log file, a job
scheduler's captured output, a pipe), as accelerate's logging writes them.

    bar = progress_bar(run.start, cfg.train.iterations, enabled=accelerator.is_main_process)
    for it in bar:                                                 # range(run.start, cfg.train.iterations)
        ...
        progress(bar, row, run.state["last_eval"], world.headline)   # after the iteration's metric row
    bar.close()

tqdm redraws its line with carriage returns several times a second; in a file each redraw is kept, so a long
run's log becomes one line of megabytes. Off a terminal the loop prints instead one line (starting "train:", as
the bar does) after the first iteration, every `every` iterations (about 20 over the run), after an evaluation,
after the last iteration, and when `seconds` have passed since the previous line (a slow model still shows life):

    train: iteration 10/100, 0:00:35 elapsed, 3.50 s/iteration; reward 0.512; eval now: accuracy 0.420

Both show this iteration's train reward and the last evaluation's headline metrics, labelled as the last
evaluation (which may be many iterations old): "last eval accuracy" on the bar, "eval now" on the line of the
iteration that evaluated. A process other than the main one shows nothing (a disabled bar).
"""

from __future__ import annotations

import datetime
import math
import sys
import time


def progress_bar(start: int, total: int, enabled: bool = True, stream=None, every: int | None = None,
                 seconds: float = 60.0):
    """An iterable over range(start, total) that shows progress on `stream` (default sys.stderr): tqdm's bar on a
    terminal or in a notebook, else PlainProgress; nothing when not `enabled` (a tqdm bar, disabled)."""
    stream = sys.stderr if stream is None else stream
    if enabled and not _interactive(stream):
        return PlainProgress(start, total, stream, every, seconds)
    from tqdm.auto import tqdm

    return tqdm(range(start, total), initial=start, total=total, desc="train", disable=not enabled, dynamic_ncols=True,
                file=stream)


def _interactive(stream) -> bool:
    """A terminal, or a Jupyter kernel (where tqdm.auto draws a widget)."""
    if "ipykernel" in sys.modules:
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(bar, row: dict, last_eval: dict, headline: tuple[str, ...]) -> None:
    """After iteration row["iteration"] (its metric row): its train reward and the last evaluation's headline
    metrics on the bar, or a plain line when one is due (PlainProgress.show)."""
    nan = float("nan")
    if isinstance(bar, PlainProgress):
        bar.show(row, last_eval, headline)
        return
    bar.set_postfix({"reward": f"{row['reward_mean']:.3f}",
                     **{f"last eval {k}": f"{last_eval.get(k, nan):.3f}" for k in headline}})


class PlainProgress:
    """What the loops use of a tqdm bar (iterating it, close) with plain lines: see the module docstring."""

    def __init__(self, start: int, total: int, stream, every: int | None = None, seconds: float = 60.0):
        self.start, self.total, self.stream, self.seconds = start, total, stream, seconds
        self.every = every or max(1, math.ceil((total - start) / 20))
        self.t0 = self.last_line = time.monotonic()
        self.done = self.shown = start  # iterations done, and the count the last line showed
        self.text = ""  # the last line's reward and evaluation part

    def __iter__(self):
        yield from range(self.start, self.total)

    def __len__(self) -> int:
        return self.total - self.start

    def show(self, row: dict, last_eval: dict, headline: tuple[str, ...]) -> None:
        self.done = int(row["iteration"])
        evaluated = any(k.startswith("eval/") for k in row)  # this iteration ran the evaluation
        label = "eval now:" if evaluated else "last eval"
        metrics = ", ".join(f"{k} {last_eval.get(k, float('nan')):.3f}" for k in headline)
        self.text = f"reward {row['reward_mean']:.3f}" + (f"; {label} {metrics}" if metrics else "")
        now = time.monotonic()
        due = (self.done == self.start + 1 or self.done % self.every == 0 or evaluated or self.done >= self.total
               or now - self.last_line >= self.seconds)
        if due:
            self._line(now)

    def _line(self, now: float) -> None:
        ran = self.done - self.start
        elapsed = datetime.timedelta(seconds=round(now - self.t0))
        rate = f", {(now - self.t0) / ran:.2f} s/iteration" if ran > 0 else ""
        self.stream.write(f"train: iteration {self.done}/{self.total}, {elapsed} elapsed{rate}; {self.text}\n")
        self.stream.flush()
        self.last_line, self.shown = now, self.done

    def close(self) -> None:
        """After the loop: the last iteration's line if it was not shown (a loop stopped early or by a signal)."""
        if self.done != self.shown and self.text:
            self._line(time.monotonic())
