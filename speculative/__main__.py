"""`python -m speculative ...` is the `speculative ...` command (speculative.cli)."""

import sys

from speculative.cli import main

sys.exit(main())
