"""Export a run: ``raw`` (hypernetwork, lossless) or ``hf`` (materialised at M steps).

``hf`` picks the transformers class by flavour and architecture: the sequential baselines →
``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``GPTNeoXForCausalLM`` (stock classes, no custom
code); ODE and parallel models of the neox flavour → ``GPTNeoXForCausalLM``; gpt2 / llama →
the parallel-block modelling files in ``hf_templates`` shipped with the checkpoint
(``trust_remote_code=True``). ``hf-neox`` insists on the native GPTNeoX class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np

from ode_lm.errors import UsageError
from ode_lm.export import (
    hf_sequential,
    hf_weights,
    safetensors_io,
    tokenizer_files,
    verify,
)
from ode_lm.export.hf_templates import TEMPLATE_FILES

FORMATS = ("raw", "hf", "hf-neox")


@dataclasses.dataclass
class ExportResult:
    out_dir: str
    format: str
    files: list[str]
    step: int
    num_steps: int | None
    max_abs_diff: float | None = None


def check_flags(fmt: str, num_steps: int | None, dtype: str,
                max_shard_bytes: int | None = None) -> None:
    """The flags on their own (a ``UsageError``, exit 2), before the run is even looked at."""
    if fmt not in FORMATS:
        raise UsageError(f"--format={fmt!r}: unknown format; expected one of {FORMATS}")
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps <= 0):
        raise UsageError(f"--num_steps={num_steps!r}: must be a positive number of solver steps")
    if dtype not in safetensors_io.DTYPES:
        raise UsageError(f"--dtype={dtype!r}: expected one of {tuple(safetensors_io.DTYPES)}")
    if fmt == "raw" and num_steps is not None:
        raise UsageError(f"--num_steps={num_steps} with --format=raw: a raw export keeps the "
                         "continuous model; the step count is chosen when it is loaded")
    if max_shard_bytes is not None and not max_shard_bytes > 0:
        raise UsageError(f"--max_shard_mb={max_shard_bytes / 2**20:g}: must be > 0")


def check_request(fmt: str, flavour: str, architecture: str, num_steps: int | None,
                  dtype: str) -> None:
    """Every bad flag combination (``check_flags``), then those the run's model refuses."""
    check_flags(fmt, num_steps, dtype)
    if fmt == "hf-neox" and flavour != "neox":
        raise ValueError(
            f"--format=hf-neox: a {flavour} model can't be mapped to GPTNeoXForCausalLM "
            "(it needs the neox flavour: rotary, two LayerNorms, exact GELU); use --format=hf"
        )
    if fmt.startswith("hf") and architecture == "sequential" and num_steps is not None:
        raise ValueError(f"--num_steps={num_steps}: a sequential {flavour} baseline has a fixed "
                         "depth (its num_layers); drop the flag")


def _materialised(model, num_steps: int | None):
    from ode_lm.models.lm import DiffEqFormer
    from ode_lm.models.materialize import materialize

    if isinstance(model, DiffEqFormer):
        return materialize(model, num_steps or model.config.num_steps, "euler")
    return model  # already a parallel-block model (a materialised fine-tune)


def write_hf(model, out_dir: str, fmt: str, *, num_steps: int | None, dtype: str,
             data_dir: str | None, max_shard_bytes: int) -> list[str]:
    source_steps = model.config.num_steps
    pm = _materialised(model, num_steps)
    cfg = pm.config
    stock = cfg.architecture == "sequential" or cfg.flavour == "neox"
    ids = tokenizer_files.token_ids(data_dir)
    if stock and not ids:
        # A stock class fills a missing id with its own default (GPT-2's 50256, Llama's and
        # GPT-NeoX's 2): there alone an unknown id (weights only) is an explicit null, so
        # another tokenizer's ids never stand in for ours.
        ids = dict.fromkeys(tokenizer_files.TOKEN_ID_KEYS)
    if cfg.architecture == "sequential":
        tensors, config = hf_sequential.sequential_export(pm, ids)
    elif cfg.flavour == "neox":
        tensors, config = hf_weights.neox_tensors(pm), hf_weights.neox_config(cfg, ids)
    else:
        tensors = hf_weights.remote_tensors(pm)
        config = hf_weights.remote_config(cfg, ids, source_steps)
        here = os.path.join(os.path.dirname(__file__), "hf_templates")
        for name in TEMPLATE_FILES:
            shutil.copyfile(os.path.join(here, name), os.path.join(out_dir, name))
    config["torch_dtype"] = config["dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    config["ode_lm"] = {"flavour": cfg.flavour, "architecture": cfg.architecture,
                        "num_layers": cfg.num_layers}
    if cfg.architecture != "sequential":
        config["ode_lm"]["materialised_from_steps"] = num_steps or source_steps
    files = safetensors_io.save_sharded(safetensors_io.cast(tensors, dtype), out_dir,
                                        max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(tokenizer_files.generation_config(ids), f, indent=2)
    extra = [] if stock else list(TEMPLATE_FILES)
    return files + ["config.json", "generation_config.json"] + extra + \
        tokenizer_files.copy_tokenizer(data_dir, out_dir)


def export(
    model_dir: str,
    fmt: str,
    out_dir: str,
    *,
    step: int | None = None,
    num_steps: int | None = None,
    dtype: str = "fp32",
    verify_logits: bool = False,
    data_dir: str | None = None,
    max_shard_bytes: int = safetensors_io.DEFAULT_MAX_SHARD_BYTES,
    weights_only: bool = False,
    overwrite: bool = False,
) -> ExportResult:
    """``weights_only``: export without the run's tokenizer (no tokenizer files, no special
    token ids); otherwise a missing data dir is refused before anything is written.
    The export is written into a temporary directory beside ``out_dir``, checked there
    (``verify_logits``) and renamed into place only when complete and checked, so a failed
    export or check leaves ``out_dir`` as it was; ``overwrite`` replaces a non-empty
    ``out_dir`` the same way (refused without it)."""
    from ode_lm.gin_setup import run_dir
    from ode_lm.training.saved_run import load_model

    check_flags(fmt, num_steps, dtype, max_shard_bytes)  # exit 2 whatever the run
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model_dir={model_dir}: no such directory")
    run = run_dir(model_dir)
    config = run.model_config()
    check_request(fmt, config.flavour, config.architecture, num_steps, dtype)
    if fmt != "raw" and config.architecture == "sequential":
        hf_sequential.check_sequential(config)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"--out={out_dir}: is a file, not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"--out={out_dir}: directory exists and is not empty "
                              "(--overwrite replaces it)")
    if verify_logits and fmt != "raw":
        verify.require_hf()  # before the export is written, not after
    data_dir = None if weights_only else data_dir or run.data_dir()
    if not weights_only:
        tokenizer_files.check_tokenizer_source(data_dir)
    model, loaded = load_model(model_dir, step)
    config, step = loaded.config, loaded.step
    diff = None
    with staged_dir(out_dir) as staging:
        if fmt == "raw":
            from ode_lm.export.raw import save_raw

            files = save_raw(model, config, staging, dtype=dtype,
                             max_shard_bytes=max_shard_bytes)
            files.append("config.json")
            files += tokenizer_files.copy_tokenizer(data_dir, staging)
        else:
            files = write_hf(model, staging, fmt, num_steps=num_steps, dtype=dtype,
                             data_dir=data_dir, max_shard_bytes=max_shard_bytes)
        if verify_logits:  # before the swap: a failed check leaves --out as it was
            diff = check_logits(model, staging, fmt, num_steps, dtype, shown=out_dir)
    result = ExportResult(out_dir, fmt, files, step, num_steps)
    result.max_abs_diff = diff
    return result


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """A directory to write into, named as ``out_dir`` (an hf export's modelling code is
    cached under its folder's name) inside a temporary one beside it; on success it replaces
    ``out_dir`` (an existing one is moved aside first and removed after), on an error it is
    removed and ``out_dir`` is left as it was."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(out_dir)
    holder = tempfile.mkdtemp(prefix=f".{name}.writing-", dir=parent)
    staging = os.path.join(holder, name)
    old = None
    try:
        os.mkdir(staging, 0o777)  # as a makedirs would be, not mkdtemp's 0700
        yield staging
        if os.path.isdir(out_dir):
            old = tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent)
            os.rename(out_dir, os.path.join(old, name))
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_logits(model, out_dir: str, fmt: str, num_steps: int | None, dtype: str, *,
                 shown: str | None = None) -> float:
    """max |Δ logits| between the export in ``out_dir`` and ode-lm; raises above the
    dtype's tolerance, naming ``shown`` (the export's destination) or ``out_dir``."""
    cfg = model.config
    tokens = verify.fixed_batch(cfg.vocab_size, cfg.max_seq_len)
    ref = verify.reference_logits(model, tokens, num_steps)
    got = (verify.raw_logits(out_dir, tokens, None) if fmt == "raw"
           else verify.hf_logits(out_dir, tokens))
    diff = float(np.max(np.abs(ref - got)))
    tol = verify.TOLERANCE[dtype] * (1.0 if dtype == "fp32" else max(1.0, np.abs(ref).max()))
    if not diff < tol:
        raise AssertionError(f"--verify: {shown or out_dir}: max |Δ logits| = {diff:.3g} "
                             f"exceeds {tol:g}; the export was not written (--out left as it "
                             "was)")
    return diff
