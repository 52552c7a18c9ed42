"""Settings for the whole suite: the terminal's Ctrl-C for the commands the tests start, the one
allowed skip (tests that need CUDA), and the fixtures every folder uses. The helpers the tests
share are in `support`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support import write_space

# The Ctrl-C tests send SIGINT to the commands they start, as a terminal does. A shell that runs the
# suite in the background without job control starts it with SIGINT ignored; the commands would
# inherit that, and Python installs no KeyboardInterrupt handler in a process that starts so. A
# handled signal is reset to its default in a child, so handling it here gives every command the
# terminal's Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: The test files of the slow tier: they start servers, clusters or many machines, or wait out a
#: heartbeat's grace. ``pytest -m "not slow" -n 2`` runs the rest, the fast tier, in a few minutes
#: (docs/getting-started.md); CI runs both.
SLOW_FILES = frozenset(
    {
        "search/test_preemption.py",
        "search/test_many_machines.py",
        "search/test_ledger_cost.py",
        "search/test_contract.py",
        "search/test_faults.py",
        "search/test_outside_writers.py",
        "search/backends/test_ray.py",
        "search/backends/test_ray_storage.py",
        "search/backends/test_wandb.py",
        "search/backends/test_storages.py",
        "integrations/test_mlflow.py",
        "integrations/test_report_to.py",
        "train/test_hf_search.py",
        "devices/test_data_parallel.py",
        "cli/test_object_store_home.py",
        "test_bench.py",
    }
)
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier's files get the ``slow`` mark; tests marked ``gpu`` need CUDA: the one kind of
    test skipped where it is missing (CI)."""
    import torch

    slow = pytest.mark.slow
    for item in items:
        if item.path.relative_to(TESTS).as_posix() in SLOW_FILES:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_cuda)


@pytest.fixture
def space_file(tmp_path: Path) -> Path:
    return write_space(tmp_path)


@pytest.fixture(scope="session")
def pg():
    """A real PostgreSQL server on 127.0.0.1 (`support.postgres`), one per test process; each test
    makes its own database with ``pg.create_database(name)``."""
    from support.postgres import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture(scope="session")
def mariadb():
    """A real MariaDB server on 127.0.0.1 (`support.mariadb`), for the ``mysql+pymysql://``
    storage; each test makes its own database with ``mariadb.create_database(name)``."""
    from support.mariadb import mariadb_server

    with mariadb_server() as server:
        yield server


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B without a login: its runs offline, its own files under this test's folder."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    for name, sub in {
        "WANDB_DIR": "",
        "WANDB_CONFIG_DIR": "config",
        "WANDB_CACHE_DIR": "cache",
    }.items():
        (home / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(name, str(home / sub))
    monkeypatch.setenv("NETRC", str(home / "netrc"))
