#!/usr/bin/env bash
# Build, on a CPU machine, one archive that makes `import transformer_engine.pytorch` work on the
# GPU machine (Python 3.12, torch 2.11.0+cu130, no network) after a one-line unpack onto
# PYTHONPATH:
#
#   scripts/te_gpu_bundle.sh        ->  .te-bundle/dist/te-2.20.2-torch2.11.0-cp312-sm90.tar.xz
#
# The archive holds (all 2.20.2 where they are TE's):
#   - transformer_engine_cu13's libtransformer_engine.so with its fatbins pruned to the sm_90
#     code (scripts/prune_fatbin.py), then `strip --strip-all`; libnccl_ep.so (expert-parallel
#     communication only) is left out
#   - transformer_engine_torch, compiled here from the sdist against PyPI's torch 2.11.0
#   - transformer_engine (the Python package) and the import-time dependencies the GPU image
#     lacks: pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions
#   - te_bundle.py, a loader that imports torch before transformer_engine
# Unpack on the GPU machine (DEVELOPERS.md, "Transformer Engine on the GPU machine"):
#   python3 -m tarfile -e .te-bundle/dist/te-*.tar.xz /tmp/te && export PYTHONPATH=/tmp/te:$PYTHONPATH
#
# Everything goes under .te-bundle/ (ignored): build/venv (Python 3.12 + CUDA torch + build
# headers, ~6 GB), build/wheels (downloads and the compiled extension), build/site (what is
# archived), dist/ (the archive: the one thing to carry). Re-running reuses the venv and the
# compiled wheel (rm -rf .te-bundle/build/wheels to recompile). The compile is ~8 min on 2 idle
# cores, 74 min on 2 busy ones (MAX_JOBS, default 2). Each step prints its time; the script fails when the archive is over
# MAX_MIB (40), when a shared object needs a GLIBC newer than MAX_GLIBC (2.39) or a libstdc++
# newer than MAX_GLIBCXX (3.4.30), or when a TE dist-info is not the TE version.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TE=2.20.2
TORCH=2.11.0            # the GPU machines' torch: PyPI's default build for CUDA 13.0
CUDA_MAJOR=13
CUDA_TOOLKIT=13.0.2     # torch 2.11.0's own cuda-toolkit pin: the build's extra headers match it
ARCHS=${ARCHS:-90}      # SM architectures whose code the core library keeps
MAX_MIB=${MAX_MIB:-40}  # the device tool carries at most 64 MiB; leave room for the rest
# What the compiled extension may need of the GPU machine's system libraries: the GPU image's
# glibc, 2.39 (Ubuntu 24.04; `platform.platform()` there reads "with-glibc2.39"), and libstdc++'s
# symbols of GCC 12 (Debian 12, Ubuntu 22.04; Ubuntu 24.04's libstdc++ is newer). Compiled on
# Debian 12 (glibc 2.36) the extension needs GLIBC_2.34 (dlopen, dlsym, pthread_once moved into
# libc); MAX_GLIBC=2.28 holds it to the core wheel's own manylinux_2_28 tag.
MAX_GLIBC=${MAX_GLIBC:-2.39}
MAX_GLIBCXX=${MAX_GLIBCXX:-3.4.30}
# Import-time dependencies of transformer_engine that the GPU image does not have.
PYDANTIC=2.14.4
TYPING_EXTENSIONS=4.16.0

BASE=$ROOT/.te-bundle
BUILD=$BASE/build
VENV=$BUILD/venv
WHEELS=$BUILD/wheels
SITE=$BUILD/site
DIST=$BASE/dist
ARCHIVE=$DIST/te-$TE-torch$TORCH-cp312-sm${ARCHS// /-}.tar.xz

T0=$SECONDS
t_step=$SECONDS
name_step=""
step() {  # ends the previous step (printing its time) and starts the next
    if [ -n "$name_step" ]; then printf '    %s: %d s\n' "$name_step" $((SECONDS - t_step)); fi
    name_step=$1; t_step=$SECONDS
    [ -n "$1" ] && echo "==> $1"
    return 0
}
die() { echo "te_gpu_bundle: $*" >&2; exit 1; }

# Python 3.12: the extension is a CPython extension module and must match the GPU machine's.
find_python() {
    local c
    for c in ${PYTHON:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    return 1
}

step "build venv $VENV: Python 3.12, torch $TORCH, the extension's build headers"
PYTHON=$(find_python) || die "no Python 3.12 found (set PYTHON=/path/to/python3.12)"
mkdir -p "$BUILD" "$WHEELS" "$DIST"
PY=$VENV/bin/python
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
# pip's config on these machines adds a find-links directory of CPU torch wheels, which pip would
# prefer to the CUDA build of the same version: point find-links at an empty directory.
mkdir -p "$BUILD/no-find-links"
export PIP_FIND_LINKS=$BUILD/no-find-links
pip() { "$PY" -m pip install -q "$@"; }
pip --upgrade pip
"$PY" -c "import torch; assert torch.version.cuda" 2>/dev/null || "$PY" -m pip uninstall -q -y torch
pip "torch==$TORCH"
pip 'setuptools<82' wheel packaging numpy ninja pybind11 'nvidia-cudnn-frontend>=1.29.0' \
    "cuda-toolkit[cccl,crt,curand]==$CUDA_TOOLKIT"
"$PY" - "$TORCH" "$CUDA_MAJOR" <<'EOF'
import sys, torch
want, major = sys.argv[1], sys.argv[2]
assert torch.__version__.split("+")[0] == want, torch.__version__
assert torch.version.cuda and torch.version.cuda.split(".")[0] == major, torch.version.cuda
print(f"    torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}")
EOF

step "download transformer_engine $TE, transformer_engine_cu$CUDA_MAJOR $TE, pydantic $PYDANTIC"
# Wheels for the GPU machine: CPython 3.12, x86_64, glibc 2.28 at most (pip takes the platform
# tags as listed, without the older manylinux tags a 2.28 system also runs).
dl() { "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "$@"; }
dl --no-deps "transformer_engine==$TE" "transformer_engine_cu$CUDA_MAJOR==$TE"
dl "pydantic==$PYDANTIC" "typing_extensions==$TYPING_EXTENSIONS"

step "compile transformer_engine_torch $TE against torch $TORCH (MAX_JOBS=${MAX_JOBS:-2})"
# FORCE_BUILD skips setup.py's download of a prebuilt wheel from GitHub (unreachable here);
# USE_NVIDIA_WHEELS takes the CUDA/cuDNN headers from the nvidia-* wheels (no toolkit, no nvcc);
# --no-build-isolation builds against the torch of the venv.
if compgen -G "$WHEELS/transformer_engine_torch-$TE-cp312-*.whl" > /dev/null; then
    echo "    reusing $(basename "$WHEELS"/transformer_engine_torch-$TE-cp312-*.whl)"
else
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS=${MAX_JOBS:-2} \
        "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WHEELS" "transformer_engine_torch==$TE"
fi

step "unpack the wheels into $SITE"
rm -rf "$SITE"; mkdir -p "$SITE"
wheels=()
for pattern in "transformer_engine-$TE-" "transformer_engine_cu$CUDA_MAJOR-$TE-" \
        "transformer_engine_torch-$TE-cp312-" pydantic- pydantic_core- annotated_types- \
        typing_inspection- typing_extensions-; do
    found=("$WHEELS/$pattern"*.whl)
    [ -e "${found[0]}" ] || die "no wheel $pattern* in $WHEELS"
    [ ${#found[@]} -eq 1 ] || die "more than one wheel $pattern* in $WHEELS: ${found[*]}"
    wheels+=("${found[0]}")
done
"$PY" - "$SITE" "${wheels[@]}" <<'EOF'
import sys, zipfile
site = sys.argv[1]
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
        print("   ", whl.rsplit("/", 1)[1])
EOF
core=$SITE/transformer_engine/wheel_lib/libtransformer_engine.so
[ -f "$core" ] || die "no $core in the core wheel"
# NCCL EP (expert-parallel communication) is loaded only on use; its library and headers stay out.
rm -rf "$SITE/transformer_engine/wheel_lib/nccl_ep"
find "$SITE" -name 'libnccl_ep.so*' -print -delete | sed 's/^/    left out /'
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
"$PY" - "$SITE" "$TE" <<'EOF'
import pathlib, sys
site, te = pathlib.Path(sys.argv[1]), sys.argv[2]
versions = {}
for meta in sorted(site.glob("*.dist-info/METADATA")):
    fields = dict(l.split(": ", 1) for l in meta.read_text().splitlines()[:3] if ": " in l)
    versions[fields["Name"]] = fields["Version"]
    print(f"    {fields['Name']} {fields['Version']}")
te_dists = {n: v for n, v in versions.items() if n.lower().replace("-", "_").startswith("transformer_engine")}
wrong = {n: v for n, v in te_dists.items() if v != te}
if len(te_dists) != 3 or wrong:
    sys.exit(f"te_gpu_bundle: expected 3 transformer_engine dist-infos at {te}, got {te_dists}")
EOF

step "prune libtransformer_engine.so to sm_${ARCHS// /, sm_} and strip it"
before=$(stat -c %s "$core")
"$PY" scripts/prune_fatbin.py "$core" "$core.pruned" $ARCHS
strip --strip-all -o "$core" "$core.pruned"
rm -f "$core.pruned"
echo "    $((before / 1048576)) MiB -> $(($(stat -c %s "$core") / 1048576)) MiB (zero-filled code compresses away)"

step "GLIBC and GLIBCXX symbol versions (at most $MAX_GLIBC and $MAX_GLIBCXX)"
fail=0
newest() {  # the newest version of $2 (GLIBC or GLIBCXX) that $1's dynamic symbols need
    objdump -T "$1" | { grep -o "$2_[0-9][0-9.]*" || true; } | sed "s/$2_//" | sort -u -V | tail -n 1
}
newer() { [ -n "$1" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n 1)" != "$2" ]; }
while IFS= read -r so; do
    glibc=$(newest "$so" GLIBC); glibcxx=$(newest "$so" GLIBCXX)
    line="    ${so#"$SITE"/}: GLIBC_${glibc:-none}, GLIBCXX_${glibcxx:-none}"
    if newer "$glibc" "$MAX_GLIBC" || newer "$glibcxx" "$MAX_GLIBCXX"; then
        echo "$line: TOO NEW" >&2; fail=1
    else
        echo "$line"
    fi
done < <(find "$SITE" -name '*.so*' -type f | sort)
[ $fail -eq 0 ] || die "a shared object needs a newer GLIBC than $MAX_GLIBC or GLIBCXX than $MAX_GLIBCXX (MAX_GLIBC, MAX_GLIBCXX change the limits)"

step "loader and archive"
cat > "$SITE/te_bundle.py" <<EOF
"""Transformer Engine $TE for torch $TORCH (cp312, sm_$ARCHS), unpacked from the graphpass TE bundle.

\`import te_bundle\` imports torch and then transformer_engine.pytorch: torch must come first,
since libtransformer_engine.so finds NCCL only through the copy torch has loaded.
"""
import torch  # noqa: F401  (first: see above)
import transformer_engine
import transformer_engine.pytorch  # noqa: F401

__version__ = transformer_engine.__version__
EOF
rm -f "$ARCHIVE"
(cd "$SITE" && tar -cf - --sort=name --owner=0 --group=0 --numeric-owner . | xz -T2 -9 > "$ARCHIVE.tmp")
mv "$ARCHIVE.tmp" "$ARCHIVE"
size=$(stat -c %s "$ARCHIVE")
step ""
echo "$ARCHIVE: $size bytes ($(awk "BEGIN {printf \"%.1f\", $size / 1048576}") MiB; unpacked $(du -sm "$SITE" | cut -f1) MiB), $((SECONDS - T0)) s in all"
[ "$size" -le $((MAX_MIB * 1048576)) ] || die "the archive is over $MAX_MIB MiB"
