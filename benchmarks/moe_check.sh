#!/usr/bin/env bash
# The MoE checks that fit one GPU call (one H100 or H200): at most 500 s of commands, each
# stage under its own timeout, so that a stage that hangs or fails leaves the others' results.
# From the repository root on the GPU machine:
#
#     bash benchmarks/moe_check.sh [OUT]        # OUT: where the reports go (default moe_check/)
#
# torchao (the MoE FP8 training peer) is installed from the wheels in .whl/ when there are any
# (`pip download --no-deps torchao==0.17.0 -d .whl` on a machine with network). Stages:
#   1. pytest_kernels.log  the Triton quantize kernels, bit-identical to the recipe on CUDA
#   2. kernels.log         the expert weights' and the token-grouped activations' quantizes:
#                          Triton kernels against Inductor's code
#   3. experts.md          16 DeepSeek-V3-shaped experts over 8,192 and 32,768 routed tokens:
#                          bf16, FP8 rowwise, torchao's MoE FP8; 1 and 4 micro-batches (the
#                          weight cache); kernel profiles, step peaks, PASS/FAIL lines
#   4. deepseek.md         the real-size DeepSeek-V3 layer, the same with 1 and 4 micro-batches
#   5. pytest_gpu.log       the rest of pytest -m gpu for the FP8 expert and rowwise tests
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-moe_check}"
source benchmarks/_gpu_stages.sh
stage pytest_kernels 50 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_quantize.py \
    tests/test_triton_grouped.py
stage kernels 70 python3 benchmarks/quantize_kernels.py --sections experts grouped
stage experts 190 python3 benchmarks/experts_fp8.py --cases experts_8k experts_32k \
    --configs rowwise torchao --micro-batches 1 4 --out "$out/experts.md"
stage deepseek 150 python3 benchmarks/experts_fp8.py --cases deepseek --configs rowwise \
    --micro-batches 1 4 --out "$out/deepseek.md"
stage pytest_gpu 40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_rowwise.py \
    tests/test_fp8_experts.py tests/test_weight_cache.py tests/test_fp8_recipes.py
cat "$out/machine.txt" "$out/stages.txt"
grep -hE "^- |^\| (experts|DeepSeek)" "$out/experts.md" "$out/deepseek.md" 2>/dev/null
tail -n 3 "$out/kernels.log" "$out/pytest_kernels.log" "$out/pytest_gpu.log"
