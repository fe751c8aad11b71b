"""``python -m calibrations ...``: the same as ``qfserve calibrate ...``."""

import sys

from calibrations.cli import main

sys.exit(main())
