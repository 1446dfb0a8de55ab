"""lm-evaluation-harness on ode-lm models, without exporting first.

``adapter.OdeLM`` is a native lm-eval ``LM`` (log-likelihood, rolling log-likelihood, greedy
generation) over any ode-lm model at any number of ODE steps; ``run`` builds the task
manager, calls ``lm_eval.simple_evaluate`` and flattens its results into
``lm_eval/<task>/<metric>`` scalars (``ode_lm.commands.eval --lm_eval_tasks``, and the trainer's
``TrainConfig.lm_eval_tasks`` every ``eval_every`` steps). lm-eval is an optional extra
(``pip install -e '.[lmeval]'``), imported only when a task is run.
"""
