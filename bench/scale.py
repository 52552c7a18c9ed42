"""Many workers on one study: hpsweep's database ledger against the ideal and a hand-written peer.

    python bench/scale.py --workers 16 --trials 400 --trial-s 1

W worker processes (each its own working folder, HOME and temp dir, as machines are) run one
sweep of N trials whose training sleeps ``--trial-s`` seconds (no CPU, so two cores host sixteen
workers), with the study in a real PostgreSQL started for the run (`tests/support/postgres.py`),
then through Optuna's storage proxy in front of it. Random search, no pruning: the scheduling,
counting and recording are measured, not a sampler.

- hpsweep: ``hpsweep run space.py --storage URL --n-trials N`` on every worker: the trainer (one
  step, an evaluation, a checkpoint, trial.json, best/) with the study as the ledger;
- optuna:  the peer a user writes by hand: ``study.optimize`` with the same sleep in each worker and
  Optuna's ``MaxTrialsCallback(N)`` to stop (no checkpoints, no records; its study is created
  before the workers start, since bare Optuna workers that start together race to create it).

Per side: trials finished (N is the promise), wall time from the first trial's start to the last
one's end against the ideal (N x trial-s / W), the start (launch to first trial) and the end (last
trial to last worker gone), seconds of overhead per trial, and the database connections at peak.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the PostgreSQL the tests start, started the same way

_ONE = """
class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x, labels):
        loss = ((self.w * x - labels) ** 2).mean()
        return {loss}
"""

#: The benchmarks of bookkeeping train the smallest model there is: one parameter, one step on
#: four samples. The peers' model: ``One()(x, labels)`` is the loss.
PEER_MODEL = _ONE.format(loss="loss")

_SPACE = """
import os, sys, time
import torch
import hpsweep
{model}
{callback}
def train_dataset():
    return torch.utils.data.TensorDataset(torch.ones(4, 1), torch.ones(4, 1))

eval_dataset = train_dataset

def model_init(trial):
    return One()

space = {{"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)}}
args = hpsweep.TrainingArguments(output_dir="out", max_steps=1, per_device_train_batch_size=4,
                                 disable_progress=True)
objective = "eval_loss"
direction = "minimize"
callbacks = [Probe()]
"""

#: A trial whose training sleeps ``trial_s`` seconds (no CPU), as a `space_file` callback.
SLEEP = """
class Probe(hpsweep.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        time.sleep({trial_s})
"""


def space_file(callback: str) -> str:
    """The space file of `PEER_MODEL`'s model: one training step, an evaluation and a checkpoint
    as hpsweep does them by default; ``callback`` is the source of the ``Probe`` callback class
    (an ``hpsweep.TrainerCallback``) that its trials run."""
    return _SPACE.format(model=_ONE.format(loss='{"loss": loss}'), callback=callback)


PEER = """
import sys, time, optuna
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState
optuna.logging.set_verbosity(optuna.logging.ERROR)
url, n, trial_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
storage = optuna.storages.GrpcStorageProxy(host=url.split("//")[1].split(":")[0],
    port=int(url.rsplit(":", 1)[1])) if url.startswith("grpc") else url
study = optuna.create_study(study_name="peer", storage=storage, load_if_exists=True,
                            sampler=optuna.samplers.RandomSampler())
def objective(trial):
    x = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
    time.sleep(trial_s)
    return x
study.optimize(objective, callbacks=[MaxTrialsCallback(n, states=(TrialState.COMPLETE,))])
"""


def peak_connections(pg, database: str, stop: threading.Event, found: list[int]) -> None:
    query = f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"
    while not stop.is_set():
        try:
            found.append(int(pg.sql(query)))
        except Exception:  # noqa: BLE001 - a sample missed while the server is busy
            pass
        stop.wait(0.25)


def run_workers(
    command: Callable[[Path], list[str]], workers: int, root: Path, pg, database: str
) -> tuple[float, float, list[int]]:
    """Start ``workers`` processes of ``command(folder)``; (launch time, last exit, connections)."""
    stop, connections = threading.Event(), []
    sampler = threading.Thread(target=peak_connections, args=(pg, database, stop, connections))
    sampler.start()
    launched = time.time()
    procs = []
    for i in range(workers):
        folder = root / f"worker-{i}"
        folder.mkdir(parents=True)
        env = {**os.environ, "HOME": str(folder), "TMPDIR": str(folder), "PYTHONPATH": str(ROOT)}
        procs.append(
            subprocess.Popen(
                command(folder),
                cwd=folder,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(folder / "stderr.txt", "w"),  # noqa: SIM115 - closed with the process
            )
        )
    codes = [p.wait() for p in procs]
    ended = time.time()
    stop.set()
    sampler.join()
    if any(codes):
        bad = codes.index(next(c for c in codes if c))
        raise SystemExit(
            f"worker {bad} ({' '.join(command(root))[:200]}) exited {codes[bad]}:\n"
            + (root / f"worker-{bad}" / "stderr.txt").read_text()[-3000:]
        )
    return launched, ended, connections


def measure(side: str, url: str, database: str, args: argparse.Namespace, pg, root: Path) -> dict:
    import optuna

    study_name = "peer" if side == "optuna" else "scale"
    root.mkdir(parents=True)
    space = root / "space.py"
    space.write_text(space_file(SLEEP.format(trial_s=args.trial_s)))
    peer = root / "peer.py"
    peer.write_text(PEER)
    home = root / "home"

    def command(folder: Path) -> list[str]:
        if side == "optuna":
            return [sys.executable, str(peer), url, str(args.trials), str(args.trial_s)]
        return [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--storage", url]+[
            "--study-name", study_name, "--n-trials", str(args.trials), "--output-dir",
            str(home), "--sampler", "random", "--pruner", "none",
        ]  # fmt: skip

    if side == "optuna":
        # Optuna's own workers race to create the tables and the study, and some die of it: the
        # peer's study is made first, as a user of bare Optuna must (hpsweep's workers need not).
        optuna.create_study(study_name=study_name, storage=pg.url(database))
    launched, ended, connections = run_workers(command, args.workers, root / side, pg, database)
    study = optuna.load_study(study_name=study_name, storage=pg.url(database))
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    first = min(t.datetime_start for t in done).timestamp()
    last = max(t.datetime_complete for t in done).timestamp()
    wall = last - first
    return {
        "finished": len(done),
        "wall": wall,
        "ideal": args.trials * args.trial_s / args.workers,
        "start": first - launched,
        "end": ended - last,
        "per_trial": wall * args.workers / len(done) - args.trial_s,
        "connections": max(connections, default=0),
    }


def proxy(url: str, port: int) -> subprocess.Popen:
    """Optuna's storage proxy in front of ``url``, started as Optuna's docs and deploy/ start it:
    over ``get_storage``, whose cache keeps finished trials in the proxy."""
    serve = (
        "import optuna; optuna.storages.run_grpc_proxy_server("
        f"optuna.storages.get_storage({url!r}), host='127.0.0.1', port={port})"
    )
    proc = subprocess.Popen([sys.executable, "-c", serve], stderr=subprocess.DEVNULL)
    import optuna

    client = optuna.storages.GrpcStorageProxy(host="127.0.0.1", port=port)
    client.wait_server_ready(timeout=60)
    client.close()
    return proc


def main() -> None:
    import warnings

    from support import free_port
    from support.postgres import postgres_server

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--trial-s", type=float, default=1.0)
    parser.add_argument("--sides", default="hpsweep,optuna")
    parser.add_argument("--through", default="database,proxy")
    args = parser.parse_args()

    rows = []
    with postgres_server() as pg, tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        for through in args.through.split(","):
            for side in args.sides.split(","):
                database = f"{side}_{through}"
                url = pg.create_database(database)
                if through == "proxy":
                    server = stack.enter_context(proxy(url, port := free_port()))
                    url = f"grpc://127.0.0.1:{port}"
                result = measure(side, url, database, args, pg, Path(tmp) / database)
                if through == "proxy":
                    server.terminate()
                rows.append((side, through, result))

    print(
        f"\n{args.workers} workers x {args.trials} trials of {args.trial_s:g} s "
        f"(ideal {args.trials * args.trial_s / args.workers:.1f} s), {os.cpu_count()} cores\n"
    )
    print("| side | storage | finished | wall s | / ideal | start s | end s | overhead s/trial "
          "| connections at peak |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for side, through, r in rows:
        print(
            f"| {side} | {through} | {r['finished']} | {r['wall']:.1f} | "
            f"{r['wall'] / r['ideal']:.3f} | {r['start']:.1f} | {r['end']:.1f} | "
            f"{r['per_trial']:.3f} | {r['connections']} |"
        )


if __name__ == "__main__":
    main()
