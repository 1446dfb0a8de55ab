"""The paper's findings as checkable claims: ``ode-lm reproduce`` (commands/reproduce.py).

``verdict``: a statistic per seed against a threshold fixed in code → holds / does not hold /
inconclusive. ``statistics``: the statistics that read a trained model (spectra, Lyapunov,
occlusion). ``suite``: every claim, the runs it needs and how it reads them. ``runs``: runs
keyed by their settings, trained once and reused. ``report``: ``claims.json`` and its page.
"""
