"""``python -m ode_lm <command> [flags]`` = ``ode-lm <command> [flags]``."""

import sys

from ode_lm.main import main

sys.exit(main())
