"""Settings for the ported transformers tests: W&B runs offline, with no login and nothing written
outside the test's temporary folders; Ray starts its own local instance."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "wandb-home"
    home.mkdir()
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_API_KEY": "",
        "WANDB_DIR": str(home),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "NETRC": str(home / ".netrc"),
    }.items():
        monkeypatch.setenv(name, value)
