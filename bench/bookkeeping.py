"""A bookkeeping benchmark, as Ray Tune's: does a long sweep's last trial cost what its first did?

    python bench/bookkeeping.py                                    # 8 workers x 2,000 trials of 1 s
    python bench/bookkeeping.py --trials 10000 --storages postgres # Ray's own length

Ray Tune publishes 10,000 trials that sleep 1 s on 16 CPUs: 715 s against 625 s ideal. Here the
same shape is scaled to the machine so that the cores are not the limit: W workers (``--workers``,
default 8) run one sweep of N trials (``--trials``, default 2,000) whose training sleeps S seconds
(``--trial-s``, default 1), random sampler, no pruning, so the bookkeeping is measured, not a
sampler or a model. The ideal wall time is N x S / W. The study lives in the journal file
(hpsweep's default, ``DIR/study.journal``) or in PostgreSQL (a server started for the run, as the
tests start it: `tests/support/postgres.py`). For each round and each storage the sides run one
after the other:

- hpsweep: one command, as a user runs it on one machine:
  ``hpsweep run space.py --n-jobs W --n-trials N --sampler random --pruner none [--storage URL]``,
  whose W workers are forked processes. The space is bench/scale.py's: a one-parameter model, a
  callback that sleeps S s when training begins, one AdamW step, one evaluation; hpsweep adds
  its checkpoint, the trial's record, ``best/`` and the ledger.
- optuna: bare Optuna as a user writes it: W processes of ``study.optimize`` with Optuna's
  ``MaxTrialsCallback(N)``, whose objective does the same work (the same model built, the sleep,
  one AdamW step, one evaluation), so both sides pay torch's part. On the journal each process
  opens ``JournalStorage(JournalFileBackend(path))``. The study is created before the workers
  start, since bare Optuna workers that start together race to create it.

Every 0.5 s this process (whose own CPU is not counted) samples:

- the side's CPU: user + system of every process of the side (the command or the W workers, and
  all their descendants); a process that has ended keeps its last reading;
- the database's CPU: every process of the PostgreSQL server, from what each had used when the
  side started (the one connection this process counts through is left out);
- the trials: COMPLETE ones (finished) and RUNNING ones in the study (PostgreSQL: ``count(*)``
  over the trials table, through one connection kept open, since a connection per sample would
  be counted as the database's work; journal: Optuna's ``JournalStorage`` opened on the file,
  read only).

From these series: "start s" (launch to the first finished trial) and the CPU spent by then;
"all W running s" (launch to the first sample with W trials running); per trial, the CPU (all
processes, and the database's share) and the wall time (s per trial x W: S at best) over the
first 10% of the trials, counted once all W workers run and 2 x W trials are finished (`figures`
says why not from the very first), and over the last 10% (the 90% mark to the N-th trial); their
growth, last / first; hpsweep / optuna, taken within each round; and the whole sweep as Ray
reports it: the wall time from the first trial's start to the last one's end against the ideal,
with the trials finished (hpsweep's are exactly N; bare Optuna's workers each check their callback
after their trial, and overshoot). With ``--rounds R`` each figure is the median of the rounds.
``--json PATH`` keeps the raw series; ``--load PATH`` prints the tables from them again.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "tests"))  # the PostgreSQL the tests start, started the same way
from _measure import compile_sources  # noqa: E402
from scale import PEER_MODEL, SLEEP, run_workers, space_file  # noqa: E402

SAMPLE_S = 0.5
STORAGES = ("journal", "postgres")
SIDES = ("hpsweep", "optuna")

PEER = f"""
import sys, time, optuna, torch
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState
optuna.logging.set_verbosity(optuna.logging.ERROR)
where, n, trial_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
storage = where if "://" in where else optuna.storages.JournalStorage(
    optuna.storages.journal.JournalFileBackend(where))
study = optuna.load_study(study_name="peer", storage=storage,
                          sampler=optuna.samplers.RandomSampler())
data = torch.utils.data.TensorDataset(torch.ones(4, 1), torch.ones(4, 1))
{PEER_MODEL}
def objective(trial):
    lr = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
    model = One()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    time.sleep(trial_s)
    for x, labels in torch.utils.data.DataLoader(data, batch_size=4):
        model(x, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in torch.utils.data.DataLoader(data, batch_size=4))

study.optimize(objective, callbacks=[MaxTrialsCallback(n, states=(TrialState.COMPLETE,))])
"""


# --- sampling ------------------------------------------------------------------------------------


class CpuOf:
    """CPU seconds (user + system) that a changing set of processes used since this was made.

    A process keeps its last reading after it ends, so the total never goes down; processes are
    keyed by pid and start time, since the system may give an ended process's pid to a new one."""

    def __init__(self, processes: Callable[[], list[psutil.Process]]) -> None:
        self._processes = processes
        self._last: dict[tuple[int, float], float] = {}
        self._base = 0.0
        self._base = self.read()

    def read(self) -> float:
        for p in self._processes():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self._last[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass  # ended between the listing and the reading: its last reading stands
        return sum(self._last.values()) - self._base


def _descendants() -> list[psutil.Process]:
    """The side's processes: this process's descendants (the database server is no descendant:
    ``pg_ctl`` leaves it to init)."""
    return psutil.Process().children(recursive=True)


class JournalCount:
    """(COMPLETE, RUNNING) trials in the one study of a journal file, read by Optuna's reader."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._storage = None

    def __call__(self) -> tuple[int, int]:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        from optuna.trial import TrialState

        if self._storage is None:
            if not self.path.exists():  # not made yet: the side makes it, never this process
                return 0, 0
            self._storage = JournalStorage(JournalFileBackend(str(self.path)))
        studies = self._storage.get_all_studies()
        if not studies:
            return 0, 0
        trials = self._storage.get_all_trials(studies[0]._study_id, deepcopy=False)
        states = Counter(t.state for t in trials)
        return states[TrialState.COMPLETE], states[TrialState.RUNNING]

    def span(self) -> tuple[int, float, float]:
        """(COMPLETE trials, the first one's start, the last one's end), after the run."""
        from optuna.trial import TrialState

        self()
        (study,) = self._storage.get_all_studies()
        done = self._storage.get_all_trials(
            study._study_id, deepcopy=False, states=(TrialState.COMPLETE,)
        )
        start = min(t.datetime_start for t in done).timestamp()
        return len(done), start, max(t.datetime_complete for t in done).timestamp()


class SqlCount:
    """(COMPLETE, RUNNING) trials in a database of Optuna's tables, through one connection."""

    COUNT = (
        "SELECT count(*) FILTER (WHERE state = 'COMPLETE'), "
        "count(*) FILTER (WHERE state = 'RUNNING') FROM trials"
    )
    SPAN = (
        "SELECT count(*), min(datetime_start), max(datetime_complete) FROM trials "
        "WHERE state = 'COMPLETE'"
    )

    def __init__(self, url: str) -> None:
        import psycopg

        self._connection = psycopg.connect(url, autocommit=True)
        self.pid = self._connection.execute("SELECT pg_backend_pid()").fetchone()[0]

    def __call__(self) -> tuple[int, int]:
        import psycopg

        try:
            return self._connection.execute(self.COUNT).fetchone()
        except psycopg.errors.UndefinedTable:  # the side has not made Optuna's tables yet
            return 0, 0

    def span(self) -> tuple[int, float, float]:
        n, start, end = self._connection.execute(self.SPAN).fetchone()
        self._connection.close()
        return n, start.timestamp(), end.timestamp()


@dataclass
class Series:
    """One side's run as sampled: (time, the side's CPU s, the database's CPU s, finished
    trials, running trials)."""

    side: CpuOf
    database: CpuOf | None
    count: Callable[[], tuple[int, int]]
    samples: list[tuple[float, float, float, int, int]] = field(default_factory=list)

    def sample(self) -> None:
        database = self.database.read() if self.database else 0.0
        self.samples.append((time.time(), self.side.read(), database, *self.count()))

    @contextmanager
    def running(self) -> Iterator[None]:
        """Sample every `SAMPLE_S` while the block runs, and once more after it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                self.sample()
                stop.wait(SAMPLE_S)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.sample()


# --- one side's run ------------------------------------------------------------------------------


class Database:
    """The PostgreSQL server of the run (its processes for `CpuOf`), and a database per side."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.count_pid: int | None = None

    def processes(self) -> list[psutil.Process]:
        main = psutil.Process(int((self.pg.data / "postmaster.pid").read_text().split()[0]))
        return [p for p in (main, *main.children(recursive=True)) if p.pid != self.count_pid]

    def create(self, name: str) -> str:
        """A fresh database; its URL has no password (the password is in PGPASSWORD)."""
        self.pg.create_database(name)
        return self.pg.url(name, password=False)


def _side_command(side: str, url: str | None, root: Path, args: argparse.Namespace) -> list[str]:
    """The side's command line; ``url`` is the database's, None for the journal file."""
    if side == "optuna":
        where = url or str(root / "study.journal")
        return [sys.executable, str(root / "peer.py"), where, str(args.trials), str(args.trial_s)]
    flags = ["--storage", url] if url else []
    return [sys.executable, "-m", "hpsweep.cli", "run", str(root / "space.py")] + [
        "--n-jobs", str(args.workers), "--n-trials", str(args.trials), "--sampler", "random",
        "--pruner", "none", "--output-dir", str(root / "home"), *flags,
    ]  # fmt: skip


def _create_peer_study(url: str | None, root: Path) -> None:
    """The peer's study, made before its workers start, as a user of bare Optuna must."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if url:
        rdb = optuna.storages.RDBStorage(url)
        optuna.create_study(study_name="peer", storage=rdb)
        rdb.engine.dispose()
    else:
        journal = optuna.storages.journal.JournalFileBackend(str(root / "study.journal"))
        optuna.create_study(study_name="peer", storage=optuna.storages.JournalStorage(journal))


def run_side(side: str, root: Path, args, on: tuple[Database, str] | None) -> dict:
    """One side's sweep, sampled; its series and its figures. ``on``: the PostgreSQL server and
    the name of the side's database in it; None for a journal file."""
    root.mkdir(parents=True)
    (root / "space.py").write_text(space_file(SLEEP.format(trial_s=args.trial_s)))
    (root / "peer.py").write_text(PEER)
    database, url = (on[0], on[0].create(on[1])) if on else (None, None)
    if side == "optuna":
        _create_peer_study(url, root)
    study = root / ("study.journal" if side == "optuna" else "home/study.journal")
    count = SqlCount(url) if url else JournalCount(study)
    if database:
        database.count_pid = count.pid
    series = Series(
        CpuOf(_descendants),
        CpuOf(database.processes) if database else None,
        count,
    )
    command = _side_command(side, url, root, args)
    workers = args.workers if side == "optuna" else 1
    with series.running():
        # no pg: run_workers's own sampling of connections would be counted as the database's work
        launched, ended, _ = run_workers(lambda _: command, workers, root / "run", None, "")
    finished, first_start, last_end = count.span()
    return {
        "side": side,
        "finished": finished,
        "wall": last_end - first_start,
        "ended_s": ended - launched,
        **figures(series.samples, launched, args),
        "samples": [
            (round(t - launched, 3), round(c, 3), round(d, 3), n, running)
            for t, c, d, n, running in series.samples
        ],
    }


# --- figures -------------------------------------------------------------------------------------


def mark(samples: list[tuple], k: int) -> float:
    """When the k-th trial finished: linear between the two samples around it."""
    before = None
    for t, _, _, n, _ in samples:
        if n >= k:
            if before is None:
                return t
            t0, n0 = before
            return t0 + (t - t0) * (k - n0) / (n - n0)
        before = (t, n)
    raise SystemExit(f"the study never had {k} finished trials")


def figures(samples: list[tuple], launched: float, args: argparse.Namespace) -> dict:
    """Start-up, and per trial the CPU (all, database) and wall in the first and last 10%.

    The first 10% begins once all W workers were running a trial and 2 x W trials had finished,
    not at the very first: each bare Optuna worker starts its own Python with torch and pays its
    first optimizer step's imports in its first trial, and on a busy machine the last workers are
    still there while the first have finished several trials; a window from the first trial
    would count their start-up as per-trial work."""
    times = [s[0] for s in samples]

    def cpu(t: float, column: int) -> float:
        return float(np.interp(t, times, [s[column] for s in samples]))

    def total(t: float) -> float:
        return cpu(t, 1) + cpu(t, 2)

    tenth = max(1, round(args.trials / 10))
    first = mark(samples, 1)
    running = next((s for s in samples if s[4] >= args.workers), None)
    begin = max(running[3] if running else 1, 2 * args.workers)
    begin = max(1, min(begin, args.trials - 2 * tenth))
    out = {
        "start_s": first - launched,
        "cpu_to_first_s": total(first),
        "all_running_s": running[0] - launched if running else float("nan"),
    }
    for name, (k0, k1) in {
        "first": (begin, begin + tenth),
        "last": (args.trials - tenth, args.trials),
    }.items():
        t0, t1 = mark(samples, k0), mark(samples, k1)
        out[f"cpu_ms_{name}"] = 1000 * (total(t1) - total(t0)) / (k1 - k0)
        out[f"db_ms_{name}"] = 1000 * (cpu(t1, 2) - cpu(t0, 2)) / (k1 - k0)
        out[f"wall_{name}"] = (t1 - t0) / (k1 - k0) * args.workers
    return out


# --- tables --------------------------------------------------------------------------------------


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "—"


def per_trial_table(results: dict, storages: list[str], sides: list[str]) -> list[str]:
    lines = [
        "| storage | side | finished | start s | all W running s | CPU s to 1st trial "
        "| CPU ms/trial, first 10% "
        "| last 10% | **growth** | DB ms/trial, first 10% | last 10% | wall s/trial x W, "
        "first 10% | last 10% |",
        "| --- | --- |" + " ---: |" * 11,
    ]
    for storage in storages:
        for side in sides:
            runs = results[storage][side]
            m = {k: _median(runs, k) for k in runs[0] if isinstance(runs[0][k], (int, float))}
            db = (
                f"{m['db_ms_first']:.1f} | {m['db_ms_last']:.1f}"
                if storage != "journal"
                else "— | —"
            )
            growth = statistics.median(_ratio(r["cpu_ms_last"], r["cpu_ms_first"]) for r in runs)
            lines.append(
                f"| {storage} | {side} | {m['finished']:.0f} | {m['start_s']:.1f} | "
                f"{m['all_running_s']:.1f} | "
                f"{m['cpu_to_first_s']:.1f} | {m['cpu_ms_first']:.1f} | {m['cpu_ms_last']:.1f} | "
                f"**{growth:.2f}x** | {db} | {m['wall_first']:.2f} | {m['wall_last']:.2f} |"
            )
    return lines


def whole_sweep_table(results: dict, storages: list[str], sides: list[str], args) -> list[str]:
    ideal = args.trials * args.trial_s / args.workers
    lines = [
        "| storage | side | finished | wall s | ideal s | **/ ideal** | CPU/trial vs optuna, "
        "first 10% | last 10% | CPU to 1st trial vs optuna |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for storage in storages:
        for side in sides:
            runs = results[storage][side]
            peers = results[storage].get("optuna")
            vs = [
                _vs(runs, peers, key) if peers else "—"
                for key in ("cpu_ms_first", "cpu_ms_last", "cpu_to_first_s")
            ]
            wall = _median(runs, "wall")
            lines.append(
                f"| {storage} | {side} | {_median(runs, 'finished'):.0f} | {wall:.1f} | "
                f"{ideal:.1f} | **{_ratio(wall, ideal)}** | {' | '.join(vs)} |"
            )
    return lines


def _vs(runs: list[dict], peers: list[dict], key: str) -> str:
    """The median over rounds of this side / the peer, each ratio taken within its round."""
    return f"{statistics.median(r[key] / p[key] for r, p in zip(runs, peers) if p[key]):.2f}x"


# --- the run -------------------------------------------------------------------------------------


def _commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "of no git checkout"
    return head + (
        " with uncommitted changes" if git("status", "--porcelain", "--", "hpsweep") else ""
    )


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_all(args: argparse.Namespace, storages: list[str], sides: list[str]) -> dict:
    """Every round: for each storage, the sides one after the other."""
    from support.postgres import postgres_server

    results = {s: {side: [] for side in sides} for s in storages}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        server = stack.enter_context(postgres_server()) if "postgres" in storages else None
        for i in range(args.rounds):
            for storage in storages:
                database = Database(server) if storage == "postgres" else None
                for side in sides:
                    root = Path(tmp) / f"{storage}-{side}-{i}"
                    r = run_side(side, root, args, database and (database, f"{side}_{i}"))
                    print(f"  {storage} {side} round {i}: {_brief(r)}", file=sys.stderr)
                    results[storage][side].append(r)
    return results


def _brief(r: dict) -> str:
    keys = ("finished", "wall", "start_s", "cpu_ms_first", "cpu_ms_last", "wall_first", "wall_last")
    return ", ".join(f"{k} {r[k]:.3g}" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--trial-s", type=float, default=1.0)
    parser.add_argument("--storages", default=",".join(STORAGES))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="where to write the raw series")
    parser.add_argument("--load", type=Path, help="print the tables of a --json file; run nothing")
    args = parser.parse_args()
    saved = load(args) if args.load else None  # its shape, storages and sides are the file's
    storages, sides = args.storages.split(","), args.sides.split(",")
    if not set(storages) <= set(STORAGES) or not set(sides) <= set(SIDES) or args.trials < 2:
        parser.error(f"--storages from {STORAGES}, --sides from {SIDES}, --trials at least 2")
    saved = saved or measure(args, storages, sides)
    print(f"\n{saved['header']}\n")
    print("\n".join(per_trial_table(saved["runs"], storages, sides)) + "\n")
    print("\n".join(whole_sweep_table(saved["runs"], storages, sides, args)))
    if args.json:
        args.json.write_text(json.dumps(saved))


def measure(args: argparse.Namespace, storages: list[str], sides: list[str]) -> dict:
    """Every round's runs, with the command and the conditions they ran in."""
    from support.postgres import PASSWORD

    # stopped by a signal, still stop the PostgreSQL server it started (its `with` block's exit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["PGPASSWORD"] = PASSWORD  # so that no command line or URL holds it
    compile_sources()
    command = "python bench/bookkeeping.py " + shlex.join(sys.argv[1:])
    print(command, flush=True)
    header = (
        f"`{command}`: {args.workers} workers x {args.trials} trials of {args.trial_s:g} s "
        f"(ideal {args.trials * args.trial_s / args.workers:.1f} s), {os.cpu_count()} cores, "
        f"hpsweep {_commit()}, load average {_load()} at the start"
    )
    runs = run_all(args, storages, sides)
    header += f", {_load()} at the end; median of {args.rounds} round(s)"
    shape = {k: getattr(args, k) for k in ("workers", "trials", "trial_s", "rounds")}
    return {"command": command, "header": header, "args": shape, "runs": runs}


def load(args: argparse.Namespace) -> dict:
    """A --json file's runs, their figures made again from their series (times from launch)."""
    saved = json.loads(args.load.read_text())
    vars(args).update(saved["args"], storages=",".join(saved["runs"]))
    vars(args).update(sides=",".join(next(iter(saved["runs"].values()))))
    for runs in saved["runs"].values():
        for run in (r for side in runs.values() for r in side):
            run.update(figures(run["samples"], 0.0, args))
    return saved


def _ratio(a: float, b: float) -> float:
    """a / b; NaN where b is 0 (a window too short to be sampled in a tiny run)."""
    return a / b if b else float("nan")


if __name__ == "__main__":
    main()
