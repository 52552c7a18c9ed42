"""The one exception type for mistakes a user can make, and the signals a trial sends."""

from __future__ import annotations

import difflib
import re
import signal
from collections.abc import Iterable

#: ``scheme://user:password@`` in a URL: the part of a storage or server URL never to show (up to
#: the last ``@`` before the path, so an unescaped ``@`` in the password is hidden too).
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s/]+(@)")


def hide_passwords(text: str) -> str:
    """``text`` with the password of every URL in it shown as ``***``
    (``postgresql://hp:s3cret@db/sweeps`` -> ``postgresql://hp:***@db/sweeps``)."""
    return _URL_PASSWORD.sub(r"\1***\2", text)


class UserError(Exception):
    """A mistake the user can fix: a bad space file, argument, parameter or setting.

    The message is one line that names the value, what was expected and the fix. The command
    line prints it without a traceback and exits with code 2. A URL in it shows its password as
    ``***``, whichever layer wrote the message: a storage URL often carries one.
    """

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(hide_passwords(str(message)), *args)


class DiskFull(UserError):
    """The disk under the sweep is full: the sweep stops in one line, and the trial that was
    running is left to resume, not failed (the same command finishes it once there is room)."""


class TrialFailed(Exception):
    """A trial raised; its error is recorded in its trial.json and the sweep goes on."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM; ``signum`` picks the exit code (128 + signum)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class TakenOver(BaseException):
    """A trial judged dead (its heartbeat stopped) runs on another machine now: this process stops
    training it and records nothing. A BaseException, so that no handler takes it for the trial's
    failure."""


class EndedOutside(Exception):
    """The trial was ended from outside the sweep (optuna-dashboard's Fail button, the ``optuna``
    command line, another writer of its study): this process stops training it, records it failed
    and runs another in its place. Not counted towards ``--max-failed-trials``: nothing is wrong
    with the sweep."""


class TrialPruned(Exception):
    """Raised when a backend decided to stop a trial early (pruning, a scheduler's stop)."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`" (did you mean 'x'?)"` for the closest candidate, or `""` when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""
