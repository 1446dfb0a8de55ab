"""Looking inside a trained model: trajectories, eigen-spectra, token Lyapunov exponents.

Generic math (no model import): ``spectra``, ``lyapunov``; the model's view:
``model_access``, ``trajectory``; outputs: ``plots``, ``report_html``; ``commands`` backs
``ode-lm analyze``; ``bench`` measures the README speed figures.
"""
