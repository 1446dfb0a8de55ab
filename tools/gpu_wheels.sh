#!/usr/bin/env bash
# Download the wheels tools/gpu_session.sh installs on an accelerator host without network
# access: what ode-lm imports beyond a jax + flax image (the list below), cp312 x86-64, no
# dependencies resolved (each needed one is named here).
#
#   tools/gpu_wheels.sh            # -> wheels/ (ignored by git; copy it beside the checkout)
#
# The list (name==version, pinned like pyproject.toml; sizes in the final line's total):
#   grain==0.2.18          data pipeline (grain's DatasetIterator, checkpoint handlers)
#   array-record==0.8.6    prepared shards (C++ extension)
#   gin-config==0.5.0      configs
#   clu==0.0.12            metric writers / metrics
#   ml-collections==1.1.0  clu's dependency
#   portpicker==1.6.0      grain's dependency
#   zstandard==0.25.0      .zst sources (C extension)
# Expected on the host already: jax/jaxlib with its accelerator plugin, flax, optax,
# orbax-checkpoint, tensorstore, etils, absl-py, protobuf, cloudpickle, numpy, scipy,
# tiktoken, tokenizers, sentencepiece, tensorboard, matplotlib, tqdm, pyarrow, safetensors,
# pyyaml, wrapt, typing-extensions, packaging.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-wheels}
WHEELS=(grain==0.2.18 array-record==0.8.6 gin-config==0.5.0 clu==0.0.12
        ml-collections==1.1.0 portpicker==1.6.0 zstandard==0.25.0)
mkdir -p "$DEST"
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "$w"
done
ls -l "$DEST"
total=$(du -sk "$DEST" | cut -f1)
echo "wheels: ${total} KiB in $DEST"
