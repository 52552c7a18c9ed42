"""What ``hpsweep run`` spends before and after its trials, counted, never timed
(bench/startup.py measures the CPU): a trial imports torch._dynamo when its optimizer asks for it,
not before; a study in a journal file imports no SQL library; the command's process exits with
its start-up heap still frozen; a study in PostgreSQL is opened as bare Optuna opens one, once
(no more connections, no more statements), and tables of another schema are one line with the
fix."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine
from support import hpsweep_cli, write_space
from support.postgres import PASSWORD

from hpsweep.search.backends._optuna._storages import open_storage, parse_storage

PROBE = """
import atexit, gc, json, os, sys

def _seen(moment):
    with open(os.path.join({folder!r}, moment + ".json"), "w") as f:
        json.dump({{"modules": sorted(m for m in sys.modules if m.split(".")[0] in
                   ("torch", "alembic", "sqlalchemy")), "frozen": gc.get_freeze_count()}}, f)

class Probe(hpsweep.TrainerCallback):
    def on_init_end(self, args, state, control, **kwargs):
        if os.path.basename(args.output_dir).startswith("run-"):  # the trial's Trainer
            _seen("trial_start")

    def on_train_begin(self, args, state, control, **kwargs):
        _seen("optimizer_built")

atexit.register(_seen, "exit")
callbacks = [Probe()]
"""


def test_a_one_trial_command_imports_what_its_trial_needs_when_it_needs_it(tmp_path: Path) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    space = write_space(tmp_path, epochs=1, extra=PROBE.format(folder=str(probes)))
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    seen = {p.stem: json.loads(p.read_text()) for p in probes.glob("*.json")}
    start, built = set(seen["trial_start"]["modules"]), set(seen["optimizer_built"]["modules"])
    # nothing imports torch._dynamo before the trial's optimizer does, as in a torch program
    assert "torch._dynamo" not in start and "torch._dynamo" in built
    # a journal file needs no SQL library (nor Optuna's schema migrations)
    assert not {m for m in seen["exit"]["modules"] if m.startswith(("alembic", "sqlalchemy"))}
    # the process exits with torch's objects frozen: its shutdown does not collect them
    assert seen["exit"]["frozen"] > 100_000


def _opening(url: str, open_it) -> tuple[int, int]:
    """(connections, statements) that ``open_it(url)`` sends the database, and closes them."""
    counts = {"connect": 0, "before_cursor_execute": 0}

    def counter(name: str):
        def count(*_args, **_kwargs) -> None:
            counts[name] += 1

        return count

    listeners = [(name, counter(name)) for name in counts]
    for name, fn in listeners:
        event.listen(Engine, name, fn)
    try:
        open_it(url).engine.dispose()
    finally:
        for name, fn in listeners:
            event.remove(Engine, name, fn)
    return counts["connect"], counts["before_cursor_execute"]


@pytest.mark.slow
def test_a_worker_opens_an_existing_study_database_as_bare_optuna_does(pg) -> None:
    url = pg.create_database("opened")
    optuna.storages.RDBStorage(url).engine.dispose()  # a sweep's first process made the tables
    spec = parse_storage(url, Path("."))
    ours = _opening(url, lambda _: open_storage(spec))
    bare = _opening(url, optuna.storages.RDBStorage)
    assert ours[0] <= bare[0] and ours[1] <= bare[1], (ours, bare)


@pytest.mark.slow
def test_tables_of_another_optuna_schema_are_one_line_with_the_fix(pg, tmp_path: Path) -> None:
    url = pg.create_database("oldschema")
    storage = optuna.storages.RDBStorage(url)
    older = storage.get_all_versions()[1]
    storage.engine.dispose()
    pg.sql(f"UPDATE alembic_version SET version_num = '{older}'", "oldschema")
    space = write_space(tmp_path, epochs=1)
    proc = hpsweep_cli("run", space, "--n-trials", "1", "--storage", url)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and f"schema {older}" in line, line
    assert "optuna storage upgrade" in line and PASSWORD not in line
    assert not (tmp_path / "out").exists()
