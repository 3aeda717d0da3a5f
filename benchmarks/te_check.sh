#!/usr/bin/env bash
# Transformer Engine on the GPU machine, in one call (one H100 or H200; about 280 s of
# commands). Carry the TE bundle and the torchao wheel (the device tool's
# `carry: [".te-bundle/dist", ".whl"]`; `scripts/te_gpu_bundle.sh` builds the bundle). From the
# repository root on the GPU machine:
#
#     bash benchmarks/te_check.sh [OUT]        # OUT: where the reports go (default te_check/)
#
# Stages:
#   1. te_tests.log    TE's import (in a fresh interpreter after torch ran cuDNN attention, as
#                      in a process that has run bf16 steps), graphpass's TE provider against
#                      TE's API, `kernels="te"` against the reference on a linear, TE's own
#                      modules compiled with graphpass (traced as TE's ops or kept from Dynamo:
#                      the test prints which) (120 s)
#   2. te_steps.md     the Llama-3-8B and GPT-3 layers: bf16, FP8 tensorwise on torch's
#                      `_scaled_mm` and on TE's GEMMs, one run (130 s)
#   3. te_profile.log  the kernels of the FP8 Llama step on TE's GEMMs (60 s)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-te_check}"
source benchmarks/_gpu_stages.sh
bundle=$(ls .te-bundle/dist/te-*.tar.xz 2>/dev/null | head -n 1)
if [ -z "$bundle" ]; then
    echo "no TE bundle in .te-bundle/dist (scripts/te_gpu_bundle.sh builds it)" | tee -a "$out/stages.txt"
    exit 1
fi
python3 -m tarfile -e "$bundle" /tmp/te > /dev/null 2>&1
export PYTHONPATH="/tmp/te:$PYTHONPATH"
stage te_tests 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_te.py \
    tests/test_fp8_lowering.py::test_providers_agree_on_gpu tests/test_kernel_choice.py
stage te_steps 130 python3 benchmarks/gpu_report.py --models llama gpt --no-pytest \
    --sections steps --budget-s 115 --configs "scaled_mm, default" "tensorwise/te" \
    --out "$out/te_steps.md"
stage te_profile 60 python3 benchmarks/profile_step.py --model llama --fp8 tensorwise \
    --kernels te --top 14
cat "$out/machine.txt" "$out/stages.txt"
grep -h "graph(s);" "$out/te_tests.log"
tail -n 3 "$out/te_tests.log"
grep -hE "^\| (bf16|graphpass)|^- (PASS|FAIL|NOT)" "$out/te_steps.md" 2>/dev/null
head -n 4 "$out/te_profile.log"
