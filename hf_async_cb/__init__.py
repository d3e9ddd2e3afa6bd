"""hf_async_cb: asynchronous continuous batching for Hugging Face transformers.

`import hf_async_cb` installs the hook, so that `model.generate(..., batching="async")` (or
"sync") runs on the engine; `hf_async_cb.uninstall()` restores stock generate.
"""

from .config import BatchingConfig
from .engine import Engine
from .integration import install, is_installed, uninstall
from .requests import FinishReason, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["BatchingConfig", "Engine", "FinishReason", "RequestOutput", "SamplingParams", "install",
           "is_installed", "uninstall", "__version__"]

install()
