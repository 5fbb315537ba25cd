"""``python -m downpour``: the ``downpour`` command."""

import sys

from downpour.cli import main

sys.exit(main())
