"""``HPSWEEP_STORAGE``: the study's database URL from the environment (a Kubernetes Secret, in
deploy/k8s-optuna-workers.yaml), never printed with its password, and ``--storage`` wins over it."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from support import hpsweep_cli, write_space
from support.postgres import PASSWORD, postgres_server


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


def _everything_written(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_the_study_goes_to_the_database_the_variable_names(tmp_path: Path, postgres) -> None:
    url = postgres.create_database("from_env")
    space = write_space(tmp_path, epochs=1)
    proc = hpsweep_cli(
        "run", space, "--n-trials", "2", "--study-name", "env", env={"HPSWEEP_STORAGE": url}
    )
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="env", storage=url)
    assert len([t for t in study.trials if t.state.is_finished()]) == 2
    out = tmp_path / "out"
    assert not (out / "study.journal").exists()  # not the embedded default
    assert PASSWORD not in proc.stdout + proc.stderr + _everything_written(out)


def test_a_refused_login_is_one_line_without_the_password(tmp_path: Path, postgres) -> None:
    wrong = "wrong-pass-9f3k"
    url = f"postgresql://hp:{wrong}@127.0.0.1:{postgres.port}/sweeps"
    proc = hpsweep_cli(
        "run", write_space(tmp_path), "--n-trials", "1", env={"HPSWEEP_STORAGE": url}
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    # the line names what the user set, where they can fix it
    assert f"HPSWEEP_STORAGE=postgresql://hp:***@127.0.0.1:{postgres.port}/sweeps" in proc.stderr
    assert "--storage" not in proc.stderr
    assert wrong not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_malformed_url_in_the_variable_is_named_by_the_variable(tmp_path: Path) -> None:
    proc = hpsweep_cli(
        "run",
        write_space(tmp_path),
        "--n-trials",
        "1",
        env={"HPSWEEP_STORAGE": "hp:secret-pw-77@127.0.0.1:5432"},
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("hpsweep: error: HPSWEEP_STORAGE=hp:***@127.0.0.1:5432 names a server")
    assert "--storage" not in line and "secret-pw-77" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_flag_wins_over_the_variable(tmp_path: Path) -> None:
    journal = tmp_path / "flag.journal"
    proc = hpsweep_cli(
        "run",
        write_space(tmp_path, epochs=1),
        "--n-trials",
        "1",
        "--storage",
        journal,
        env={"HPSWEEP_STORAGE": "postgresql://hp:x@127.0.0.1:1/nowhere"},
    )
    assert proc.returncode == 0, proc.stderr
    assert journal.stat().st_size > 0
