"""The search loop every `AskTellSearcher` runs under: claim a place, ask, train, tell.

One process (``--n-jobs 1``) runs the loop itself; with ``--n-jobs N`` the command forks N
worker processes that each run it, and supervises them:

- workers die with the command: each asks the kernel for SIGTERM when its parent dies
  (``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the command leaves no orphan training;
- a signal to the command (Ctrl-C, ``kill -INT``, SIGTERM) stops every worker once: workers
  ignore the terminal's SIGINT and get one SIGTERM from the command, record their trial as
  ``stopped`` and exit; the command then exits 130 (143 after SIGTERM);
- a worker that dies (``kill -9``, an OOM kill) costs only its trial: the ledger sees its lease
  die, the trial runs again from its checkpoint, and a new worker takes the dead one's place;
- a user error in any worker stops the others and comes back as one line (exit 2);
- each worker is placed before it imports any CUDA state: its own GPU(s) through
  ``CUDA_VISIBLE_DEVICES`` and its share of the CPU threads (`hpsweep.devices`); when the GPUs
  hold fewer trials than ``--n-jobs``, fewer workers run and trials wait their turn.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from contextlib import AbstractContextManager
from typing import Any

from hpsweep import devices
from hpsweep.devices.signals import (
    die_with_parent,
    forget_signals,
    raise_interrupted,
    signals_interrupt,
    stop_if_signalled,
)
from hpsweep.errors import (
    DiskFull,
    EndedOutside,
    Interrupted,
    TakenOver,
    TrialFailed,
    TrialPruned,
    UserError,
)
from hpsweep.search.ask_tell import AskTellSearcher, TrialEnd
from hpsweep.search.ledger import Ledger
from hpsweep.search.ledger_base import Claim, TrialLedger, Verdict
from hpsweep.search.options import SearchOptions
from hpsweep.search.trial_runner import TrialRunner
from hpsweep.trial import Trial

# how often a worker with nothing to claim looks again (others' trials may need re-running)
WAIT_S = 0.5
RESTARTS_PER_WORKER = 3  # dead workers replaced per --n-jobs slot before the command gives up


class SweepLoop:
    """Runs trials until the ledger has ``n_trials`` finished, the timeout passes, or
    ``max_failed_trials`` trials of this command failed: an `AskTellSearcher`'s (`run`), or
    a `hpsweep.search.backends.Driver`'s, which is handed the loop and reads what it holds.

    Args:
        runner: trains one trial and records it; raises `TrialPruned`, `TrialFailed`
            (recorded), `UserError` (the sweep cannot go on) or an interrupt.
        settings: the search's settings.
        ledger: the sweep's ledger (`hpsweep.search.backends.Backend.ledger`); by default the
            files under the output folder.
    """

    def __init__(
        self, runner: TrialRunner, settings: SearchOptions, ledger: TrialLedger | None = None
    ) -> None:
        self.runner = runner
        self.settings = settings
        #: `Ledger` (files) or `StudyLedger` (the study's database): both hand out trials
        self.ledger: TrialLedger = ledger or Ledger(settings.output_dir, settings.n_trials)
        self.started = time.time()
        self.deadline = None if settings.timeout is None else time.monotonic() + settings.timeout
        #: The same moment as wall-clock time, for processes on other hosts (Ray workers).
        self.deadline_wall = None if settings.timeout is None else self.started + settings.timeout

    # --- one process ----------------------------------------------------------------------------------

    def work(self, searcher: AskTellSearcher, worker: int = 0) -> None:
        """The loop itself, in this process (``worker`` numbers it among ``--n-jobs`` processes)."""
        searcher.open(worker)
        try:
            while self.deadline is None or time.monotonic() < self.deadline:
                stop_if_signalled()
                got = self.ledger.next_trial(searcher)
                if got is Verdict.DONE:
                    return
                if isinstance(got, Verdict):
                    time.sleep(WAIT_S)
                    continue
                claim, trial = got.claim, got.trial
                if claim.again is not None:
                    trial.user_attrs["again"] = claim.again
                self._run(searcher, trial, claim)
                self.check_failures()
        finally:
            searcher.close()

    def _run(self, searcher: AskTellSearcher, trial: Trial, claim: Claim) -> None:
        try:
            value = self.runner(trial)
        except TrialPruned:
            searcher.tell(trial, TrialEnd.PRUNED)
        except TrialFailed:
            searcher.tell(trial, TrialEnd.FAILED)
        except TakenOver as exc:
            # another machine runs this trial now (`._study_ledger`): its end is that run's
            print(f"hpsweep: {exc}", file=sys.stderr)
        except UserError as exc:
            # the user's error is the news, not a storage hiccup; a full disk leaves the trial
            # to run again, as a signal does
            if isinstance(exc, DiskFull):
                _tell_quietly(searcher, trial, TrialEnd.STOPPED, self.ledger)
            else:
                _tell_quietly(searcher, trial, TrialEnd.FAILED)
            raise
        except BaseException:
            _tell_quietly(searcher, trial, TrialEnd.STOPPED, self.ledger)
            raise
        else:
            searcher.tell(trial, TrialEnd.COMPLETE, value)
        finally:
            claim.lease.release()

    def check_failures(self) -> None:
        """End the sweep in one line once ``max_failed_trials`` trials of this command failed.
        A trial ended from outside the sweep (optuna-dashboard's Fail button) is failed by hand,
        not by the sweep: it does not count."""
        failed = [
            r
            for r in self.ledger.failures_since(self.started)
            if not (r.error or "").startswith(f"{EndedOutside.__name__}:")
        ]
        limit = self.settings.max_failed_trials
        if len(failed) >= limit:
            last = failed[-1]
            raise UserError(
                f"{len(failed)} trials failed in this run (--max-failed-trials {limit}); the last: "
                f"{last.error} (see {last.run_dir}/error.log); fix the cause and run the same command again"
            )

    # --- worker processes -----------------------------------------------------------------------------

    def run(self, searcher: AskTellSearcher) -> None:
        """Run the sweep with ``searcher``: ``--n-jobs 1``, the loop here; N, N supervised
        worker processes, each placed on its slot's GPUs (see `hpsweep.devices`)."""
        placement = devices.plan_for(self.settings)
        if placement.slots == 1:
            with signals_interrupt(), self.placed(placement):
                self.work(searcher)
            return
        _Supervisor(self, searcher, placement).run()

    def placed(self, placement: devices.Placement | None = None) -> AbstractContextManager[None]:
        """A context in which this process runs its trials one at a time, as the first ``--n-jobs``
        slot: its GPUs (``CUDA_VISIBLE_DEVICES``) and CPU threads. For a driver that runs trials
        in this process (W&B's agent) as for the search layer's loop."""
        return devices.placed(placement or devices.plan_for(self.settings), 0)


class _Supervisor:
    def __init__(
        self, loop: SweepLoop, searcher: AskTellSearcher, placement: devices.Placement
    ) -> None:
        self.loop = loop
        self.searcher = searcher
        self.placement = placement
        self.ctx = multiprocessing.get_context("fork")
        self.messages = self.ctx.SimpleQueue()
        self.procs: dict[int, Any] = {}
        self.stopping: int | None = None  # the signal that stops the sweep
        self.restarts = 0

    def run(self) -> None:
        n = self.placement.slots
        # A command started with SIGINT ignored (`cmd &` in a script, `nohup`) keeps ignoring it, as a
        # one-job sweep does: Python leaves an inherited SIG_IGN alone.
        stops = [
            sig
            for sig in (signal.SIGINT, signal.SIGTERM)
            if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN
        ]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stops}
        try:
            for index in range(n):
                self._start(index)
            self._supervise(n)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # whatever went wrong here, no worker outlives the command
            self._stop_all(signal.SIGTERM)
            for proc in self.procs.values():
                proc.join()
        if self.stopping is not None:
            raise Interrupted(self.stopping)

    def _start(self, index: int) -> None:
        proc = self.ctx.Process(
            target=_worker_main,
            args=(self.loop, self.searcher, index, self.messages, self.placement),
            name=f"hpsweep-worker-{index}",
            daemon=False,
        )
        proc.start()
        self.procs[index] = proc

    def _supervise(self, n: int) -> None:
        from multiprocessing.connection import wait

        while self.procs:
            sentinels = {proc.sentinel: index for index, proc in self.procs.items()}
            for sentinel in wait(list(sentinels), timeout=1.0):
                index = sentinels[sentinel]
                proc = self.procs.pop(index)
                proc.join()
                self._on_exit(index, proc.exitcode, n)

    def _on_exit(self, index: int, code: int | None, n: int) -> None:
        if code == 0 or self.stopping is not None:
            return
        if code in (1, 2):
            kind, message = (
                self.messages.get()
                if not self.messages.empty()
                else ("internal", f"exit code {code}")
            )
            self._stop_all(signal.SIGTERM)
            for proc in self.procs.values():
                proc.join()
            self.procs.clear()
            raise (
                UserError(message)
                if kind == "user"
                else RuntimeError(f"a worker process failed: {message}")
            )
        if code in (130, 143):  # stopped by a signal sent to it alone: the sweep goes on without it
            return
        # Killed (kill -9, the OOM killer): its trial's lease died with it and runs again; replace it.
        self.restarts += 1
        if self.restarts > RESTARTS_PER_WORKER * n:
            self._stop_all(signal.SIGTERM)
            raise RuntimeError(
                f"{self.restarts} worker processes died (the last with exit code {code}); "
                "see the trials' error.log and the system log (out of memory?)"
            )
        print(
            f"hpsweep: worker {index} died (exit code {code}); its trial runs again in a new worker",
            file=sys.stderr,
        )
        self._start(index)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stopping is None:
            self.stopping = signum
            self._stop_all(signal.SIGTERM)

    def _stop_all(self, signum: int) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass


def _worker_main(
    loop: SweepLoop,
    searcher: AskTellSearcher,
    index: int,
    messages: Any,
    placement: devices.Placement,
) -> None:
    """One ``--n-jobs`` worker: the loop, with the command's death and SIGTERM as interrupts."""
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the command died before we asked
        os._exit(143)
    # the terminal's Ctrl-C: the command forwards it once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    forget_signals()
    signal.signal(signal.SIGTERM, raise_interrupted)
    # before anything here touches CUDA: it reads CUDA_VISIBLE_DEVICES once
    devices.apply(placement, index)
    code = 0
    try:
        loop.work(searcher, index)
    except UserError as exc:
        messages.put(("user", str(exc)))
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # noqa: BLE001 - reported to the command, which prints it once
        messages.put(("internal", f"{type(exc).__name__}: {exc}"))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _tell_quietly(
    searcher: AskTellSearcher, trial: Trial, end: TrialEnd, ledger: TrialLedger | None = None
) -> None:
    """Tell the searcher while the sweep is stopping anyway (a stopped trial: the ledger first,
    which keeps it to run again); if it cannot hear it (a full disk under its storage), the
    ledger's reap closes the trial on the next run (`AskTellSearcher.abandon`)."""
    try:
        if end is TrialEnd.STOPPED and ledger is not None and ledger.stopped(searcher, trial):
            return  # the ledger put the trial back to run again; nothing to tell
        searcher.tell(trial, end)
    except Exception:  # noqa: BLE001 - the exception being raised already says why we stop
        pass
