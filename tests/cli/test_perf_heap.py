"""``hpsweep run``'s start-up heap (hpsweep.cli.startup_heap): torch is frozen before the space file
runs; its trials run with the collector on and the start-up heap frozen, in ``--n-jobs`` workers
too, with what torch's first optimizer imports already there; what the space file left behind is
collected, not kept; a program that runs the command in its own process gets its collector back
as it was; the Python API leaves the collector alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from support import hpsweep_cli, write_space

PROBE = '''
import gc, json, os, sys, uuid, weakref

_frozen_at_load = gc.get_freeze_count()  # what the command froze before the user's code ran

class _Cycle:  # garbage a space file leaves: a reference cycle holding 10 MB, dropped once loaded
    pass
_cycle = _Cycle()
_cycle.itself, _cycle.payload = _cycle, bytearray(10_000_000)
_left_behind = weakref.ref(_cycle)
del _cycle

class Probe(hpsweep.TrainerCallback):
    """What a trial sees of the collector, before its optimizer is built."""
    def on_init_end(self, args, state, control, **kwargs):
        if not os.path.basename(args.output_dir).startswith("run-"):
            return  # the Trainer that holds the search, not a trial's
        with open(os.path.join({folder!r}, f"probe-{{uuid.uuid4().hex}}.json"), "w") as f:
            json.dump({{"pid": os.getpid(), "collecting": gc.isenabled(), "frozen": gc.get_freeze_count(),
                       "frozen_at_load": _frozen_at_load,
                       "optimizer_imports_done": "torch._dynamo" in sys.modules,
                       "space_file_garbage_kept": _left_behind() is not None}}, f)

callbacks = [Probe()]
'''


def _probes(folder):
    return [json.loads(p.read_text()) for p in sorted(folder.glob("probe-*.json"))]


def test_trials_of_the_command_run_on_a_frozen_start_up_heap_with_the_collector_on(tmp_path):
    probes = tmp_path / "probes"
    probes.mkdir()
    # trials that overlap
    space = write_space(tmp_path, epochs=20, extra=PROBE.format(folder=str(probes)))
    hpsweep_cli("run", space, "--n-trials", "4", "--n-jobs", "2", check=True)
    seen = _probes(probes)
    assert len(seen) == 4 and len({p["pid"] for p in seen}) == 2  # every trial, in both workers
    for p in seen:
        # torch's objects were frozen before the space file loaded: no collection scans them
        assert p["frozen_at_load"] > 100_000, p
        assert p["collecting"], p  # what trials make is collected
        # torch's, optuna's and the space file's objects are not scanned
        assert p["frozen"] > 10_000, p
        # no worker imports torch._dynamo again in its first trial
        assert p["optimizer_imports_done"], p
        assert not p["space_file_garbage_kept"], p  # collected before the heap was frozen


def test_a_program_gets_its_collector_back_and_the_python_api_leaves_it_alone(tmp_path):
    probes = tmp_path / "probes"
    probes.mkdir()
    space = write_space(tmp_path, extra=PROBE.format(folder=str(probes)))
    script = textwrap.dedent(f"""
        import gc, json, sys
        sys.argv = ["space"]
        import hpsweep, hpsweep.cli
        from hpsweep.search.space_file import load_space_file

        sf = load_space_file({str(space)!r})
        trainer = hpsweep.Trainer(model_init=sf.model_init, args=sf.args.replace(output_dir={str(tmp_path / "api")!r}),
                                  train_dataset=sf.train_dataset, eval_dataset=sf.eval_dataset,
                                  compute_metrics=sf.compute_metrics, callbacks=sf.callbacks)
        trainer.hyperparameter_search(space=sf.space, n_trials=1, direction="maximize", objective="eval_accuracy")
        after_api = (gc.isenabled(), gc.get_freeze_count())
        gc.disable()  # a program that runs with the collector off
        code = hpsweep.cli.main(["run", {str(space)!r}, "--n-trials", "1", "--output-dir", {str(tmp_path / "cli")!r}])
        print(json.dumps({{"after_api": after_api, "code": code, "after_cli": (gc.isenabled(), gc.get_freeze_count())}}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    assert out["after_api"] == [True, 0] and out["after_cli"] == [False, 0]
    api_trial, cli_trial = sorted(_probes(probes), key=lambda p: p["frozen"])
    # the API's trial: the user's collector as it was
    assert api_trial["frozen"] == 0 and api_trial["collecting"]
    # the command's trial, inside the program
    assert cli_trial["frozen"] > 10_000 and cli_trial["collecting"]
