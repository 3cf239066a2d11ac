#!/usr/bin/env bash
# On a machine with a CUDA GPU: install what the torch runner needs, run the CUDA-marked tests and
# the torch benchmark. Meant to finish in well under 5 minutes.
#
#   bash bench/gpu_check.sh            # from the repository root (beside ../shared for the benchmark)
#
# Environment:
#   PYTHON      the interpreter to build the venv from (default python3)
#   VENV        the venv folder (default .venv-gpu)
#   WHEELHOUSE  a folder of wheels for an offline machine (pip --no-index --find-links)
#   OUT         where logs and the benchmark's JSON go (default out/gpu-check)
#
# Torch: a torch that already sees CUDA in $PYTHON is reused (venv with --system-site-packages);
# otherwise torch==2.13.0 is installed with pip (from PyPI, or from $WHEELHOUSE).
# Exit: 0 all ran and passed, 1 a test or the benchmark failed, 2 no CUDA / install failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
start=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - start ))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

pip_args=(-q)
if [ -n "${WHEELHOUSE:-}" ]; then pip_args+=(--no-index --find-links "$WHEELHOUSE"); fi

if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "reusing the machine's torch: $("$PYTHON" -c 'import torch; print(torch.__version__)')"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV" || exit 2
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 2
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        log "installing torch==2.13.0"
        "$VENV/bin/pip" install "${pip_args[@]}" torch==2.13.0 || { log "cannot install torch"; exit 2; }
    fi
fi
# The project and its test dependencies; an offline machine may already have them.
if ! "$VENV/bin/pip" install "${pip_args[@]}" -e '.[test]' 2>"$OUT/pip.log"; then
    log "pip install -e '.[test]' failed (offline?); trying without dependencies"
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . 2>>"$OUT/pip.log" || true
fi
"$VENV/bin/python" -c 'import click, deepdiff, pyarrow, pytest, rich, harness.cli, reference.runners.torch_model' \
    || { log "missing dependencies (see $OUT/pip.log)"; exit 2; }
"$VENV/bin/python" - <<'EOF' || { log "torch does not see a CUDA GPU"; exit 2; }
from reference.runners.torch_model import torch
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF

status=0
log "CUDA-marked tests"
HARNESS_SKIP_VLLM=1 timeout 150 "$VENV/bin/python" -m pytest -rs -m cuda tests/test_torch_runner.py \
    2>&1 | tee "$OUT/pytest-cuda.log" || status=1
grep -qE '[0-9]+ passed' "$OUT/pytest-cuda.log" && ! grep -qE '[0-9]+ (skipped|failed|error)' "$OUT/pytest-cuda.log" \
    || { log "CUDA tests did not all run and pass"; status=1; }
log "benchmark (CPU and CUDA)"
timeout 120 "$VENV/bin/python" bench/bench_torch.py --device all 2>&1 | tee "$OUT/bench.txt" || status=1
log "done, exit $status (logs in $OUT)"
exit $status
