#!/usr/bin/env bash
# The GPU checks that fit a 15-minute GPU lease (one H100 or H200): at most 8.5 minutes of
# commands, the machine's start apart (about 5 in the first run), every stage bounded by its own
# timeout, so that a stage that hangs or fails leaves the others' results. From the repository
# root on the GPU machine:
#
#     bash benchmarks/gpu_check.sh [OUT]        # OUT: where the reports go (default gpu_check/)
#
# torchao float8, the step-time baseline, is installed from the wheels in .whl/ when there are
# any (the GPU machine has no network; `pip download --no-deps torchao==0.17.0 -d .whl` on a
# machine that has). Stages, in the order of what they decide:
#   1. steps.md     real-size Llama-3-8B and GPT-3 layers: bf16 Inductor, graphpass FP8
#                   tensorwise (default, and with order_backward) and blockwise
#                   (kernels=auto), torchao float8; the
#                   measured activations against graphpass.plan; PASS/FAIL lines
#   2. experts.md   16 DeepSeek-V3-shaped experts over 8,192 and 32,768 routed tokens: bf16
#                   against FP8 rowwise and tensorwise e4m3, with their kernel profiles
#   3. profile_llama.txt   the kernels of the FP8 Llama step, largest first, and the blocks live
#                   at its measured memory peak by the wrapper line that allocated them (the
#                   wrappers kept in llama_code/, to set beside cuda_peak.py's CPU-generated code)
#   4. pytest_gpu.txt      pytest -m gpu
# The whole report (every config, offload, the step peak and the memory budget) is
# benchmarks/gpu_report.py, which needs a longer lease.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check}"
source benchmarks/_gpu_stages.sh
stage steps 200 python3 benchmarks/gpu_report.py --models llama gpt --no-pytest --sections steps \
    --budget-s 180 --configs "scaled_mm, default" order_backward blockwise torchao \
    --out "$out/steps.md"
stage experts 150 python3 benchmarks/experts_fp8.py --cases experts_8k experts_32k \
    --configs rowwise "tensorwise e4m3" --out "$out/experts.md"
stage profile_llama 60 python3 benchmarks/profile_step.py --model llama --fp8 tensorwise \
    --kernels scaled_mm --top 30 --code-dir "$out/llama_code"
# only the files that mark a gpu test: collecting the whole suite imports every test module
stage pytest_gpu 90 python3 -m pytest -m gpu -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py)
cat "$out/machine.txt" "$out/stages.txt"
grep -hE "^- (PASS|FAIL|NOT)|^\| (bf16|graphpass|torchao|experts)" "$out/steps.md" "$out/experts.md" 2>/dev/null
tail -n 3 "$out/pytest_gpu.log"
