"""Atomic writes: a file or a folder is written under a temporary name and renamed into place,
so a crash leaves the old version or the new one, never half of one."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

# --- atomic writes -------------------------------------------------------------------------------


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then rename),
    with the permissions a plain ``open()`` would give, not mkstemp's owner-only 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's file-creation mask. Linux reports it in /proc. Elsewhere the only way to read
    it is to set it and set it back: serialised here, since two threads doing that at once left it
    at 0 for good (each restored the other's 0), and every later file of the process world-writable."""
    mask = _umask_from_proc()
    if mask is not None:
        return mask
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def _umask_from_proc() -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


_UMASK_LOCK = threading.Lock()


def write_json(path: Path, data: Any, *, indent: int = 2, sort_keys: bool = False) -> None:
    """Write JSON to ``path`` atomically (see `write_text`); numpy and torch scalars as numbers."""
    write_text(
        path, json.dumps(data, indent=indent, sort_keys=sort_keys, default=_json_default) + "\n"
    )


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def atomic_dir(final: Path) -> _AtomicDir:
    """Context manager: fill a temporary sibling folder, renamed to ``final`` on success.

    An existing ``final`` is replaced; on an exception the temporary folder is removed.
    """
    return _AtomicDir(final)


class _AtomicDir:
    def __init__(self, final: Path) -> None:
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=f".{self.final.name}.tmp-"))
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        _as_open_would_make(self.tmp)
        _swap_into_place(self.tmp, self.final)


def _as_open_would_make(folder: Path) -> None:
    """Give ``folder`` and what is in it the modes ``mkdir``/``open`` would (mkdtemp makes 0700,
    some writers 0600), so other users of a shared sweep folder can read checkpoints and best/."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _swap_into_place(tmp: Path, final: Path) -> None:
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_swaps(folder: Path) -> None:
    """Finish or undo swaps a crash interrupted, and drop leftover temporary folders."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        match = re.fullmatch(r"\.(.+)\.old-\d+", entry.name)
        if match:
            final = folder / match.group(1)
            if final.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, final)
        elif re.fullmatch(r"\..+\.tmp-\w+", entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
