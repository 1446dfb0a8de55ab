"""Export of ode-lm runs: ``raw`` (lossless hypernetwork) and ``hf`` (transformers-loadable).

CLI: ``ode-lm export`` (``ode_lm/commands/export.py``). See ``convert.export`` for the entry point.
"""

from ode_lm.export.convert import FORMATS, ExportResult, check_request, export
from ode_lm.export.raw import load_raw, save_raw

__all__ = ["FORMATS", "ExportResult", "check_request", "export", "load_raw", "save_raw"]
