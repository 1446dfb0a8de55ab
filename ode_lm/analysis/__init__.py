"""Looking inside a trained model: trajectories, eigen-spectra, token Lyapunov exponents.

A library (no gin, no flags, no benchmark presets): generic math (no model import):
``spectra``, ``lyapunov``, ``seeds`` (seed groups of run tables: means, paired
differences); the model's view: ``model_access``, ``trajectory``; outputs: ``plots``,
``report_html``, ``reports`` (model + inputs → files + summary lines). Its command line
lives in ``ode_lm.commands`` (``analyze``, ``depth_report``, ``depth_gap``,
``analysis_speed``).
"""
