"""python -m difrl.report RUN_DIR: write RUN_DIR/report.html (the same as `difrl report RUN_DIR`)."""

import sys

from difrl.report import main

sys.exit(main())
