#!/usr/bin/env bash
# The MoE checks that fit one GPU call (one H100 or H200): at most 560 s of commands, each
# stage under its own timeout, so that a stage that hangs or fails leaves the others' results
# (each stage prints its rows as they come: a stage cut by its timeout keeps what it printed).
# From the repository root on the GPU machine:
#
#     bash benchmarks/moe_check.sh [OUT]        # OUT: where the reports go (default moe_check/)
#
# torchao (the MoE FP8 training peer) is installed from the wheels in .whl/ when there are any
# (`pip download --no-deps torchao==0.17.0 -d .whl` on a machine with network). Stages, with
# the time they took on an H200 (each config compiles: about 14 s a row for the experts, 40 s
# for the DeepSeek-V3 layer):
#   1. exactness.log       pytest -m gpu of the weight cache and the FP8 experts: cached and
#                          uncached steps bit-identical on CUDA, which compares the quantize
#                          kernels' launches from Inductor's code with the op's own (90 s)
#   2. sweep.log           the quantize kernels' tile configurations, pipelining depths
#                          included (`quantize_kernels.py --sweep`, each checked bit for bit
#                          against the torch code), the fastest of each family written to
#                          tiles.json (about 60 s)
#   3. experts.md          16 DeepSeek-V3-shaped experts over 8,192 and 32,768 routed tokens,
#                          on the sweep's tiles: bf16, FP8 rowwise as a user gets it (the
#                          cost model keeps the 8,192-token expert GEMMs in bf16 when their
#                          weights are quantized every step), every GEMM in FP8 (also with
#                          every GEMM's accumulation fast, as torchao's), torchao's MoE FP8;
#                          1 and 4 micro-batches (the weight cache, every GEMM); kernel
#                          profiles, graphpass ops' host time, step peaks, PASS/FAIL lines
#                          (14 rows, about 190 s)
#   4. deepseek.md         the real-size DeepSeek-V3 layer, bf16 and FP8 rowwise with 1 and 4
#                          micro-batches (4 rows; one micro-batch: its 256 weight-bound experts
#                          in bf16 by the cost model; 4 with the weight cache and every
#                          GEMM: in FP8)
# pytest -m gpu of the Triton kernels themselves (their compiles take minutes) needs a call of
# its own:
#   python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_grouped.py \
#       tests/test_triton_quantize.py
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-moe_check}"
source benchmarks/_gpu_stages.sh
stage exactness 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_weight_cache.py \
    tests/test_fp8_experts.py
stage sweep 100 python3 benchmarks/quantize_kernels.py --sections grouped experts --sweep \
    --shapes 16x4096x7168 --grouped-shapes 8192x7168x16 --best-out "$out/tiles.json"
tiles=()  # the sweep's fastest tiles, where it wrote them
[ -s "$out/tiles.json" ] && tiles=(--tiles "$out/tiles.json")
stage experts 210 python3 benchmarks/experts_fp8.py --cases experts_8k experts_32k \
    --configs rowwise torchao "every GEMM" "fast accumulation" --micro-batches 1 4 \
    ${tiles[@]+"${tiles[@]}"} --out "$out/experts.md"
stage deepseek 160 python3 benchmarks/experts_fp8.py --cases deepseek --configs rowwise \
    --micro-batches 1 4 ${tiles[@]+"${tiles[@]}"} --out "$out/deepseek.md"
cat "$out/machine.txt" "$out/stages.txt"
grep -hE "^\| (experts|DeepSeek)" "$out/experts.log" "$out/deepseek.log" 2>/dev/null
grep -hE "^- " "$out/experts.md" "$out/deepseek.md" 2>/dev/null
grep -h "fastest configurations" "$out/sweep.log" 2>/dev/null
tail -n 3 "$out/exactness.log"
