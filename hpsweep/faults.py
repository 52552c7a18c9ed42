"""Named moments in a trial's life at which a test stops the process, instead of a lucky sleep.

    HPSWEEP_FAULT_AT=recorded HPSWEEP_FAULT_FILE=/tmp/at hpsweep run space.py ...

makes the process, when it first reaches the moment ``recorded``, write its pid to
``HPSWEEP_FAULT_FILE`` and wait there until a signal ends it: the test then sends ``kill -9`` or
SIGTERM (a preempted machine) at exactly that moment, and runs the same command, or another
machine's, to check that the sweep still finishes. Where the variable is unset (every user's
sweep) `reached` is one lookup in the environment.

The moments, in the order a trial meets them (`MOMENTS`):

- ``claimed``: the trial is the process's (RUNNING in the study), nothing of it is recorded yet;
- ``recorded``: its ``trial.json`` is at the home, no checkpoint is;
- ``writing``: a checkpoint is half written on this machine's disk (a folder home's only copy);
- ``uploading``: a checkpoint is half sent to an object-store home (no ``.complete`` marker);
- ``checkpointed``: training ended and its last checkpoint is whole at the home; the trial's end
  is not recorded;
- ``ended``: its end is recorded at the home (and ``best/`` updated), the backend is not told.
"""

from __future__ import annotations

import os
import threading
import time

AT_ENV = "HPSWEEP_FAULT_AT"
FILE_ENV = "HPSWEEP_FAULT_FILE"
MOMENTS = ("claimed", "recorded", "writing", "uploading", "checkpointed", "ended")


def reached(moment: str) -> None:
    """Wait here for a signal if a test asked to stop this process at ``moment``."""
    if os.environ.get(AT_ENV) != moment:
        return
    with open(os.environ[FILE_ENV], "w") as f:
        f.write(f"{os.getpid()}\n")
    if threading.current_thread() is threading.main_thread():
        while True:  # until the signal's handler raises here
            time.sleep(0.05)
    # A background thread (a checkpoint being written) goes on once the process is stopping, as
    # it would have after SIGTERM: the main thread, stopping, waits for that write.
    _released.wait()


_released = threading.Event()


def release() -> None:
    """The process is stopping (a signal came): a background thread held at a moment goes on."""
    _released.set()
