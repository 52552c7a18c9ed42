"""`hpsweep report DIR`: one self-contained HTML page, checked in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support import hpsweep_cli, write_space

PLOTS = ("history", "importances", "parallel", "intermediate")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise AssertionError("headless Chromium is needed: apt-get install -y chromium")


def _browse(page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--virtual-time-budget=8000",
            *extra,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _sections(dom: str) -> dict[str, str]:
    parts = re.split(r'<section id="([\w-]+)"', dom)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("report")
    # Random sampling over a wide learning-rate range (seed 1) prunes some trials before their last
    # evaluation, which is never offered for pruning.
    space = write_space(
        folder,
        epochs=3,
        extra_args=', eval_strategy="epoch", save_strategy="epoch"',
        space='{"learning_rate": hpsweep.Float(1e-5, 3e-1, log=True), "hidden": hpsweep.Int(8, 32, step=8)}',
    )
    hpsweep_cli("run", space, "--n-trials", "6", "--seed", "1", "--sampler", "random", check=True)
    return folder / "out"


def test_report_renders_every_plot_in_a_browser(sweep: Path, tmp_path: Path) -> None:
    proc = hpsweep_cli("report", sweep, check=True)
    page = sweep / "report.html"
    assert proc.stdout.strip() == str(page)
    html = page.read_text()
    assert html.count("plotly.js v") == 1  # plotly.js inlined once
    assert not re.search(r"<script[^>]+src=", html)  # and nothing fetched: the page works offline

    dom = _browse(page, tmp_path, "--dump-dom").stdout
    sections = _sections(dom)
    for pid in PLOTS:
        assert pid in sections, f"no {pid} section"
        assert 'class="main-svg"' in sections[pid], f"the {pid} plot did not render"
    records = [json.loads(p.read_text()) for p in sweep.glob("run-*/trial.json")]
    best = json.loads((sweep / "best_run.json").read_text())
    table = sections["trials"]
    assert table.count("<tr") == len(records) + 1
    assert f"{Path(best['run_dir']).name} ★" in table
    assert any(r["state"] == "pruned" for r in records) and "pruned" in table
    assert f"{best['objective']:.6g}" in sections["best"]

    shot = tmp_path / "report.png"
    _browse(page, tmp_path, "--window-size=1280,3200", f"--screenshot={shot}")
    assert shot.stat().st_size > 50_000  # a page of plots, not a blank one


def test_report_works_from_disk_alone_for_any_backend(sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "sweep"
    shutil.copytree(
        sweep,
        copy,
        ignore=shutil.ignore_patterns("study.journal", ".study.journal.lock", "report.html"),
    )
    for path in copy.glob("run-*/trial.json"):  # as a Ray sweep leaves it: no Optuna study on disk
        record = json.loads(path.read_text())
        record["backend"] = "ray"
        path.write_text(json.dumps(record))
    out = tmp_path / "page.html"
    hpsweep_cli("report", copy, "--output", out, check=True)
    sections = _sections(_browse(out, tmp_path, "--dump-dom").stdout)
    assert all('class="main-svg"' in sections[pid] for pid in PLOTS)
    assert "backend ray" in out.read_text()


def test_one_trial_reports_what_it_can(tmp_path: Path) -> None:
    space = write_space(tmp_path, epochs=1)
    hpsweep_cli("run", space, "--n-trials", "1", check=True)
    proc = hpsweep_cli("report", tmp_path / "out", check=True)
    sections = _sections(_browse(Path(proc.stdout.strip()), tmp_path, "--dump-dom").stdout)
    assert "at least 2 complete trials" in sections["importances"]
    assert 'class="main-svg"' in sections["history"]


def test_report_of_a_folder_without_trials_is_one_line(tmp_path: Path) -> None:
    proc = hpsweep_cli("report", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no trials found" in proc.stderr
