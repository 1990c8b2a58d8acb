"""``python -m flows.cli``: the same entry point as the ``capflow`` script."""

import sys

from flows.cli import main

sys.exit(main())
