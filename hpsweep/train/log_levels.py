"""transformers' ``log_level`` / ``log_level_replica`` / ``log_on_each_node``: the level the
logs of hpsweep and of transformers are set to in this process when a `Trainer` is built.

    >>> apply_log_level(TrainingArguments(log_level="info"))  # hpsweep's and transformers' INFO
"""

from __future__ import annotations

import logging
import sys
from typing import Any

#: transformers' level names; "passive" leaves the levels as they are.
LOG_LEVELS = {
    "detail": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": None,
}


def process_log_level(args: Any) -> int | None:
    """This process's level: ``log_level`` on the main process (of each machine, under
    ``log_on_each_node``), ``log_level_replica`` on the others; None for "passive"."""
    main = args.local_process_index == 0 if args.log_on_each_node else args.process_index == 0
    return LOG_LEVELS[args.log_level if main else args.log_level_replica]


def apply_log_level(args: Any) -> None:
    """Set hpsweep's logger, and transformers' when it is imported, to this process's level."""
    level = process_log_level(args)
    if level is None:
        return
    logging.getLogger("hpsweep").setLevel(level)
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.set_verbosity(level)
