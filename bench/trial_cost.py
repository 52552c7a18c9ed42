"""What one trial of the digits search costs, the search left out: the same trials, timed per trial.

    python bench/trial_cost.py                       # 3 rounds x 5 seeds, about 5 minutes here
    python bench/trial_cost.py --base /path/to/checkout-of-an-earlier-commit

time_to_target.py races whole searches, where which params come up decides more than what a
trial costs. Here the search is the same everywhere: the first 10 trials of a seeded TPE study are
its random start-up draws, the same params for every variant of one seed (checked). Every variant
trains those 10 trials fully (no pruning) in a fresh process; the figure is the wall time from the
end of trial 0 to the end of trial 9 (9 trials, no process start, no imports), per seed, interleaved:

- hpsweep: ``hpsweep run search_spaces/digits_mlp.py --pruner none`` at its defaults (a study in a
  journal file, evaluation and a checkpoint every epoch, trial records, ``best/``);
- hpsweep-nosave: the same with ``--set save_strategy=no`` (one checkpoint, at the end of each trial);
- hpsweep-model-only: the same with ``--set save_only_model=true`` (every checkpoint the model alone);
- hpsweep-base (with ``--base TREE``): the same, run from another checkout, for before/after;
- hand: time_to_target.py's hand loop (``bench/_tasks.py``): in-memory study, torch's default AdamW
  kernel, evaluation every epoch, no checkpoint;
- hand-fused: the same with ``AdamW(fused=True)``, the kernel hpsweep's default optimizer runs;
- hand-durable: hand-fused plus what hpsweep keeps on disk: the study in Optuna's journal file
  (``trial.report`` each epoch) and a checkpoint every epoch (weights as safetensors; optimizer,
  scheduler and RNG state with ``torch.save``), in a folder per trial.

Reported: per-trial milliseconds (median over seeds and rounds) and each variant's ratio to
hpsweep, taken per (round, seed) and then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import compile_sources  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TRIALS = 10  # TPE's random start-up: the same params in every variant

HAND = """
import json, os, random, sys, time
sys.path.insert(0, {bench!r})
import numpy as np, torch, optuna, _tasks
optuna.logging.set_verbosity(optuna.logging.ERROR)
TASK, OUT, DURABLE = _tasks.get("digits"), {out!r}, {durable!r}
rows = []

def checkpoint(folder, model, opt, sched):
    from safetensors.torch import save_file
    os.makedirs(folder)
    save_file(model.state_dict(), f"{{folder}}/model.safetensors")
    torch.save(opt.state_dict(), f"{{folder}}/optimizer.pt")
    torch.save(sched.state_dict(), f"{{folder}}/scheduler.pt")
    torch.save({{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}},
               f"{{folder}}/rng_state.pth")

def objective(trial):
    params = _tasks.suggest(trial, TASK.space)
    def report(epoch, acc):
        if DURABLE:
            trial.report(acc, epoch)
        return False
    hooks = {{"checkpoint": lambda epoch, m, o, s: checkpoint(f"{{OUT}}/run-{{trial.number}}/checkpoint-{{epoch}}", m, o, s)}} \\
        if DURABLE else {{}}
    acc = _tasks.hand_train(TASK, params, report, fused={fused!r}, **hooks)
    rows.append({{"params": params, "finished_at": time.time()}})
    return acc

os.makedirs(OUT, exist_ok=True)
storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{{OUT}}/study.journal")) \\
    if DURABLE else None
study = optuna.create_study(direction="maximize", storage=storage, sampler=optuna.samplers.TPESampler(seed={seed}))
study.optimize(objective, n_trials={trials})
with open(f"{{OUT}}/rows.json", "w") as f:
    json.dump(rows, f)
"""


def run(variant: str, seed: int, work: Path, base: str | None) -> list[dict]:
    """The variant's trials, in order: params and when each finished (time.time())."""
    out = work / f"{variant}-{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if variant.startswith("hpsweep"):
        tree = Path(base).resolve() if variant == "hpsweep-base" else ROOT
        env["PYTHONPATH"] = str(tree)
        compile_sources(tree)
        cmd = [
            sys.executable,
            "-m",
            "hpsweep.cli",
            "run",
            str(tree / "search_spaces" / "digits_mlp.py"),
            "--n-trials",
            str(TRIALS),
            "--seed",
            str(seed),
            "--pruner",
            "none",
            "--output-dir",
            str(out),
        ]
        cmd += {
            "hpsweep-nosave": ["--set", "save_strategy=no"],
            "hpsweep-model-only": ["--set", "save_only_model=true"],
        }.get(variant, [])
    else:
        fused = None if variant == "hand" else True
        cmd = [
            sys.executable,
            "-c",
            HAND.format(
                bench=str(BENCH),
                out=str(out),
                durable=variant == "hand-durable",
                fused=fused,
                seed=seed,
                trials=TRIALS,
            ),
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{variant}, seed {seed} failed:\n{proc.stderr[-4000:]}")
    if variant.startswith("hpsweep"):
        records = [json.loads(p.read_text()) for p in out.glob("run-*/trial.json")]
        rows = [
            {"params": r["params"], "finished_at": r["finished_at"]}
            for r in sorted(records, key=lambda r: r["number"])
        ]
    else:
        rows = json.loads((out / "rows.json").read_text())
    shutil.rmtree(out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="hpsweep,hpsweep-nosave,hand,hand-fused,hand-durable",
        help="comma-separated; ratios are to hpsweep",
    )
    parser.add_argument(
        "--base", metavar="TREE", help="a checkout of an earlier hpsweep: adds hpsweep-base"
    )
    ns = parser.parse_args()
    variants = ns.variants.split(",") + (["hpsweep-base"] if ns.base else [])
    per_trial: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for seed in range(ns.seeds):
                params = None
                for v in variants:
                    rows = run(v, seed, Path(tmp), ns.base)
                    drawn = [
                        {
                            k: round(x, 9) if isinstance(x, float) else x
                            for k, x in row["params"].items()
                        }
                        for row in rows
                    ]
                    if params is not None and drawn != params:
                        raise SystemExit(
                            f"seed {seed}: {v} drew other params than {variants[0]}; the comparison "
                            "needs the same trials"
                        )
                    params = drawn
                    per_trial[v].append(
                        (rows[-1]["finished_at"] - rows[0]["finished_at"]) / (len(rows) - 1)
                    )
                line = "  ".join(f"{v} {1e3 * per_trial[v][-1]:6.1f}" for v in variants)
                print(
                    f"round {r + 1} seed {seed}: ms per trial  {line}", file=sys.stderr, flush=True
                )
    print(
        f"\nms per trial, trials 1-9 of {TRIALS} (the same params everywhere), {ns.rounds} rounds x {ns.seeds} seeds"
    )
    print("| variant | median ms per trial | vs hpsweep (median of per-seed ratios) | min-max |")
    print("| --- | ---: | ---: | ---: |")
    for v in variants:
        ratios = [a / b for a, b in zip(per_trial[v], per_trial["hpsweep"])]
        print(
            f"| {v} | {1e3 * statistics.median(per_trial[v]):.1f} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f} |"
        )
    base = f" --base {ns.base}" if ns.base else ""
    print(
        f"\nreproduce: python bench/trial_cost.py --rounds {ns.rounds} --seeds {ns.seeds} --variants {ns.variants}{base}"
    )


if __name__ == "__main__":
    main()
