"""The ``hpsweep`` command line: ``run``, ``show``, ``report``, ``push`` (`hpsweep.cli.commands`).

This package imports nothing heavy: ``hpsweep run`` turns the garbage collector off before it
imports torch and the backends (`hpsweep.cli.startup_heap`).
"""

from hpsweep.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
