"""Start-up: the CPU of a one-trial ``hpsweep run`` against a bare Optuna worker doing the same.

    python bench/startup.py --rounds 5
    python bench/startup.py --rounds 5 --storages journal --jobs 1,2

Each process is started fresh (interpreter, imports, storage, study, one trial, exit) and its CPU
is the user + system time of the process and its workers (``getrusage(RUSAGE_CHILDREN)`` around
each child; a database server is not the child's and is not counted), with ``OMP_NUM_THREADS=1``
and hpsweep's sources compiled once, as an installed package has them (`_measure`). Sides,
interleaved in every round (peer, hpsweep, peer, ...); the medians of the rounds are reported,
and each ratio is the median of the rounds' ratios:

- hpsweep: ``hpsweep run space.py --n-trials 1`` on a one-parameter model: one training step, an
  evaluation and a checkpoint as hpsweep does by default, its records and ``best/``;
- optuna: the worker a user writes by hand: import torch and optuna, create or load the study,
  one trial that builds the model and torch's AdamW, takes one step, evaluates once and returns
  the loss. Like any first optimizer of a process, its AdamW imports ``torch._dynamo``.

Two moments of the first trial, as ``time.process_time()`` printed by the child: "to the first
trial", where the trial begins (hpsweep: ``on_init_end`` of the trial's Trainer; optuna: the
objective's first line), and "to its first step", where it is ready to train (hpsweep:
``on_train_begin``, after its model, accelerator and optimizer are built; optuna: after its
AdamW). With ``--jobs 2`` the sides run two trials at once: ``hpsweep run --n-jobs 2`` (forked
workers) and Optuna's ``study.optimize(n_jobs=2)`` (threads); their moments are not compared.

Storages: the default journal file, and PostgreSQL (a server started for the run, as the tests
start one: `tests/support/postgres.py`) with a database per process that already holds Optuna's
tables, as every worker after a sweep's first finds it.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the PostgreSQL the tests start, started the same way
from _measure import compile_sources  # noqa: E402
from scale import PEER_MODEL, space_file  # noqa: E402

#: What the child prints at each moment: ``MARK <moment> <process_time>``.
MARK = "hpsweep-bench-cpu"
MOMENTS = ("trial", "step")

SPACE = space_file(
    f"""
class Probe(hpsweep.TrainerCallback):
    def on_init_end(self, args, state, control, **kwargs):
        if os.path.basename(args.output_dir).startswith("run-"):  # a trial's Trainer
            print("{MARK} trial", time.process_time(), file=sys.stderr, flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        print("{MARK} step", time.process_time(), file=sys.stderr, flush=True)
"""
)

PEER = f"""
import sys, time
import optuna
import torch

optuna.logging.set_verbosity(optuna.logging.WARNING)
where, trials, jobs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
storage = where if "://" in where else optuna.storages.JournalStorage(
    optuna.storages.journal.JournalFileBackend(where))
study = optuna.create_study(study_name="peer", storage=storage, load_if_exists=True)
{PEER_MODEL}
def objective(trial):
    print("{MARK} trial", time.process_time(), file=sys.stderr, flush=True)
    lr = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
    data = torch.utils.data.TensorDataset(torch.ones(4, 1), torch.ones(4, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = One()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    print("{MARK} step", time.process_time(), file=sys.stderr, flush=True)
    model.train()
    for x, y in loader:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in loader)

study.optimize(objective, n_trials=trials, n_jobs=jobs)
"""


#: One child's result: CPU seconds of the whole run, and at each of `MOMENTS` it printed.
Result = dict[str, float]


def cpu_of(cmd: list[str], cwd: Path) -> Result:
    """Run ``cmd`` to its end: the CPU of it and its workers, and its first trial's moments."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = {"run": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}
    # workers' lines may interleave: each mark is read on its own
    for moment, cpu in re.findall(rf"{MARK} (\w+) (\d+\.\d+)", proc.stderr):
        result.setdefault(moment, float(cpu))  # the first trial's
    return result


def command(side: str, where: str, jobs: int, folder: Path) -> list[str]:
    """The child of ``side`` on the storage ``where`` (a journal's path or a URL)."""
    if side == "optuna":
        return [sys.executable, str(folder.parent / "peer.py"), where, str(jobs), str(jobs)]
    return [sys.executable, "-m", "hpsweep.cli", "run", str(folder.parent / "space.py")] + [
        "--n-trials", str(jobs), "--n-jobs", str(jobs), "--output-dir", str(folder / "out"),
        "--study-name", "space", *(["--storage", where] if "://" in where else []),
    ]  # fmt: skip


Found = dict[tuple[str, int, str], list[Result]]


def measure(args: argparse.Namespace, root: Path, storage_at: Callable[[str, Path], str]) -> Found:
    """(storage, jobs, side) -> its result in each round, the sides interleaved."""
    (root / "space.py").write_text(SPACE)
    (root / "peer.py").write_text(PEER)
    found: Found = {}
    for r in range(args.rounds):
        for storage in args.storages.split(","):
            for jobs in map(int, args.jobs.split(",")):
                for side in ("optuna", "hpsweep"):
                    folder = root / f"{r}-{storage}-{jobs}-{side}"
                    folder.mkdir()
                    where = storage_at(storage, folder)
                    result = cpu_of(command(side, where, jobs, folder), folder)
                    found.setdefault((storage, jobs, side), []).append(result)
    return found


def cells(results: list[Result], peer: list[Result], key: str) -> list[str]:
    """The median of ``key`` over the rounds, and the median of the rounds' ratios to the peer."""
    pairs = [(r[key], p[key]) for r, p in zip(results, peer) if key in r and key in p]
    if not pairs:
        return ["-", "-"]
    ratio = statistics.median(mine / theirs for mine, theirs in pairs)
    return [f"{statistics.median(mine for mine, _ in pairs):.2f}", f"{ratio:.2f}x"]


def table(found: Found) -> str:
    """The markdown table: one row per storage, --n-jobs and side."""
    lines = [
        "| storage | --n-jobs | side | CPU s, whole run | vs optuna | CPU s to the first trial "
        "| vs optuna | CPU s to its first step | vs optuna |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (storage, jobs, side), results in found.items():
        peer = found[(storage, jobs, "optuna")]
        row = [storage, str(jobs), side, *cells(results, peer, "run")]
        for moment in MOMENTS:  # in --n-jobs workers, a moment counts only that worker's CPU
            row += cells(results, peer, moment) if jobs == 1 else ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--storages", default="journal,postgres")
    parser.add_argument("--jobs", default="1", help="--n-jobs values, e.g. 1,2")
    args = parser.parse_args()
    compile_sources()
    with tempfile.TemporaryDirectory(prefix="hpsweep-startup-") as tmp:
        if "postgres" in args.storages.split(","):
            from support.postgres import postgres_server

            with postgres_server() as pg:
                found = measure(args, Path(tmp), lambda s, f: _storage(s, f, pg))
        else:
            found = measure(args, Path(tmp), lambda s, f: _storage(s, f, None))
    print(
        f"\n{args.rounds} rounds, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(table(found))


def _storage(storage: str, folder: Path, pg: object) -> str:
    """Where a child keeps its study: a journal file in its folder, or a new PostgreSQL database
    holding Optuna's tables (made here, outside the measured processes)."""
    if storage == "journal":
        return str(folder / "peer.journal")
    import optuna

    url = pg.create_database(f"db_{folder.name.replace('-', '_')}")  # type: ignore[attr-defined]
    optuna.storages.RDBStorage(url).engine.dispose()
    return url


if __name__ == "__main__":
    main()
