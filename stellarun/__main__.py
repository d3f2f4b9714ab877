"""``python -m stellarun ...`` is the ``stellarun`` command."""
import sys

from .cli import main

sys.exit(main())
