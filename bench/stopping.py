"""Does ``--stop-when`` save trials without losing the best? 60-trial sweeps with and without it.

    python bench/stopping.py --quick     # 2 task-seeds: full, regret and plateau sweeps (minutes)
    python bench/stopping.py             # 5 tasks x 2 seeds: 10 task-seeds (an hour or more here)

Tasks the defaults were not tuned on, from scikit-learn's bundled data sets (breast cancer, wine)
and its generators (make_classification twice, make_moons), each a small MLP searched over the
learning rate, weight decay, width and epochs, its objective the held-out accuracy. For each
task and seed, interleaved (every variant of seed 0, then seed 1), a fresh ``hpsweep run``
process per variant with one thread (OMP_NUM_THREADS=1, as bench/time_to_target.py):

- full: ``--n-trials 60``;
- regret / plateau: the same with ``--stop-when regret`` / ``--stop-when plateau``.

For each: the trials that finished, the process tree's CPU seconds (user + system), and the best
accuracy; for a stopped sweep, its best against the full sweep's in the same task-seed (points:
percent). Seeded, one trial at a time and deterministic training, a stopped sweep runs the full
sweep's first trials, so the replayed column (where the rule, judged on the full sweep's own
trials, would have stopped it) checks the real one. Writes bench/results/stopping.json (a run
with --tasks or another --n-trials writes only where --save says).

``--ratios 0.1,0.15,0.2`` also replays the regret rule with other ratios on the full sweeps'
trials. Its ratio was chosen that way on tasks that are not the benchmark's (iris, digits,
make_circles, make_gaussian_quantiles: ``--tasks iris,digits,circles,quantiles --seeds 4``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from hpsweep import runs  # noqa: E402
from hpsweep.search.stopping import Finished, Regret, parse_stop_when  # noqa: E402

TASKS = ("breast_cancer", "wine", "classification", "classification_hard", "moons")
#: The tasks the regret rule's ratio was chosen on (``--ratios``), none of the benchmark's.
TUNING = ("iris", "digits", "circles", "quantiles")
RULES = ("regret", "plateau")
N_TRIALS = 60

SPACE_FILE = """
import numpy as np
import torch
from torch import nn

import hpsweep

TASK = {task!r}


def _data():
    from sklearn import datasets

    if TASK == "breast_cancer":
        return datasets.load_breast_cancer(return_X_y=True)
    if TASK == "wine":
        return datasets.load_wine(return_X_y=True)
    if TASK == "moons":
        return datasets.make_moons(800, noise=0.3, random_state=0)
    if TASK == "iris":
        return datasets.load_iris(return_X_y=True)
    if TASK == "digits":
        return datasets.load_digits(return_X_y=True)
    if TASK == "circles":
        return datasets.make_circles(800, noise=0.2, factor=0.5, random_state=1)
    if TASK == "quantiles":
        return datasets.make_gaussian_quantiles(n_samples=1000, n_features=6, n_classes=3, random_state=1)
    hard = TASK == "classification_hard"
    return datasets.make_classification(
        1000, 20, n_informative=8 if hard else 5, n_classes=4 if hard else 3,
        flip_y=0.05, class_sep=0.8 if hard else 1.2, random_state=0,
    )


def _split(part):
    x, y = _data()
    x = (x - x.mean(0)) / (x.std(0) + 1e-8)
    order = np.random.default_rng(0).permutation(len(x))
    cut = int(0.7 * len(x))
    rows = order[:cut] if part == "train" else order[cut:]
    return torch.utils.data.TensorDataset(
        torch.tensor(x[rows], dtype=torch.float32), torch.tensor(y[rows], dtype=torch.long)
    )


def train_dataset():
    return _split("train")


def eval_dataset():
    return _split("eval")


class MLP(nn.Module):
    def __init__(self, inputs, classes, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return {{"logits": logits}}
        return {{"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}}


def model_init(trial):
    x, y = train_dataset().tensors
    params = trial.params if trial is not None else {{}}
    return MLP(x.shape[1], int(y.max()) + 1, hidden=params.get("hidden", 32))


def compute_metrics(p):
    return {{"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}}


space = {{
    "learning_rate": hpsweep.Float(1e-4, 3e-1, log=True),
    "weight_decay": hpsweep.Float(1e-6, 1e-1, log=True),
    "hidden": hpsweep.Int(4, 128, log=True),
    "num_train_epochs": hpsweep.Int(1, 8),
}}
args = hpsweep.TrainingArguments(
    output_dir="unused",
    per_device_train_batch_size=32,
    per_device_eval_batch_size=512,
    save_total_limit=1,
    disable_progress=True,
)
objective = "eval_accuracy"
direction = "maximize"
"""


def sweep(space: Path, out: Path, seed: int, rule: str | None, n_trials: int) -> dict[str, Any]:
    """One ``hpsweep run`` in a fresh process: its trials, CPU seconds and best accuracy."""
    command = [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--output-dir", str(out)]
    command += ["--n-trials", str(n_trials), "--seed", str(seed)]
    command += ["--stop-when", rule] if rule else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=out.parent)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    done = [r for r in runs.read_trials(out) if r.state in ("complete", "pruned")]
    done.sort(key=lambda r: (r.finished_at or 0, r.number))
    return {
        "trials": len(done),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "best": max(r.objective for r in done if r.objective is not None),
        "order": [[r.params, r.objective] for r in done],
        "last_line": proc.stderr.strip().splitlines()[-1],
    }


def replayed(order: list[list[Any]], rule: str, space: dict[str, Any]) -> int:
    """Where ``rule``, judged after each trial of a full sweep, would have stopped it."""
    judge = parse_stop_when(rule)
    trials = [Finished(params, value) for params, value in order]
    for n in range(1, len(trials) + 1):
        if judge.decide(trials[:n], True, 0, space):
            return n
    return len(trials)


def run(tasks: list[str], seeds: list[int], n_trials: int) -> list[dict[str, Any]]:
    from hpsweep.search.stopping import runs_space

    rows = []
    with tempfile.TemporaryDirectory(prefix="hpsweep-stopping-") as tmp:
        for seed in seeds:  # interleaved: every task and variant of one seed, then the next
            for task in tasks:
                space = Path(tmp, f"{task}.py")
                space.write_text(SPACE_FILE.format(task=task))
                row: dict[str, Any] = {"task": task, "seed": seed}
                for rule in (None, *RULES):
                    out = Path(tmp, f"{task}-{seed}-{rule or 'full'}")
                    row[rule or "full"] = sweep(space, out, seed, rule, n_trials)
                    print(task, seed, rule or "full", row[rule or "full"]["trials"], flush=True)
                bounds = runs_space(_space_of(space))
                row["space"] = bounds
                for rule in RULES:
                    row[rule]["replayed"] = replayed(row["full"]["order"], rule, bounds)
                rows.append(row)
    return rows


def _space_of(path: Path) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - our own file
    return namespace["space"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| rule | trials (median of {rows[0]['full']['trials']}) | CPU s (median, vs full) | best within 0.5 points "
        "| median gap (points) |",
        "|---|---|---|---|---|",
    ]
    for rule in RULES:
        trials = [r[rule]["trials"] for r in rows]
        cpu = [r[rule]["cpu_s"] / r["full"]["cpu_s"] for r in rows]
        gaps = [100 * (r["full"]["best"] - r[rule]["best"]) for r in rows]
        within = sum(g <= 0.5 for g in gaps)
        lines.append(
            f"| {rule} | {statistics.median(trials):g} | "
            f"{statistics.median(r[rule]['cpu_s'] for r in rows):.0f} "
            f"({statistics.median(cpu):.0%}) | {within} of {len(rows)} | "
            f"{statistics.median(gaps):.2f} |"
        )
    lines.append("")
    lines.append("| task | seed | full: trials, best | " + " | ".join(RULES) + " |")
    lines.append("|---|---|---|" + "---|" * len(RULES))
    for r in rows:
        cells = [
            f"{r[rule]['trials']} (replayed {r[rule]['replayed']}), {100 * r[rule]['best']:.1f}"
            for rule in RULES
        ]
        full = f"{r['full']['trials']}, {100 * r['full']['best']:.1f}"
        lines.append(f"| {r['task']} | {r['seed']} | {full} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]], candidates: list[float]) -> str:
    """For each candidate ratio of the regret rule, judged on the full sweeps' own trials: the
    median replayed stop and how many kept a best within 0.5 points of the full sweep's."""
    lines = ["| regret ratio | replayed stop (median) | best within 0.5 points |", "|---|---|---|"]
    for ratio in candidates:
        stops, within = [], 0
        for r in rows:
            order = r["full"]["order"]
            trials = [Finished(params, value) for params, value in order]
            rule = Regret(ratio=ratio)
            space = r["space"]
            n = next(
                (n for n in range(1, len(trials) + 1) if rule.decide(trials[:n], True, 0, space)),
                len(trials),
            )
            best = max(v for _, v in order[:n] if v is not None)
            stops.append(n)
            within += 100 * (r["full"]["best"] - best) <= 0.5
        lines.append(f"| {ratio:g} | {statistics.median(stops):g} | {within} of {len(rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 task-seeds, for a dry run")
    parser.add_argument("--tasks", help=f"comma-separated, of {', '.join(TASKS + TUNING)}")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 2; --quick 1)")
    parser.add_argument("--n-trials", type=int, default=N_TRIALS, help="each full sweep's trials")
    parser.add_argument(
        "--save",
        help="write the raw results here (default: bench/results/, "
        "for the default and --quick runs only)",
    )
    parser.add_argument("--ratios", help="also replay the regret rule with these ratios: 0.1,0.2")
    ns = parser.parse_args()
    tasks = ["wine", "classification_hard"] if ns.quick else list(TASKS)
    tasks = ns.tasks.split(",") if ns.tasks else tasks
    seeds = list(range(ns.seeds or (1 if ns.quick else 2)))
    rows = run(tasks, seeds, ns.n_trials)
    save = ns.save
    if save is None and ns.tasks is None and ns.n_trials == N_TRIALS:
        save = BENCH / "results" / ("stopping-quick.json" if ns.quick else "stopping.json")
    if save is not None:
        Path(save).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    if ns.ratios:
        print()
        print(ratios(rows, [float(v) for v in ns.ratios.split(",")]))


if __name__ == "__main__":
    main()
