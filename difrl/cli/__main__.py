"""python -m difrl.cli ... (the same as `python -m difrl ...` and the `difrl` command)."""

import sys

from difrl.cli import main

sys.exit(main())
