"""`python -m engine.server --model DIR ...`: the `serve` command on its own."""

import sys

from engine.cli.serve import main

sys.exit(main())
