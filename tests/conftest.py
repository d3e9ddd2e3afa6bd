import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import hf_async_cb  # noqa: E402,F401  (installs the hook)
