"""hf_async_cb: asynchronous continuous batching for Hugging Face transformers.

`import hf_async_cb` installs the hook, so that `model.generate(..., batching="async")` (or
"sync") runs on the engine; `hf_async_cb.uninstall()` restores stock generate.
"""

import transformers as _transformers
from packaging.version import Version as _Version

if _Version(_transformers.__version__) < _Version("5.17"):
    raise ImportError(f"hf_async_cb needs transformers >= 5.17, found {_transformers.__version__}.")

from hf_async_cb._moved import install_finder  # noqa: E402
from hf_async_cb.config import BatchingConfig  # noqa: E402
from hf_async_cb.engine.data_parallel import DataParallel  # noqa: E402
from hf_async_cb.engine.engine import Engine  # noqa: E402
from hf_async_cb.engine.prompt_embeds import PromptEmbeds  # noqa: E402
from hf_async_cb.engine.requests import FinishReason, RequestOutput, SamplingParams  # noqa: E402
from hf_async_cb.generate.hook import install, is_installed, uninstall  # noqa: E402
from hf_async_cb.generate.runtime import clear_prefix_cache, prefix_cache_stats, release, runtime_info  # noqa: E402

__version__ = "0.3.1"

__all__ = ["BatchingConfig", "DataParallel", "Engine", "FinishReason", "PromptEmbeds", "RequestOutput", "SamplingParams",
           "clear_prefix_cache", "install", "is_installed", "prefix_cache_stats", "release", "runtime_info", "uninstall",
           "__version__"]

install()
install_finder()  # the 0.2 module paths keep importing (hf_async_cb/_moved.py)
