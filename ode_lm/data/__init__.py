"""Input pipelines: tokenizers, raw sources, offline preparation, grain train/eval/streaming.

Public API (its use: docs/data.md): ``DataConfig``, ``get_tokenizer``, ``padded_vocab_size``,
``prepare``, ``ensure_prepared``, ``load_manifest``, ``make_train_iterator``,
``make_eval_iterator``, ``to_global_batch``.
"""

from ode_lm.data.config import DataConfig
from ode_lm.data.eval_sets import make_eval_batches
from ode_lm.data.mixture import TokenCount
from ode_lm.data.pipeline import to_global_batch
from ode_lm.data.prepare import PreparedDataError, check_tokenizer, load_manifest, prepare
from ode_lm.data.sources import SourceError
from ode_lm.data.tokenizers import Tokenizer, get_tokenizer, padded_vocab_size
from ode_lm.data.train_data import (
    check_eval_split,
    ensure_prepared,
    eval_configs,
    make_eval_iterator,
    make_train_iterator,
)

__all__ = [
    "DataConfig", "PreparedDataError", "SourceError", "TokenCount", "Tokenizer",
    "check_eval_split", "check_tokenizer", "ensure_prepared", "eval_configs", "get_tokenizer",
    "load_manifest",
    "make_eval_batches", "make_eval_iterator", "make_train_iterator", "padded_vocab_size",
    "prepare", "to_global_batch",
]
