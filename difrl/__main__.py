"""python -m difrl ... (the same as the `difrl` command; torchrun -m difrl train ... works too)."""

import sys

from difrl.cli import main

sys.exit(main())
