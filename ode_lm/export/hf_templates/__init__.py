"""PyTorch modelling files shipped inside `hf` exports that transformers has no class for.

These files are copied verbatim into the export directory and loaded by
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``. They import torch and
transformers, so nothing in ode-lm imports them; only the exporter copies them.
"""

TEMPLATE_FILES = ("configuration_ode_lm.py", "modeling_ode_lm.py")
