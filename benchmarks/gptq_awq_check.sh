#!/usr/bin/env bash
# GPTQ and AWQ checkpoints on the CPU (tests/test_gptq_awq.py), in a virtual environment of their own:
# gptqmodel 7.7, which transformers loads both formats through, needs torch >= 2.14.1 and transformers
# >= 5.20, newer than the torch the package's tests pin (the CI skips these tests by name).
# VENV (default /tmp/hf_async_cb_gptq) is made once and reused. gptqmodel compiles its CPU kernel on
# first use (~80 s on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/hf_async_cb_gptq}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch>=2.14.1" "transformers>=5.20.2" "gptqmodel>=7.7" optimum \
    pytest pytest-benchmark hypothesis
  "$VENV/bin/pip" install -q --no-deps -e .
fi
"$VENV/bin/python" -c "import torch, transformers, gptqmodel, optimum; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'gptqmodel', gptqmodel.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_gptq_awq.py "$@"
