#!/usr/bin/env bash
# Set up ./.venv with liger_rt installed (editable). `scripts/setup.sh dev` adds the test extra.
#
# torch: a torch that is already importable (e.g. your CUDA or ROCm build, seen through
# --system-site-packages) is kept as it is. Only when there is none do we install torch==2.13.0,
# the CPU build these machines have locally (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found; installing torch==2.13.0 (CPU build)"
  .venv/bin/python -m pip install -q "torch==2.13.0"
else
  echo "setup: keeping the installed torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi
log=$(mktemp)
if ! .venv/bin/python -m pip install -q -e ".${extra}" >"$log" 2>&1; then
  cat "$log"; echo "setup: pip install failed" >&2; exit 1
fi
grep -v "is ignored: it is neither" "$log" || true
rm -f "$log"
.venv/bin/python -c "import liger_rt, torch, triton, transformers, sqlite_utils; print('setup: liger_rt', liger_rt.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
