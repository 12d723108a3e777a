"""``python -m fusegen`` is the ``fusegen`` command."""

import sys

from .cli import main

sys.exit(main())
