"""`TrialIndex`: the trial records of a sweep folder, kept in memory at a cost that does not grow
with the sweep.

The ledger looks at the trials several times a trial (reap, claim, count failures). Listing the
folder and checking every ``trial.json`` each time cost a third of a trial at 1,300 trials, so an
index learns what changed from three cheap sources instead:

- the journal, ``DIR/.trials.journal``: `TrialRecord.save` appends the run folder's name after
  every write, in whatever process or host writes it (a worker, a second command, a Ray worker);
- the records still in play (``running``, ``stopped``: the states a trial's own process or a
  claim moves on) are checked at every refresh, so a change whose writer was killed before it
  wrote the journal line is still seen;
- every `VERIFY_S` seconds, and when a lease died, the whole folder is listed and every record
  checked: a record edited by hand, or a journal line lost (two hosts appending over NFS at once),
  is seen within that time.

A record is parsed again only when its file changed (inode, mtime, size).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpsweep.runs._records import JOURNAL, TRIAL_FILE, TrialRecord, load_record, trial_names

VERIFY_S = 5.0
UNSETTLED = ("running", "stopped")  # checked at every refresh: see the module's docstring


class TrialIndex:
    """The records of one output folder, by run folder name and by state.

    Use one per thread (the ledger has one, the progress display another); `records` hands out the
    index's own objects, so copy a record (`dataclasses.replace`) before changing it.

    Args:
        output_dir: the sweep's folder.
    """

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = str(output_dir)
        self._journal = os.path.join(self.output_dir, JOURNAL)
        self._offset = 0
        self._verify_at = float("-inf")
        self._signatures: dict[str, tuple[int, int, int]] = {}
        self._by_state: dict[str, dict[str, TrialRecord]] = {}
        self._state_of: dict[str, str] = {}
        self._changed: set[str] = set()

    def refresh(self, *, verify: bool = False) -> None:
        """Take in what changed on disk since the last refresh (see the module's docstring)."""
        if verify or time.monotonic() >= self._verify_at:
            self.verify()
            return
        changed = self._read_journal()
        if changed is None:  # the journal was removed or replaced: start over from the folder
            self.verify()
            return
        for state in UNSETTLED:
            changed.update(self._by_state.get(state, ()))
        for name in changed:
            self._check(name)

    def verify(self) -> None:
        """List the folder and check every record."""
        try:
            offset = os.stat(self._journal).st_size  # lines written from now on are read next time
        except OSError:
            offset = 0
        names = set(trial_names(self.output_dir))
        for name in set(self._state_of) - names:
            self._drop(name)
        for name in names:
            self._check(name)
        self._offset = offset
        self._verify_at = time.monotonic() + VERIFY_S

    def records(self, *states: str) -> list[TrialRecord]:
        """The records in ``states`` (default: all), by number."""
        wanted = states or tuple(self._by_state)
        found = [r for state in wanted for r in self._by_state.get(state, {}).values()]
        return sorted(found, key=lambda r: (r.number, r.id))

    def count(self, *states: str) -> int:
        return sum(len(self._by_state.get(state, ())) for state in states)

    def take_changed(self) -> list[TrialRecord]:
        """The records that changed since the last call (those still on disk), by number: what a
        reader that keeps its own totals needs, at a cost that follows the changes, not the sweep."""
        names, self._changed = self._changed, set()
        found = [self._by_state[self._state_of[n]][n] for n in names if n in self._state_of]
        return sorted(found, key=lambda r: (r.number, r.id))

    # --- keeping it current -------------------------------------------------------------------------

    def _read_journal(self) -> set[str] | None:
        """The names written to the journal since the last read; None if it shrank (replaced)."""
        try:
            size = os.stat(self._journal).st_size
        except OSError:
            size = 0
        if size == self._offset:
            return set()
        if size < self._offset:
            return None
        with open(self._journal, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self._offset += len(whole)
        return {
            name
            for name in whole.decode(errors="replace").split("\n")
            if name and not name.startswith(".") and os.sep not in name
        }

    def _check(self, name: str) -> None:
        loaded = load_record(os.path.join(self.output_dir, name, TRIAL_FILE))
        if loaded is None:
            self._drop(name)
            return
        signature, record = loaded
        if self._signatures.get(name) == signature:
            return
        self._drop(name)
        self._changed.add(name)
        self._signatures[name] = signature
        self._state_of[name] = record.state
        self._by_state.setdefault(record.state, {})[name] = record

    def _drop(self, name: str) -> None:
        self._signatures.pop(name, None)
        state = self._state_of.pop(name, None)
        if state is not None:
            self._by_state[state].pop(name, None)
