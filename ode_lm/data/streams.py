"""The former name of ``data/host_streams.py``, kept only while ``training/checkpoint.py``
imports it by that name (delete this file when it imports ``host_streams``)."""

from ode_lm.data.host_streams import FORMAT, DataStateError, global_state  # noqa: F401
