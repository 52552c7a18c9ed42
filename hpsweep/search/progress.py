"""Live progress of a sweep, read from the trial records on disk.

Reading ``run-*/trial.json`` (through a `runs.TrialIndex`, so only records that changed) works the
same for every backend and every process or node that writes there, so the display needs no hook in them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpsweep import runs

STATE_STYLE = {"complete": "green", "pruned": "yellow", "failed": "red", "stopped": "magenta"}


class SweepProgress:
    """A rich progress bar (trials done, best so far, time left) and one line per finished trial.

    The bar is redrawn as often as the records are read (every ``interval`` s), not at rich's
    default 10 Hz: a redraw in a terminal costs ~0.7 ms of the GIL that trials train with.
    Off a terminal (a log file, a pipe, a cluster job's log) there is no bar: each trial's line is
    written whole, with the count, the best so far and the time left at its end; rich is imported
    when the first line is (~20 ms of the GIL the first trial would otherwise train without)."""

    def __init__(
        self,
        output_dir: Path,
        *,
        n_trials: int | None,
        timeout: float | None,
        directions: list[str],
        objective_name: str,
        interval: float = 0.5,
    ) -> None:
        self.output_dir, self.n_trials, self.timeout = output_dir, n_trials, timeout
        self.directions, self.objective_name, self.interval = directions, objective_name, interval
        # rich decides now: the bar shows from the start
        self._console: Any = _console() if _may_draw() else None
        self._progress: Any = None
        self._printed: set[str] = set()
        # its own: it is refreshed on the display's thread
        self._index = runs.TrialIndex(output_dir)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def console(self) -> Any:
        """rich's console on standard error (made on first use)."""
        if self._console is None:
            self._console = _console()
        return self._console

    def start(self) -> None:
        self._start = time.monotonic()
        self._finished_before = {
            r.id for r in runs.read_trials(self.output_dir) if r.state != "running"
        }
        if self._console is not None and (self._console.is_terminal or self._console.is_jupyter):
            self._start_bar()
        self._thread = threading.Thread(target=self._loop, name="hpsweep-progress", daemon=True)
        self._thread.start()

    def _start_bar(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[left]}"),
            TextColumn("{task.fields[best]}"),
            console=self.console,
            transient=True,
            refresh_per_second=1 / self.interval,
        )
        self._task = self._progress.add_task("sweep", total=self.n_trials, left="", best="")
        self._progress.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._tick()
            if self._progress is not None:
                self._progress.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception:  # a display must never take a sweep down
                pass

    def _tick(self) -> None:
        records = self._read()
        done = sorted(
            (r for r in records if r.state != "running"), key=lambda r: r.finished_at or 0
        )
        for r in done:
            if r.id not in self._printed and r.id not in self._finished_before:
                self._print_trial(r, done)
                self._printed.add(r.id)
        if self._progress is not None:
            best_text, left = self._best_text(records), self._time_left(done)
            self._progress.update(self._task, completed=len(done), best=best_text, left=left)

    def _best_text(self, records: list[runs.TrialRecord]) -> str:
        best = runs.best_records(records, self.directions)
        if len(self.directions) == 1 and best:
            return f"best {self.objective_name}={_fmt(best[0].objective)} ({Path(best[0].run_dir).name})"
        return f"Pareto front: {len(best)} trials" if best else ""

    def _time_left(self, done: list[runs.TrialRecord]) -> str:
        elapsed = time.monotonic() - self._start
        new = [r for r in done if r.id not in self._finished_before]
        estimates = []
        if self.timeout:
            estimates.append(max(0.0, self.timeout - elapsed))
        if self.n_trials and new:
            estimates.append(elapsed / len(new) * max(0, self.n_trials - len(done)))
        return f"~{_duration(min(estimates))} left" if estimates else ""

    def _print_trial(self, r: runs.TrialRecord, done: list[runs.TrialRecord]) -> None:
        style = STATE_STYLE.get(r.state, "white")
        params = " ".join(f"{k}={_fmt(v)}" for k, v in r.params.items())
        if r.objective is not None:
            value = f"{self.objective_name}={_fmt(r.objective)}"
        elif r.state == "pruned":
            value = f"after {len(r.history)} evaluation{'s' * (len(r.history) != 1)}"
        else:
            value = r.error or ""
        line = f"[{style}]{r.state:>8}[/] {Path(r.run_dir).name:<10} {r.duration_s or 0:5.1f}s {value}  [dim]{params}[/]"
        if self.console.is_terminal:  # one screen line under the bar
            self.console.print(line, highlight=False, no_wrap=True, overflow="ellipsis")
            return
        # A log keeps every param, on one line, and what the bar would show as of this trial's end.
        so_far = done[: done.index(r) + 1]
        status = (
            f"{len(so_far)}/{self.n_trials or '?'} done",
            self._best_text(so_far),
            self._time_left(so_far),
        )
        self.console.print(
            f"{line}  ({', '.join(filter(None, status))})", highlight=False, soft_wrap=True
        )

    def _read(self) -> list[runs.TrialRecord]:
        self._index.refresh()
        return self._index.records()


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _may_draw() -> bool:
    """Whether rich could draw a bar here: standard error is a terminal, a notebook runs us, or one of
    the variables rich reads says to draw as on a terminal. Otherwise (a pipe or a file) it cannot,
    and rich is left unimported until there is a line to write."""
    isatty = getattr(sys.stderr, "isatty", None)
    return (
        bool(isatty and isatty())
        or "IPython" in sys.modules
        or any(
            os.environ.get(name)
            for name in (
                "FORCE_COLOR",
                "TTY_INTERACTIVE",
                "TTY_COMPATIBLE",
                "JUPYTER_COLUMNS",
                "DATABRICKS_RUNTIME_VERSION",
            )
        )
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
