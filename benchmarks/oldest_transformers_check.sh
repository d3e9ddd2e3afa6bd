#!/usr/bin/env bash
# The test suite under the oldest transformers the package supports (5.17, the GPU machine's), on the CPU:
# a virtual environment over this Python's packages with only transformers replaced. VENV (default
# /tmp/hf_async_cb_tf517) is made once and reused; arguments go to pytest (default: the whole suite).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/hf_async_cb_tf517}
VERSION=${TRANSFORMERS_VERSION:-5.17.0}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q "transformers==$VERSION"
fi
"$VENV/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
PYTHONPATH=. "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rf "$@"
