#!/usr/bin/env bash
# Build .te-venv: CUDA torch + Transformer Engine (its PyTorch extension compiled from the sdist,
# which needs no GPU and no nvcc), install graphpass into it, and run the TE tests.
#
#   scripts/te_env.sh              build (or reuse) the venv, then run the TE tests
#   scripts/te_env.sh -x -q        extra arguments go to pytest
#
# Idempotent: every step is a pinned pip install, which pip skips when already satisfied, so a
# second run goes straight to the tests (~25 s). The one slow step is compiling
# transformer_engine_torch (10-20 min on 2 cores, ~3.5 GB RSS). Without a GPU, TE imports and its
# APIs can be inspected, but no TE module or kernel runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${TE_VENV:-.te-venv}
TE=2.20.2
# torch 2.13.0 on PyPI is a CUDA 13.0 build; TE's core wheel must have the same CUDA major
# (transformer_engine_cu13), and the sdist pins its core requirement from torch.version.cuda.
TORCH=2.13.0
CUDA_MAJOR=13
# torch 2.13.0's own cuda-toolkit pin, so that the extra headers the build includes and torch
# does not pull in ([crt]: crt/host_config.h, [cccl]: nv/target) match its CUDA runtime headers.
CUDA_TOOLKIT=13.0.3

PY=$VENV/bin/python
pip() { "$PY" -m pip install -q "$@"; }
step() { echo "==> $*"; }

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
# pip's config on these machines adds a local wheel directory (find-links) holding torch
# 2.13.0+cpu, which pip prefers to the CUDA build of the same version; point find-links at an
# empty directory instead (pip ignores an empty value).
mkdir -p "$VENV/no-find-links"
export PIP_FIND_LINKS
PIP_FIND_LINKS=$(cd "$VENV/no-find-links" && pwd)

step "torch $TORCH"
pip --upgrade pip setuptools wheel
# A CPU build satisfies "torch==$TORCH" as well: replace it.
"$PY" -c "import torch; assert torch.version.cuda" 2>/dev/null || "$PY" -m pip uninstall -q -y torch
pip "torch==$TORCH"
"$PY" - "$CUDA_MAJOR" <<'EOF'
import sys, torch
assert torch.version.cuda and torch.version.cuda.split(".")[0] == sys.argv[1], \
    f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, not {sys.argv[1]}.x"
EOF

step "Transformer Engine $TE wheels and build dependencies"
# TE's pure-Python package, its CUDA core library, the extension's runtime dependencies, and
# the build's headers. TE also loads curand at import (torch's own pin already has it).
pip "transformer_engine==$TE" "transformer_engine_cu$CUDA_MAJOR==$TE" \
    einops onnx onnxscript pydantic nvdlfw-inspect packaging numpy ninja \
    'nvidia-cudnn-frontend>=1.29.0' "cuda-toolkit[cccl,crt,curand]==$CUDA_TOOLKIT"

# FORCE_BUILD skips setup.py's download of a prebuilt wheel from GitHub (unreachable here);
# USE_NVIDIA_WHEELS takes the CUDA/cuDNN headers from the nvidia-* wheels instead of a toolkit;
# --no-build-isolation builds against the torch installed above.
step "transformer_engine_torch $TE (compiled from the sdist when not yet installed)"
NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=${MAX_JOBS:-2} \
    pip --no-build-isolation "transformer_engine_torch==$TE"

step "graphpass (editable) and test tools"
pip --no-deps -e .
pip pytest hypothesis networkx

# torch first: libtransformer_engine.so finds libnccl only through the copy torch loaded.
"$PY" -c "import torch, transformer_engine as te, transformer_engine.pytorch; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformer_engine', te.__version__)"

tests=(tests/test_fp8_lowering.py)
[ -f tests/test_te.py ] && tests+=(tests/test_te.py)
exec "$PY" -m pytest "${tests[@]}" -k "te_" -rA "$@"
