"""Thousands of tiny trials: does a trial cost the same at the end as at the start, in time and memory?

    python bench/scaling.py                      # 2,000 trials each side: about 5 minutes here
    python bench/scaling.py --trials 400         # a quick look

Two sides, one after the other, each one process on a journal-file study (hpsweep's default
storage) with the random sampler (so the sampler's own growth with the study does not hide
ours; TPE's grows with every trial):

- hpsweep: ``hpsweep.run`` on a space file whose trial is one step of a 4-8-2 MLP, one
  evaluation and one checkpoint, with its records, ``best/`` and the progress display;
- optuna: the peer, raw Optuna with a hand-written trial doing the same step and evaluation.

Per-trial time is the gap between consecutive trial ends (hpsweep: ``finished_at`` in the trial
records; optuna: ``datetime_complete``), as medians over the first and the last 10% of trials.
Per-trial CPU time is the process's CPU seconds over those windows divided by their trials (steady
on a shared machine, where wall time is not). RSS is sampled every 0.2 s: after the first 10% of
trials, and the peak.
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

TASK = """
import torch
from torch import nn
torch.set_num_threads(1)
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
"""

HPSWEEP = (
    TASK
    + """
import hpsweep
train_dataset = eval_dataset = data
model_init = Net
space = {"learning_rate": hpsweep.Float(1e-4, 1e-1, log=True)}
args = hpsweep.TrainingArguments(output_dir=OUT, max_steps=1, per_device_train_batch_size=64,
                                 per_device_eval_batch_size=64)
if __name__ == "__main__":
    hpsweep.run(__file__, n_trials=TRIALS, sampler="random", pruner="none")
"""
)

OPTUNA = (
    TASK
    + """
import os, optuna
optuna.logging.set_verbosity(optuna.logging.ERROR)
os.makedirs(OUT, exist_ok=True)

def objective(trial):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True))
    for xb, yb in torch.utils.data.DataLoader(data, batch_size=64, shuffle=True):
        model(xb, yb)["loss"].backward(); opt.step(); opt.zero_grad()
    with torch.no_grad():
        loss = float(model(x, (x.sum(1) > 0).long())["loss"])
    trial.report(loss, 1)
    torch.save(model.state_dict(), f"{OUT}/last.pt")
    return loss

storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{OUT}/study.journal"))
study = optuna.create_study(storage=storage, study_name="s",
                            sampler=optuna.samplers.RandomSampler())
study.optimize(objective, n_trials=TRIALS)
"""
)


def run(kind: str, trials: int, work: Path) -> dict:
    out = work / kind
    script = work / f"{kind}_task.py"
    script.write_text(
        f"TRIALS, OUT = {trials}, {str(out)!r}\n" + (HPSWEEP if kind == "hpsweep" else OPTUNA)
    )
    r = run_sampled([sys.executable, str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{r.stderr[-3000:]}")
    if kind == "hpsweep":
        ends = sorted(json.loads(p.read_text())["finished_at"] for p in out.glob("*/trial.json"))
    else:
        import optuna

        journal = optuna.storages.journal.JournalFileBackend(f"{out}/study.journal")
        study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(journal))
        ends = sorted(t.datetime_complete.timestamp() for t in study.trials)
    tenth = max(2, len(ends) // 10)
    first, last = ends[:tenth], ends[-tenth:]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    rss_early = next((rss for t, _, rss in r.samples if t >= ends[tenth]), r.peak_rss_mb)
    return {
        "trials": len(ends),
        "wall_first": statistics.median(gaps[:tenth]),
        "wall_last": statistics.median(gaps[-tenth:]),
        "cpu_first": (r.cpu_at(first[-1]) - r.cpu_at(first[0])) / (len(first) - 1),
        "cpu_last": (r.cpu_at(last[-1]) - r.cpu_at(last[0])) / (len(last) - 1),
        "rss_early": rss_early,
        "rss_peak": r.peak_rss_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=2000)
    ns = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("optuna", "hpsweep"):
            results[kind] = run(kind, ns.trials, Path(tmp))
            print(f"  {kind}: {results[kind]}", file=sys.stderr, flush=True)
    print(
        f"\n{ns.trials} trials per side, random sampler, journal-file study. Per trial: wall ms = median gap between "
        "trial ends, CPU ms = the process's CPU time over the window / trials in it; first and last 10% of trials"
    )
    print(
        "| side | trials | wall ms first | wall ms last | CPU ms first | CPU ms last | CPU last / first "
        "| RSS MB after 10% | peak RSS MB | peak / after 10% |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, r in results.items():
        print(
            f"| {kind} | {r['trials']} | {1000 * r['wall_first']:.1f} | {1000 * r['wall_last']:.1f} | "
            f"{1000 * r['cpu_first']:.1f} | {1000 * r['cpu_last']:.1f} | {r['cpu_last'] / r['cpu_first']:.2f}x | "
            f"{r['rss_early']:.0f} | {r['rss_peak']:.0f} | {r['rss_peak'] / r['rss_early']:.2f}x |"
        )
    h, o = results["hpsweep"], results["optuna"]
    print(
        f"\nhpsweep / optuna CPU per trial: first 10% {h['cpu_first'] / o['cpu_first']:.2f}x, "
        f"last 10% {h['cpu_last'] / o['cpu_last']:.2f}x"
    )
    print(f"reproduce: python bench/scaling.py --trials {ns.trials}")


if __name__ == "__main__":
    main()
