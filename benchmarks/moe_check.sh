#!/usr/bin/env bash
# The MoE checks that fit one GPU call (one H100 or H200): at most 500 s of commands, each
# stage under its own timeout, so that a stage that hangs or fails leaves the others' results.
# From the repository root on the GPU machine:
#
#     bash benchmarks/moe_check.sh [OUT]        # OUT: where the reports go (default moe_check/)
#
# torchao (the MoE FP8 training peer) is installed from the wheels in .whl/ when there are any
# (`pip download --no-deps torchao==0.17.0 -d .whl` on a machine with network). Stages:
#   1. kernels.log         the expert weights' and the token-grouped activations' quantizes:
#                          Triton kernels against Inductor's code, and their tile sweeps
#   2. experts.md          16 DeepSeek-V3-shaped experts over 8,192 and 32,768 routed tokens:
#                          bf16, FP8 rowwise (the token quantizes on the Triton kernels, and on
#                          Inductor's code), torchao's MoE FP8; 1 and 4 micro-batches (the
#                          weight cache); kernel profiles, step peaks, PASS/FAIL lines
#   3. deepseek.md         the real-size DeepSeek-V3 layer, the same with 1 and 4 micro-batches
#   4. pytest_gpu.log      pytest -m gpu of the Triton kernels and the FP8 expert and rowwise
#                          paths
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-moe_check}"
source benchmarks/_gpu_stages.sh
stage kernels 90 python3 benchmarks/quantize_kernels.py --sections grouped experts --sweep
stage experts 150 python3 benchmarks/experts_fp8.py --cases experts_8k experts_32k \
    --configs rowwise torchao --micro-batches 1 4 --out "$out/experts.md"
stage deepseek 140 python3 benchmarks/experts_fp8.py --cases deepseek --configs rowwise \
    --micro-batches 1 4 --out "$out/deepseek.md"
# the compiled kernels first (Triton compiles each variant: about 60 s for the grouped ones on
# an H200), then the FP8 expert and rowwise paths; -x is left out so one failure hides nothing
stage pytest_gpu 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_grouped.py \
    tests/test_weight_cache.py tests/test_fp8_experts.py tests/test_fp8_rowwise.py \
    tests/test_fp8_recipes.py tests/test_triton_quantize.py
cat "$out/machine.txt" "$out/stages.txt"
grep -hE "^- |^\| (experts|DeepSeek)" "$out/experts.md" "$out/deepseek.md" 2>/dev/null
tail -n 3 "$out/kernels.log" "$out/pytest_gpu.log"
