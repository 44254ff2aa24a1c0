"""`python -m headwise.cli ARGS`: the `headwise` command."""

import sys

from . import main

sys.exit(main())
