"""``python -m qfserve.calibrations ...``: the same as ``qfserve calibrate ...``."""

import sys

from qfserve.calibrations.cli import main

sys.exit(main())
