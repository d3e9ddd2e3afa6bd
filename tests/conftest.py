import os
import sys

import torch

# Without CUDA, Triton kernels run only in Triton's interpreter, which must be chosen before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

import hf_async_cb  # noqa: E402,F401  (installs the hook)
