"""The same sweep three ways, each in its own fresh process; prints wall times and ratios.

    python bench/core_overhead.py [--trials 10] [--epochs 20] [--repeats 3]

- hand: a hand-written torch loop driven by raw Optuna (in-memory study), evaluating every epoch.
- hand-sqlite: the same loop with an SQLite study and a trial.report every epoch (what a user
  writes for a study that survives a crash and can prune: hpsweep's default guarantees).
- hpsweep: ``hpsweep run`` with its defaults (SQLite study, a checkpoint every epoch, best/ kept).
- hpsweep-nosave: the same with ``--set save_strategy=no`` (one final checkpoint per trial).
- hf: Hugging Face ``Trainer.hyperparameter_search`` (optuna backend, in-memory study).

All train the same MLP on scikit-learn's digits with the same batch size, epochs and trial count;
only the learning rate is searched, so every trial does the same work whatever is sampled.
Wall time includes interpreter start and imports, as a user's run does. Variants run interleaved
(hand, hpsweep, ..., hand, hpsweep, ...) and the median of the repeats is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = '''
import numpy as np, torch
from torch import nn
torch.set_num_threads(1)

def load(part):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    rows = order[:1437] if part == "train" else order[1437:]
    return torch.utils.data.TensorDataset(torch.tensor(x[rows] / 16.0, dtype=torch.float32), torch.tensor(y[rows]))

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
'''

HAND = COMMON + '''
import optuna
optuna.logging.set_verbosity(optuna.logging.ERROR)
train, val = load("train"), load("eval")

def objective(trial):
    lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
    torch.manual_seed(42)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)
    total = EPOCHS * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    for epoch in range(EPOCHS):
        model.train()
        for x, y in loader:
            loss = model(x, y)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x, y)["logits"].argmax(-1) == y).sum())
                          for x, y in torch.utils.data.DataLoader(val, batch_size=256))
        acc = correct / len(val)
    return acc

optuna.create_study(direction="maximize").optimize(objective, n_trials=TRIALS)
'''

# The same loop with what a careful user adds for a study that survives a crash and can prune:
# an SQLite study and a report of every epoch's accuracy.
HAND_SQLITE = HAND.replace("        acc = correct / len(val)\n",
                           "        acc = correct / len(val)\n        trial.report(acc, epoch + 1)\n").replace(
    'optuna.create_study(direction="maximize")',
    'import os\nos.makedirs(OUT, exist_ok=True)\n'
    'optuna.create_study(direction="maximize", storage=f"sqlite:///{OUT}/study.db", study_name="hand")')

SPACE = COMMON + '''
import hpsweep
train_dataset = lambda: load("train")
eval_dataset = lambda: load("eval")
model_init = MLP

def compute_metrics(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}

space = {"learning_rate": hpsweep.Float(1e-4, 1e-1, log=True)}
args = hpsweep.TrainingArguments(output_dir=OUT, num_train_epochs=EPOCHS, per_device_train_batch_size=32,
                                 per_device_eval_batch_size=256)
objective, direction = "eval_accuracy", "maximize"
'''

HF = COMMON + '''
import os
from transformers import Trainer, TrainingArguments
import optuna
optuna.logging.set_verbosity(optuna.logging.ERROR)

def collate(rows):
    x, y = zip(*rows)
    return {"x": torch.stack(x), "labels": torch.stack(y)}

def compute_metrics(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}

args = TrainingArguments(output_dir=OUT, num_train_epochs=EPOCHS, per_device_train_batch_size=32,
                         per_device_eval_batch_size=256, learning_rate=1e-3, eval_strategy="epoch",
                         save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
                         use_cpu=True)
trainer = Trainer(model_init=lambda trial: MLP(), args=args, train_dataset=load("train"), eval_dataset=load("eval"),
                  data_collator=collate, compute_metrics=compute_metrics)
trainer.hyperparameter_search(hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-1, log=True)},
                              n_trials=TRIALS, direction="maximize", backend="optuna",
                              compute_objective=lambda m: m["eval_accuracy"])
'''


def run_variant(name: str, work: Path, trials: int, epochs: int) -> float:
    out = work / f"{name}-{time.monotonic_ns()}"
    header = f"TRIALS, EPOCHS, OUT = {trials}, {epochs}, {str(out)!r}\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if name == "hand":
        cmd = [sys.executable, "-c", header + HAND]
    elif name == "hand-sqlite":
        cmd = [sys.executable, "-c", header + HAND_SQLITE]
    elif name == "hf":
        cmd = [sys.executable, "-c", header + HF]
    else:
        space = work / f"space_{name}.py"
        space.write_text(header + SPACE)
        cmd = [sys.executable, "-m", "hpsweep.cli", "run", str(space), "--n-trials", str(trials), "--pruner", "none"]
        if name == "hpsweep-nosave":
            cmd += ["--set", "save_strategy=no"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=20)  # ~0.5 s trials for the hand loop here
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="hand,hand-sqlite,hpsweep,hpsweep-nosave,hf")
    ns = parser.parse_args()
    variants = ns.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.repeats):
            for v in variants:
                times[v].append(run_variant(v, Path(tmp), ns.trials, ns.epochs))
                print(f"  repeat {r + 1}: {v:<15} {times[v][-1]:6.2f} s", file=sys.stderr)
    base = statistics.median(times["hand"]) if "hand" in times else None
    print(f"\n{ns.trials} trials x {ns.epochs} epochs, median of {ns.repeats} fresh processes each")
    print(f"{'variant':<16}{'wall s':>8}{'per trial s':>13}{'vs hand':>9}")
    for v in variants:
        med = statistics.median(times[v])
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"{v:<16}{med:8.2f}{med / ns.trials:13.3f}{ratio:>9}")


if __name__ == "__main__":
    main()
