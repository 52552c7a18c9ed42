"""``python -m hpsweep.cli``: the command line, as the ``hpsweep`` script runs it."""

import sys

from hpsweep.cli.commands import main

sys.exit(main())
