"""Per-trial overhead of hpsweep's Ray backend against bare Ray Tune, in the same run.

    python bench/ray_overhead.py --trials 20 --concurrency 2

Both sides share one local Ray instance and run N trivial trials with the same concurrency:

- bare:    a Ray Tune function trainable that reports one metric once (Tune's defaults, as a
           user would write it; also with ``reuse_actors=True``, which hpsweep uses);
- hpsweep: ``hpsweep.run(space.py, backend="ray")`` on a space file whose "training" is one step
           of a 1-parameter model on 1 sample: what is left is hpsweep's own per-trial work
           (trainer set-up, one checkpoint reported to Tune, trial.json, the best-run promotion).

Prints seconds per trial for each, the ratio, and splits hpsweep's time into what Ray costs and
what hpsweep adds (the time spent inside our trial function, from the trial.json records).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SPACE = '''
import torch
import hpsweep

class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x, y):
        return {"loss": ((self.w * x - y) ** 2).mean()}

def data():
    return torch.utils.data.TensorDataset(torch.ones(1, 1), torch.ones(1, 1))

model_init = lambda: One()
train_dataset = data
eval_dataset = data
space = {"learning_rate": hpsweep.Float(1e-3, 1e-1, log=True)}
args = hpsweep.TrainingArguments(output_dir="unused", num_train_epochs=1, per_device_train_batch_size=1,
                                 per_device_eval_batch_size=1, save_strategy="no", logging_strategy="no",
                                 disable_progress=True)
'''


def bare(n: int, concurrency: int, storage: Path, reuse: bool) -> float:
    from ray import tune

    def trainable(config: dict) -> None:
        tune.report({"objective": config["x"]})

    tuner = tune.Tuner(trainable, param_space={"x": tune.uniform(0, 1)},
                       tune_config=tune.TuneConfig(num_samples=n, max_concurrent_trials=concurrency,
                                                   metric="objective", mode="min", reuse_actors=reuse),
                       run_config=tune.RunConfig(name=f"bare-{reuse}", storage_path=str(storage), verbose=0))
    start = time.perf_counter()
    tuner.fit()
    return (time.perf_counter() - start) / n


def ours(n: int, concurrency: int, folder: Path, reuse: bool = False) -> tuple[float, float]:
    import hpsweep
    from hpsweep import runs

    space = folder / "space.py"
    space.write_text(SPACE)
    out = folder / "hpsweep-out"
    start = time.perf_counter()
    hpsweep.run(space, backend="ray", n_trials=n, n_jobs=concurrency, output_dir=out, sampler="random",
                show_progress=False, reuse_actors=reuse)
    per_trial = (time.perf_counter() - start) / n
    inside = statistics.mean(r.duration_s for r in runs.read_trials(out))
    return per_trial, inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    ns = parser.parse_args()

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # the same for both sides
    import ray

    ray.init(address="local", num_cpus=ns.cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.ERROR, log_to_driver=False,
             runtime_env={"env_vars": {"TUNE_FUNCTION_THREAD_TIMEOUT_S": "60"}})
    with tempfile.TemporaryDirectory(prefix="hpbench") as tmp:
        folder = Path(tmp)
        # Warm both paths once (imports, worker start), so neither side pays first-use costs.
        bare(2, ns.concurrency, folder / "warm", reuse=False)
        warm = folder / "warm-ours"
        warm.mkdir()
        ours(2, ns.concurrency, warm)

        bare_default = bare(ns.trials, ns.concurrency, folder / "ray", reuse=False)
        bare_reuse = bare(ns.trials, ns.concurrency, folder / "ray", reuse=True)
        run_dir = folder / "ours"
        run_dir.mkdir()
        ours_per_trial, inside = ours(ns.trials, ns.concurrency, run_dir)
        reuse_dir = folder / "ours-reuse"
        reuse_dir.mkdir()
        ours_reuse, inside_reuse = ours(ns.trials, ns.concurrency, reuse_dir, reuse=True)
    ray.shutdown()

    ratio = ours_per_trial / bare_default
    print(f"trials={ns.trials} concurrency={ns.concurrency} cpus={ns.cpus} ray={ray.__version__}")
    print(f"bare Ray Tune (defaults):          {bare_default:.3f} s/trial")
    print(f"bare Ray Tune (reuse_actors=True): {bare_reuse:.3f} s/trial")
    print(f"hpsweep --backend ray:             {ours_per_trial:.3f} s/trial  ratio {ratio:.2f} vs bare defaults, "
          f"{ours_per_trial / bare_reuse:.2f} vs bare with reuse")
    print(f"hpsweep, reuse_actors=True:        {ours_reuse:.3f} s/trial  ratio {ours_reuse / bare_reuse:.2f} vs bare "
          f"with reuse (inside the trial: {inside_reuse:.3f} s)")
    print(f"  of which inside the trial (trainer, checkpoint, trial.json, best/): {inside:.3f} s "
          f"(wall share with {ns.concurrency} at once: {inside / ns.concurrency:.3f} s/trial)")
    print(f"  Ray itself (scheduling, actors, results): {bare_default:.3f} s/trial with Tune's defaults")
    sys.exit(0)


if __name__ == "__main__":
    main()
