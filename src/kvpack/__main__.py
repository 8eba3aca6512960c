"""``python -m kvpack``: the same command line as the ``kvpack`` script, for hosts where the
script directory is not on PATH (a --user or --target install)."""

import sys

from .cli import main

sys.exit(main())
