"""``python -m downpour.cli``: the ``downpour`` command."""

import sys

from downpour.cli import main

sys.exit(main())
