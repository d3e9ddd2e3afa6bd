#!/usr/bin/env bash
# A change to the decode attention kernels, A/B in one device call (first used for a split merge taking
# several heads per program, which changed nothing: docs/benchmarks.md, 2026-12-05, seventh session).
# A = the tree in .ab/base (carry .ab; e.g. `git archive <commit> | tar -x -C .ab/base`), B = this tree. Each side: the decode attention of a 1B group step (256 rows in groups of 8 over a
# 1,024-token shared prefix + 192 own) and of an 8B step of 32 rows over 4K tokens (split contexts),
# in CUDA graphs with cold L2 (benchmarks/shared_prefix_attention.py); then the 1B group workload on a
# held Engine (benchmarks/group_step_probe.py --quick: caching on / off, ms per decode step). Then the
# attention tests on the device (B only; TESTS=0 skips them). ROUNDS=1: one round. Results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
for round in ${ROUNDS:-1 2}; do
  for side in A B; do
    root=.; [ $side = A ] && root=.ab/base
    echo "=== round $round, $side ($root)"
    PYTHONPATH=$root timeout 90 python3 benchmarks/shared_prefix_attention.py --rows 256 --group 8 --prefix 1024 \
      --own 192 --shape 1b 2>&1 | grep -E "^(distinct|adjacent, read once)" | cut -c1-120
    PYTHONPATH=$root timeout 90 python3 benchmarks/shared_prefix_attention.py --rows 32 --group 1 --prefix 0 \
      --own 4096 --shape 8b 2>&1 | grep -E "^distinct" | cut -c1-120
    [ $round = 1 ] && PYTHONPATH=$root timeout 120 python3 benchmarks/group_step_probe.py --quick 2>&1 \
      | grep -E "^(async|wall)" | cut -c1-200
  done
done
[ "${TESTS:-1}" = 0 ] && exit 0
echo "=== tests (B)"
PYTHONPATH=. timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
  tests/test_shared_prefix_attention.py 2>&1 | tail -3
