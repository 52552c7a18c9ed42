"""Live progress of a sweep, read from the trial records on disk (and the study's counts, when
machines share it).

Reading ``run-*/trial.json`` (through a `runs.TrialIndex`, so only records that changed) works the
same for every backend and every process or node that writes there, so the display needs no hook
in them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsweep import runs

STATE_STYLE = {"complete": "green", "pruned": "yellow", "failed": "red", "stopped": "magenta"}


class SweepProgress:
    """A rich progress bar (trials done, best so far, time left) and one line per finished trial.

    The counts are the sweep's: ``done`` (complete and pruned trials, what ``--n-trials`` counts)
    against ``n_trials``, with failed, stopped and running trials apart. On one machine they come
    from the records in ``output_dir``; a sweep whose machines share a database passes ``counts``,
    which reads the study (at most every ``counts_every`` s, and for each line), so that every
    machine shows the whole sweep, not its own trials.

    Each tick costs what changed since the last, not what the sweep holds: the records come from a
    `runs.TrialIndex`'s changes, the best is kept as trials end, the counts are the index's (or the
    study's). The bar is redrawn as often as the records are read (every ``interval`` s), not at
    rich's default 10 Hz: a redraw in a terminal costs ~0.7 ms of the GIL that trials train with.
    Off a terminal (a log file, a pipe, a cluster job's log) there is no bar: each trial's line is
    written whole, with the counts, the best so far and the time left at its end; rich is imported
    when the first line is."""

    def __init__(
        self,
        output_dir: Path,
        *,
        n_trials: int | None,
        timeout: float | None,
        directions: list[str],
        objective_name: str,
        interval: float = 0.5,
        counts: Callable[[], Counts] | None = None,
        counts_every: float = 2.0,
    ) -> None:
        self.output_dir, self.n_trials, self.timeout = output_dir, n_trials, timeout
        self.directions, self.objective_name, self.interval = directions, objective_name, interval
        # rich decides now: the bar shows from the start
        self._console: Any = _console() if _may_draw() else None
        self._progress: Any = None
        # its own: it is refreshed on the display's thread
        self._index = runs.TrialIndex(output_dir)
        self._ended: set[str] = set()
        self._best = _Best(directions, self._index.records)
        self._study_counts, self._counts_every = counts, counts_every
        self._counts: Counts | None = None
        self._counted_at = -float("inf")
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
        self._index.refresh(verify=True)
        for r in self._index.take_changed():  # what earlier commands finished: no lines for them
            self._best.offer(r)
            if r.state != "running":
                self._ended.add(r.id)
        self._done_at_start = self._read_counts(force=True).done
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
            TextColumn("{task.fields[apart]}"),
            TextColumn("{task.fields[left]}"),
            TextColumn("{task.fields[best]}"),
            console=self.console,
            transient=True,
            refresh_per_second=1 / self.interval,
        )
        self._task = self._progress.add_task(
            "sweep", total=self.n_trials, apart="", left="", best=""
        )
        self._progress.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._tick(final=True)
            if self._progress is not None:
                self._progress.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception:  # a display must never take a sweep down
                pass

    def _tick(self, final: bool = False) -> None:
        ended = self._take_ended()
        counts = self._read_counts(force=final or bool(ended))
        if ended and counts.as_of is not None:
            # A trial of ours the study counts ended on disk before it was told (the loop writes
            # the record first): looking again after reading the study finds each one, so that
            # no line counts a trial whose own line comes later.
            ended += self._take_ended()
        counts = counts.including(ended)
        ended.sort(key=lambda r: r.finished_at or 0)
        for i, r in enumerate(ended):
            self._best.offer(r)
            self._print_trial(r, counts.before(ended[i + 1 :]))
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=counts.done,
                apart=counts.apart(),
                best=self._best_text(counts),
                left=self._time_left(counts),
            )

    def _take_ended(self) -> list[runs.TrialRecord]:
        """The records that ended since the last look; the others are offered to the best."""
        self._index.refresh()
        ended = []
        for r in self._index.take_changed():
            if r.state != "running" and r.id not in self._ended:
                self._ended.add(r.id)
                ended.append(r)
            else:
                self._best.offer(r)
        return ended

    def _read_counts(self, force: bool) -> Counts:
        """The sweep's counts: the study's (when given; read again after ``counts_every`` s or
        when ``force``d) or, failing that, the records'."""
        now = time.monotonic()
        if self._study_counts is not None and (
            force or now - self._counted_at >= self._counts_every
        ):
            self._counted_at = now
            try:
                self._counts = self._study_counts()
            except Exception:  # the database away: the last counts, or this folder's
                pass
        if self._counts is not None:
            return self._counts
        index = self._index
        return Counts(
            done=index.count("complete", "pruned"),
            failed=index.count("failed"),
            stopped=index.count("stopped"),
            running=index.count("running"),
        )

    def _best_text(self, counts: Counts) -> str:
        """The best of the study (when the counts know it) or of the records seen here."""
        here = self._best.front[0] if len(self.directions) == 1 and self._best.front else None
        if counts.best is not None and not (
            here and runs.is_better(here.objective, counts.best[0], self.directions[0])
        ):
            value, number = counts.best
            return f"best {self.objective_name}={_fmt(value)} (trial {number})"
        return self._best.text(self.objective_name)

    def _time_left(self, counts: Counts) -> str:
        elapsed = time.monotonic() - self._start
        new = counts.done - self._done_at_start
        estimates = []
        if self.timeout:
            estimates.append(max(0.0, self.timeout - elapsed))
        if self.n_trials and new > 0:
            estimates.append(elapsed / new * max(0, self.n_trials - counts.done))
        return f"~{_duration(min(estimates))} left" if estimates else ""

    def _print_trial(self, r: runs.TrialRecord, counts: Counts) -> None:
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
        # A log keeps every param, on one line, and what the bar would show as this trial ends.
        status = (
            f"{counts.done}/{self.n_trials or '?'} done",
            counts.apart(),
            self._best_text(counts),
            self._time_left(counts),
        )
        self.console.print(
            f"{line}  ({', '.join(filter(None, status))})", highlight=False, soft_wrap=True
        )


@dataclass(frozen=True)
class Counts:
    """A sweep's trials by how they stand: ``done`` counts towards ``--n-trials``; ``failed``
    trials were replaced; ``stopped`` ones run again; ``best`` is (objective, trial number) when
    the counts come from a study that knows it."""

    done: int = 0
    failed: int = 0
    stopped: int = 0
    running: int = 0
    best: tuple[float, int] | None = None
    #: when a study's counts were read (this machine's clock); None for the records' own counts
    as_of: float | None = None

    def including(self, ended: list[runs.TrialRecord]) -> Counts:
        """A study's counts with the ``ended`` trials that ended after they were read."""
        late = Counter(r.state for r in ended if self.as_of and (r.finished_at or 0) > self.as_of)
        if not late:
            return self
        return dataclasses.replace(
            self,
            done=self.done + late["complete"] + late["pruned"],
            failed=self.failed + late["failed"],
            stopped=self.stopped + late["stopped"],
            running=max(0, self.running - sum(late.values())),
        )

    def before(self, later: list[runs.TrialRecord]) -> Counts:
        """These counts as they stood before the ``later`` trials ended (a log's line for each of
        several trials that ended between two looks shows the count at its own end)."""
        if not later:
            return self
        states = Counter(r.state for r in later)
        best = self.best
        if best is not None and best[1] in {r.number for r in later}:
            best = None  # the best was not yet: the records' best stands in
        return dataclasses.replace(
            self,
            best=best,
            done=max(0, self.done - states["complete"] - states["pruned"]),
            failed=max(0, self.failed - states["failed"]),
            stopped=max(0, self.stopped - states["stopped"]),
        )

    def apart(self) -> str:
        """The trials that do not count, as a few words (empty when there are none)."""
        parts = [
            f"{n} {word}"
            for n, word in (
                (self.running, "running"),
                (self.failed, "failed"),
                (self.stopped, "to run again"),
            )
            if n
        ]
        return ", ".join(parts)


class _Best:
    """The best complete trial (the Pareto front for several directions), kept as trials end.

    Args:
        directions: the sweep's.
        everything: every record known now, for the rare offer that needs them all.
    """

    def __init__(
        self, directions: list[str], everything: Callable[[], list[runs.TrialRecord]]
    ) -> None:
        self.directions = directions
        self.front: list[runs.TrialRecord] = []
        self._everything = everything

    def offer(self, record: runs.TrialRecord) -> None:
        """Take in a record that changed, at a cost that follows the front, not the sweep: it joins
        the front or not (`runs.front_with`). A trial of the front written again keeps its place
        while its objective stays; otherwise (it runs again, or was edited) the trials it
        dominated may be back, and the front is computed again from every record."""
        at = next((i for i, r in enumerate(self.front) if r.id == record.id), None)
        if at is not None:
            if record.state == "complete" and record.objective == self.front[at].objective:
                self.front = [*self.front[:at], record, *self.front[at + 1 :]]
            else:
                self.front = runs.best_records(self._everything(), self.directions)
        elif record.state != "complete" or record.objective is None:
            return
        elif len(self.directions) > 1:
            self.front = runs.front_with(self.front, record, self.directions, lambda r: r.objective)
        elif not self.front or runs.is_better(
            record.objective, self.front[0].objective, self.directions[0]
        ):
            self.front = [record]

    def text(self, objective_name: str) -> str:
        if len(self.directions) == 1 and self.front:
            best = self.front[0]
            return f"best {objective_name}={_fmt(best.objective)} ({Path(best.run_dir).name})"
        return f"Pareto front: {len(self.front)} trials" if self.front else ""


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
