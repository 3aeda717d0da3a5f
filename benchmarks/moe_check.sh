#!/usr/bin/env bash
# The MoE checks that fit one GPU call (one H100 or H200): at most 8 minutes of commands, each
# stage under its own timeout, so that a stage that hangs or fails leaves the others' results.
# From the repository root on the GPU machine:
#
#     bash benchmarks/moe_check.sh [OUT]        # OUT: where the reports go (default moe_check/)
#
# torchao (the MoE FP8 training peer) is installed from the wheels in .whl/ when there are any
# (`pip download --no-deps torchao==0.17.0 -d .whl` on a machine with network). Stages:
#   1. pytest_kernels.txt  the Triton quantize kernels, bit-identical to the recipe on CUDA
#   2. kernels.txt         the expert weights' quantize: Triton kernels against Inductor's code
#   3. experts.md          16 DeepSeek-V3-shaped experts over 8,192 and 32,768 routed tokens:
#                          bf16, FP8 rowwise, torchao's MoE FP8; 1 and 4 micro-batches (the
#                          weight cache); kernel profiles, step peaks, PASS/FAIL lines
#   4. deepseek.md         the real-size DeepSeek-V3 layer, the same with 1 and 4 micro-batches
#   5. pytest_gpu.txt      the rest of pytest -m gpu for the FP8 expert and rowwise tests
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-moe_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/moe_check_site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/moe_check_site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"; } > "$out/machine.txt" 2>&1

stage() {  # name, timeout in seconds, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/stages.txt"
}
stage pytest_kernels 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_quantize.py
stage kernels 60 python3 benchmarks/quantize_kernels.py
stage experts 170 python3 benchmarks/experts_fp8.py --cases experts_8k experts_32k \
    --configs rowwise torchao --micro-batches 1 4 --out "$out/experts.md"
stage deepseek 150 python3 benchmarks/experts_fp8.py --cases deepseek --configs rowwise \
    --micro-batches 1 4 --out "$out/deepseek.md"
stage pytest_gpu 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_rowwise.py \
    tests/test_fp8_experts.py tests/test_weight_cache.py tests/test_fp8_recipes.py
cat "$out/machine.txt" "$out/stages.txt"
grep -hE "^- |^\| (experts|DeepSeek)" "$out/experts.md" "$out/deepseek.md" 2>/dev/null
tail -n 3 "$out/kernels.log" "$out/pytest_kernels.log" "$out/pytest_gpu.log"
