# Sourced by the one-call GPU check scripts (gpu_check.sh, moe_check.sh) after they set `out`:
# the environment (the source tree on PYTHONPATH, the carried wheels in .whl/ installed when
# there are any), the machine's name and versions in $out/machine.txt, and `stage NAME LIMIT
# COMMAND...`, which runs one stage under its own timeout into $out/NAME.log and appends its exit
# status and seconds to $out/stages.txt.
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_check_site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)"; } > "$out/machine.txt" 2>&1

stage() {  # name, timeout in seconds, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/stages.txt"
}
