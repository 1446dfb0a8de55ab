#!/usr/bin/env python
"""``python tools/convert_ckpt.py ...`` = ``ode-lm export ...`` (same flags; kept for scripts)."""

import sys

from ode_lm.commands import export

if __name__ == "__main__":
    sys.exit(export.main(prog="convert_ckpt.py"))
