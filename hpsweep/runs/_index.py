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
- now and then, and when a caller asks (a lease died, Ray's driver between rounds), the whole
  folder is listed and every record checked (`TrialIndex.verify`): a record edited by hand, or a
  journal line lost (two hosts appending over NFS at once), is seen within
  ``max(VERIFY_S, the last verify's duration / VERIFY_SHARE)`` seconds. A verify costs one
  ``stat`` per trial, so its interval grows with the time it took: the periodic verifies take at
  most `VERIFY_SHARE` of the refreshing thread's time, whatever the size of the sweep (they stay
  `VERIFY_S` apart until a verify takes more than 10 ms).

A record is parsed again only when its file changed (inode, mtime, size). A refresh between two
verifies costs what changed plus the records in play; the highest trial number, where each
trial's record is and the trials that failed since a command began are kept as records come and
go, so no question the ledger asks per trial reads every record.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from time import monotonic

from hpsweep.runs._records import (
    JOURNAL,
    TRIAL_FILE,
    TrialRecord,
    load_record,
    safe_name,
    trial_names,
)

VERIFY_S = 5.0
#: The largest share of the refreshing thread's time that periodic verifies take (see above).
VERIFY_SHARE = 0.002
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
        self._folder_of: dict[str, str] = {}  # trial id -> run folder name
        self._numbers: Counter[int] = Counter()
        self._max_number = -1
        # failed records that ended at or after _failed_floor (see `failed_since`)
        self._failed_floor: float | None = None
        self._recent_failed: dict[str, TrialRecord] = {}

    def refresh(self, *, verify: bool = False) -> None:
        """Take in what changed on disk since the last refresh (see the module's docstring)."""
        if verify or monotonic() >= self._verify_at:
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
        """List the folder and check every record (one ``stat`` each; parsed only if changed);
        the next periodic verify waits in proportion to the time this one took."""
        started = monotonic()
        try:
            offset = os.stat(self._journal).st_size  # lines written from now on are read next time
        except OSError:
            offset = 0
        names = set(trial_names(self.output_dir))
        for name in set(self._state_of) - names:
            self._drop(name)
        for name in names:
            try:
                st = os.stat(os.path.join(self.output_dir, name, TRIAL_FILE))
            except OSError:
                self._drop(name)
                continue
            if self._signatures.get(name) != (st.st_ino, st.st_mtime_ns, st.st_size):
                self._check(name)
        self._offset = offset
        ended = monotonic()
        self._verify_at = ended + max(VERIFY_S, (ended - started) / VERIFY_SHARE)

    def records(self, *states: str) -> list[TrialRecord]:
        """The records in ``states`` (default: all), by number."""
        wanted = states or tuple(self._by_state)
        found = [r for state in wanted for r in self._by_state.get(state, {}).values()]
        return sorted(found, key=lambda r: (r.number, r.id))

    def count(self, *states: str) -> int:
        return sum(len(self._by_state.get(state, ())) for state in states)

    def failed_since(self, since: float) -> list[TrialRecord]:
        """The failed records that ended at or after ``since``, by number. From the first call
        on, the index keeps them as records change, so a call costs those failures, not every
        failed record (a call with an earlier ``since`` than before looks at those once)."""
        if self._failed_floor is None or since < self._failed_floor:
            self._failed_floor = since
            self._recent_failed = {
                name: r
                for name, r in self._by_state.get("failed", {}).items()
                if (r.finished_at or 0) >= since
            }
        found = [r for r in self._recent_failed.values() if (r.finished_at or 0) >= since]
        return sorted(found, key=lambda r: (r.number, r.id))

    def max_number(self) -> int:
        """The highest trial number a record has (-1 without records)."""
        return self._max_number

    def has_number(self, number: int) -> bool:
        return number in self._numbers

    def lookup(self, trial_id: str) -> TrialRecord | None:
        """The record of ``trial_id`` as its file is now (the index's own object), or None.

        After a refresh, its own file is checked again: the one found before, else the default
        folder (``run-<id>``), where a record whose journal line was lost would be. Costs the
        same in a sweep of any size; a record under another name whose line was lost is found by
        the next verify."""
        self.refresh()
        name = self._folder_of.get(trial_id) or safe_name(f"run-{trial_id}", "run")
        self._check(name)
        name = self._folder_of.get(trial_id, name)
        state = self._state_of.get(name)
        record = None if state is None else self._by_state[state][name]
        return record if record is not None and record.id == trial_id else None

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
        self._drop(name, renumbered=record.number)
        self._changed.add(name)
        self._signatures[name] = signature
        self._state_of[name] = record.state
        self._by_state.setdefault(record.state, {})[name] = record
        self._folder_of[record.id] = name
        floor = self._failed_floor
        if record.state == "failed" and floor is not None and (record.finished_at or 0) >= floor:
            self._recent_failed[name] = record
        if isinstance(record.number, int):
            self._numbers[record.number] += 1
            self._max_number = max(self._max_number, record.number)

    def _drop(self, name: str, renumbered: int | None = None) -> None:
        """Forget the record in ``name``; ``renumbered``: the number its new version has (its
        number is then kept, so replacing the newest record does not rescan the numbers)."""
        self._signatures.pop(name, None)
        state = self._state_of.pop(name, None)
        if state is None:
            return
        record = self._by_state[state].pop(name)
        self._recent_failed.pop(name, None)
        if self._folder_of.get(record.id) == name:
            del self._folder_of[record.id]
        if not isinstance(record.number, int):
            return
        self._numbers[record.number] -= 1
        if not self._numbers[record.number]:
            del self._numbers[record.number]
            if record.number == self._max_number and renumbered != record.number:
                # rare: the newest record went away or was renumbered by hand
                self._max_number = max(self._numbers, default=-1)
