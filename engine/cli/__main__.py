"""`python -m engine.cli ARGS`: the `nmt-incremental` command."""

import sys

from engine.cli.main import main

sys.exit(main())
