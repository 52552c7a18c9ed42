"""Files and folders a sweep writes get the modes a plain ``open()``/``mkdir`` would give under the
process's umask, so other users of a shared sweep folder can read them and nobody else can write
them. Writing them never changes the umask, from any number of threads at once."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest
import torch

import hpsweep
from hpsweep.runs import _atomic


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


@pytest.mark.parametrize("reader", ["proc", "set-and-restore"])
def test_threads_writing_at_once_keep_the_umask(
    tmp_path: Path, umask_027: int, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where /proc does not report the umask it is read by setting it and setting it back; two
    # threads doing that at once used to leave it at 0, so every later file was world-writable.
    if reader == "set-and-restore":
        monkeypatch.setattr(_atomic, "_umask_from_proc", lambda: None, raising=False)
    interval = sys.getswitchinterval()
    # switch threads as often as possible, to hit the window if there is one
    sys.setswitchinterval(1e-6)
    try:

        def writer(n: int) -> None:
            for i in range(3000):
                _atomic._umask()  # what every atomic write and checkpoint folder asks
                if i % 100 == 0:
                    _atomic.write_text(tmp_path / f"t{n}" / f"{i}.json", "{}")

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert os.umask(umask_027) == umask_027  # unchanged
    modes = {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("t*/*.json")}
    assert modes == {0o666 & ~umask_027}


def test_a_checkpoint_folder_gets_the_modes_open_and_mkdir_give(
    tmp_path: Path, umask_027: int
) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    folder = hpsweep.runs.write_checkpoint(
        tmp_path / "checkpoint-1",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state={"global_step": 1},
        args={},
    )
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask_027  # not mkdtemp's 0700
    files = list(folder.iterdir())
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask_027}
