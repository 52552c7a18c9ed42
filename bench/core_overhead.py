"""What a sweep costs beyond its training: hpsweep's defaults against a hand-written loop.

    python bench/core_overhead.py                  # --trials 10 --repeats 5, about 4 minutes here
    python bench/core_overhead.py --variants hand,hpsweep --repeats 3

The same sweep, each variant a fresh process (wall time includes interpreter start and imports,
as a user's run does), run interleaved (hand, hpsweep, hf, hand, hpsweep, hf, ...); a ratio is
taken within each round and the median of the rounds is reported, so load that drifts during
the run (a shared machine) moves both sides of a ratio alike.

- hand: the fair peer. A hand-written torch loop driven by raw Optuna with what hpsweep's
  defaults give: a study in Optuna's journal file, a ``trial.report`` of the accuracy every
  epoch, and a checkpoint every epoch (model, optimizer and scheduler state in one ``torch.save``).
- hpsweep: ``hpsweep run`` with its defaults (journal study, evaluation and a checkpoint every
  epoch, trial records, ``best/`` kept current), ``--pruner none`` so every trial trains fully
  on both sides.
- hpsweep-nosave: the same with ``--set save_strategy=no`` (one final checkpoint per trial).
- hpsweep-base (with ``--base TREE``): hpsweep's defaults from another checkout (before/after).
- hf: Hugging Face ``Trainer.hyperparameter_search`` (optuna backend, in-memory study,
  evaluation and a checkpoint every epoch), when transformers is installed.

The task is the issue's: a 32-64-2 MLP, 3 epochs of 112 steps (batch 32) on fixed synthetic data,
AdamW with a linear schedule and gradient clipping, 10 trials; only the learning rate is
searched, so every trial does the same work whatever is sampled. Torch runs one thread in
every variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import compile_sources  # noqa: E402

COMMON = """
import torch
from torch import nn
torch.set_num_threads(1)

def load(part):
    g = torch.Generator().manual_seed(1 if part == "train" else 2)
    x = torch.randn(3584 if part == "train" else 1024, 32, generator=g)
    y = (x @ torch.randn(32, 2, generator=torch.Generator().manual_seed(0))).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        widths, layers = [32, *HIDDEN], []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], 2))
    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
"""

HAND = (
    COMMON
    + """
import os, optuna
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
        trial.report(acc, epoch + 1)
        if PRUNER != "none" and epoch + 1 < EPOCHS and trial.should_prune():  # before its checkpoint, as hpsweep
            raise optuna.TrialPruned()
        folder = f"{OUT}/run-{trial.number}/checkpoint-{epoch + 1}"
        os.makedirs(folder, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                   f"{folder}/state.pt")
    return acc

os.makedirs(OUT, exist_ok=True)
storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{OUT}/study.journal"))
pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1) if PRUNER == "median"
          else optuna.pruners.NopPruner())
study = optuna.create_study(direction="maximize", storage=storage, study_name="hand", pruner=pruner,
                            sampler=optuna.samplers.TPESampler(seed=SEED))
study.optimize(objective, n_trials=TRIALS)
"""
)

SPACE = (
    COMMON
    + """
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
"""
)

HF = (
    COMMON
    + """
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
                         save_strategy="epoch", logging_strategy="epoch", report_to="none", disable_tqdm=True,
                         use_cpu=True)
trainer = Trainer(model_init=lambda trial: MLP(), args=args, train_dataset=load("train"), eval_dataset=load("eval"),
                  data_collator=collate, compute_metrics=compute_metrics)
trainer.hyperparameter_search(hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-1, log=True)},
                              n_trials=TRIALS, direction="maximize", backend="optuna",
                              compute_objective=lambda m: m["eval_accuracy"])
"""
)


def command(name: str, out: Path, ns: argparse.Namespace) -> list[str]:
    work = out.parent
    hidden = [int(w) for w in ns.hidden.split(",")]
    header = (
        f"TRIALS, EPOCHS, OUT, HIDDEN = {ns.trials}, {ns.epochs}, {str(out)!r}, {hidden!r}\n"
        f"PRUNER, SEED = {ns.pruner!r}, {ns.seed}\n"
    )
    if name == "hand":
        return [sys.executable, "-c", header + HAND]
    if name == "hf":
        return [sys.executable, "-c", header + HF]
    space = work / f"space_{name}_{time.monotonic_ns()}.py"
    space.write_text(header + SPACE)
    cmd = [
        sys.executable,
        "-m",
        "hpsweep.cli",
        "run",
        str(space),
        "--n-trials",
        str(ns.trials),
        "--pruner",
        ns.pruner,
        "--seed",
        str(ns.seed),
    ]
    # hpsweep, hpsweep-base
    return cmd + (["--set", "save_strategy=no"] if name == "hpsweep-nosave" else [])


def timed(cmd: list[str], pythonpath: str | None = None) -> tuple[float, float]:
    """Wall seconds, and CPU seconds (user + system, every thread) of one fresh process. CPU time
    is the steadier figure on a shared machine: waiting for a core another job holds costs wall
    time but no CPU time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    compile_sources()
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
        compile_sources(Path(pythonpath).resolve())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # Not run from the repository: `python -m` puts the working folder first on sys.path, which
    # would shadow PYTHONPATH (and hide --base).
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--hidden",
        default="64",
        help="the MLP's hidden widths, comma-separated (the issue's: 64); "
        "wider models make checkpoints cost more",
    )
    parser.add_argument(
        "--pruner",
        choices=("none", "median"),
        default="none",
        help="none (the issue's: every trial trains fully) or median (hpsweep's default pruner, "
        "also in the hand loop, which asks it before each checkpoint)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed, on both sides")
    has_hf = importlib.util.find_spec("transformers") is not None
    parser.add_argument(
        "--variants",
        default="hand,hpsweep,hpsweep-nosave" + (",hf" if has_hf else ""),
        help="comma-separated; the first is the peer every ratio divides by",
    )
    parser.add_argument(
        "--base",
        metavar="TREE",
        help="a checkout of an earlier hpsweep: adds the variant "
        "hpsweep-base, its defaults run from that tree, for before/after in one run",
    )
    ns = parser.parse_args()
    variants = ns.variants.split(",") + (["hpsweep-base"] if ns.base else [])
    unknown = set(variants) - {"hand", "hf", "hpsweep", "hpsweep-nosave", "hpsweep-base"}
    if unknown or ("hpsweep-base" in variants and not ns.base):
        parser.error(
            f"unknown variants {sorted(unknown)}: use hand, hpsweep, hpsweep-nosave, hf; --base TREE "
            "adds hpsweep-base"
            if unknown
            else "hpsweep-base needs --base TREE"
        )
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    disk: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.repeats):
            for v in variants:
                out = Path(tmp) / f"{v}-{r}"
                w, c = timed(command(v, out, ns), ns.base if v == "hpsweep-base" else None)
                wall[v].append(w)
                cpu[v].append(c)
                disk[v].append(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20)
                shutil.rmtree(out)
                print(
                    f"  round {r + 1}: {v:<15} {w:6.2f} s wall {c:6.2f} s CPU {disk[v][-1]:8.1f} MB on disk",
                    file=sys.stderr,
                    flush=True,
                )
    peer = variants[0]
    print(
        f"\n{ns.trials} trials x {ns.epochs} epochs; {ns.repeats} interleaved rounds of fresh processes; "
        f"ratio = median over rounds of (variant / {peer} in the same round)"
    )
    print(
        f"| variant | median wall s | wall vs {peer} | min-max | median CPU s | CPU vs {peer} | min-max "
        "| MB left on disk |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        rw = [a / b for a, b in zip(wall[v], wall[peer])]
        rc = [a / b for a, b in zip(cpu[v], cpu[peer])]
        print(
            f"| {v} | {statistics.median(wall[v]):.2f} | {statistics.median(rw):.2f}x | {min(rw):.2f}-{max(rw):.2f} "
            f"| {statistics.median(cpu[v]):.2f} | {statistics.median(rc):.2f}x | {min(rc):.2f}-{max(rc):.2f} "
            f"| {statistics.median(disk[v]):.1f} |"
        )
    base = f" --base {ns.base}" if ns.base else ""
    print(
        f"\nreproduce: python bench/core_overhead.py --trials {ns.trials} --epochs {ns.epochs} "
        f"--repeats {ns.repeats} --variants {ns.variants} --hidden {ns.hidden} --pruner {ns.pruner} "
        f"--seed {ns.seed}{base}"
    )


if __name__ == "__main__":
    main()
