"""Does a sweep warm-started from the last one reach a good model sooner than one started cold?

    python bench/warm_start.py --quick    # classification and digits, 2 seeds
    python bench/warm_start.py            # five tasks, 2 seeds: 10 task-seeds

Tasks the defaults were not tuned on, from scikit-learn's bundled data sets and generators (a
4-class and a 10-class ``make_classification``, ``make_gaussian_quantiles``,
``make_hastie_10_2``, digits), each standardised and split 70/30, trained for 8 epochs by plain
SGD on a two-layer MLP whose initial weights are scaled by a searched ``init_scale``. The space
is wide on purpose, as a first sweep's often is: six decades of learning rate and six of
``init_scale``, of which only a narrow band of each trains at all in the epochs given, and the
two interact, so a cold sweep needs many trials to find the good region. (On tasks where almost
any config is good, as wine or breast cancer with AdamW, every sweep reaches the target at its
first trial and there is nothing to measure.) For each task and seed, in fresh processes with
one torch thread (OMP_NUM_THREADS=1), seeds interleaved:

1. a first sweep (``--first-trials``) on half the training data, over the learning rate,
   ``init_scale``, the hidden width and the batch size;
2. then a change: twice the data, a new param (dropout), the learning rate's range narrowed
   (its lowest decade, where nothing trains, dropped);
3. the second sweep run three ways (``--trials`` each): cold; warm (``--warm-start`` from the
   first); and warm with ``--warm-start-best 1`` (the first sweep's best config trains first).

The target of a task is the cold sweeps' median final best accuracy less 0.5 points. For each
second sweep: wall seconds from its first trial's start (the process's start-up, the same for
every way, is left out) until the first complete trial that reached the target (a sweep that
never did counts its whole run, marked ``*``). The goal is warm within
a third of cold's time in at least 8 of 10 task-seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import run_sampled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("classification", "classification10", "quantiles", "hastie", "digits")
WAYS = ("cold", "warm", "warm-best1")

SPACE_FILE = """
import numpy as np
import torch
from torch import nn
import hpsweep

def _xy():
    from sklearn import datasets
    task = {task!r}
    if task == "wine":
        x, y = datasets.load_wine(return_X_y=True)
    elif task == "digits":
        x, y = datasets.load_digits(return_X_y=True)
    elif task == "classification":
        x, y = datasets.make_classification(
            6000, 20, n_informative=10, n_classes=4, class_sep=2.0, random_state=0
        )
    elif task == "classification10":
        x, y = datasets.make_classification(
            6000, 40, n_informative=20, n_classes=10, class_sep=2.0, random_state=1
        )
    elif task == "quantiles":
        x, y = datasets.make_gaussian_quantiles(n_samples=6000, n_features=6, n_classes=3, random_state=0)
    else:
        x, y = datasets.make_hastie_10_2(6000, random_state=0)
        y = (y > 0).astype(int)
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    order = np.random.default_rng(0).permutation(len(y))
    return torch.tensor(x[order], dtype=torch.float32), torch.tensor(y[order])

X, Y = _xy()
CUT = int(0.7 * len(Y))
SHARE = {share}

def train_dataset():
    n = int(CUT * SHARE)
    return torch.utils.data.TensorDataset(X[:n], Y[:n])

def eval_dataset():
    return torch.utils.data.TensorDataset(X[CUT:], Y[CUT:])

class Net(nn.Module):
    def __init__(self, hidden, dropout, init_scale):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(X.shape[1], hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, int(Y.max()) + 1),
        )
        with torch.no_grad():  # too small: nothing trains in the epochs given; too large: diverges
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    layer.weight.mul_(init_scale)

    def forward(self, x, labels):
        logits = self.net(x)
        return {{"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}}

def model_init(trial):
    params = trial.params if trial is not None else {{}}
    return Net(params.get("hidden", 32), params.get("dropout", 0.0), params.get("init_scale", 1.0))

def compute_metrics(p):
    return {{"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}}

space = {space}
args = hpsweep.TrainingArguments(
    output_dir="out", num_train_epochs=8, per_device_train_batch_size=32, optim="sgd",
    per_device_eval_batch_size=2048, eval_strategy="epoch", save_strategy="epoch",
    save_total_limit=1, disable_progress=True,
)
objective = "eval_accuracy"
direction = "maximize"
"""

SHARED = (
    '"hidden": hpsweep.Int(16, 256, log=True), "init_scale": hpsweep.Float(1e-4, 1e2, log=True), '
    '"per_device_train_batch_size": hpsweep.Categorical([16, 32, 64, 128, 256])'
)
FIRST_SPACE = '{"learning_rate": hpsweep.Float(1e-6, 10.0, log=True), ' + SHARED + "}"
SECOND_SPACE = (
    '{"learning_rate": hpsweep.Float(1e-5, 10.0, log=True), '
    + SHARED
    + ', "dropout": hpsweep.Float(0.0, 0.3)}'
)


def sweep(space: Path, out: Path, trials: int, seed: int, extra: list[str]) -> dict:
    """One ``hpsweep run`` in a fresh process: its complete trials' times and its whole time,
    from its first trial's start (the process's start-up is the same for every way)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--n-trials", str(trials)]
    cmd += ["--seed", str(seed), "--output-dir", str(out), *extra]
    r = run_sampled(cmd, env=env, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in out.glob("*/trial.json")]
    t0 = min(rec["started_at"] for rec in records)
    done = sorted(
        (rec["finished_at"] - t0, rec["objective"]) for rec in records if rec["state"] == "complete"
    )
    return {"wall": max(rec["finished_at"] or t0 for rec in records) - t0, "done": done}


def task_seed(task: str, seed: int, first: int, trials: int, work: Path) -> dict[str, dict]:
    """The first sweep, then the second three ways, for one task and seed."""
    folder = work / f"{task}-{seed}"
    folder.mkdir(parents=True)
    spaces = {}
    for name, share, space in (("first", 0.5, FIRST_SPACE), ("second", 1.0, SECOND_SPACE)):
        spaces[name] = folder / f"{name}.py"
        spaces[name].write_text(SPACE_FILE.format(task=task, share=share, space=space))
    earlier = folder / "first"
    sweep(spaces["first"], earlier, first, seed, [])
    extras = {
        "cold": [],
        "warm": ["--warm-start", str(earlier)],
        "warm-best1": ["--warm-start", str(earlier), "--warm-start-best", "1"],
    }
    return {way: sweep(spaces["second"], folder / way, trials, seed, extras[way]) for way in WAYS}


def time_to(run: dict, target: float) -> tuple[float, bool]:
    """Seconds until the first complete trial at or above ``target``; the whole run if none."""
    for t, acc in run["done"]:
        if acc >= target:
            return t, True
    return run["wall"], False


def summarise(results: dict[str, dict[int, dict[str, dict]]]) -> str:
    lines = [
        "| task | seed | target | cold s | warm s | warm-best1 s | warm <= cold/3 "
        "| warm-best1 <= cold/3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    wins = {"warm": 0, "warm-best1": 0}
    count = 0
    for task, seeds in results.items():
        finals = [max(acc for _, acc in r["cold"]["done"]) for r in seeds.values()]
        target = statistics.median(finals) - 0.005
        for seed, ways in seeds.items():
            times = {way: time_to(ways[way], target) for way in WAYS}
            cold = times["cold"][0]
            cells = [f"{t:.1f}{'' if hit else '*'}" for t, hit in times.values()]
            goals = []
            for way in ("warm", "warm-best1"):
                met = times[way][1] and times[way][0] <= cold / 3
                wins[way] += met
                goals.append("yes" if met else "no")
            count += 1
            lines.append(
                f"| {task} | {seed} | {target:.4f} | {' | '.join(cells)} | {' | '.join(goals)} |"
            )
    lines.append(
        f"\nwarm within a third of cold's time: {wins['warm']} of {count} task-seeds; "
        f"warm-best1: {wins['warm-best1']} of {count} (* never reached the target: whole run)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="classification and digits, 2 seeds")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-trials", type=int, default=30)
    parser.add_argument("--trials", type=int, default=30, help="trials of each second sweep")
    parser.add_argument("--save", help="write the raw results to this JSON file")
    ns = parser.parse_args()
    tasks = ["classification", "digits"] if ns.quick else ns.tasks.split(",")
    results: dict[str, dict[int, dict[str, dict]]] = {task: {} for task in tasks}
    with tempfile.TemporaryDirectory(prefix="hpsweep-warm-bench-") as tmp:
        for seed in range(ns.seeds):  # seeds interleaved: every task's seed 0 first
            for task in tasks:
                results[task][seed] = task_seed(task, seed, ns.first_trials, ns.trials, Path(tmp))
                print(f"{task} seed {seed} done", file=sys.stderr, flush=True)
    if ns.save:
        Path(ns.save).write_text(json.dumps(results, indent=1))
    flags = "--quick" if ns.quick else f"--tasks {','.join(tasks)} --seeds {ns.seeds}"
    print(
        f"python bench/warm_start.py {flags} --first-trials {ns.first_trials} --trials {ns.trials}\n"
    )
    print(summarise(results))


if __name__ == "__main__":
    main()
