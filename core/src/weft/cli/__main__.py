"""``python -m weft.cli``: the ``weft`` command."""

import sys

from weft.cli import main

sys.exit(main())
