"""The transformers side: `model.generate(..., batching="sync" | "async")` runs on the engine.

    hook.py           install() / uninstall(): wraps GenerationMixin.generate, picks the mode
    call.py           one call on the engine: requests in, stock's output format out
    arguments.py      the call's arguments checked and read as stock reads them
    stock_options.py  GenerationConfig -> SamplingParams; stock's processors for the rest
    outputs.py        padded sequences, scores and logits as stock returns them
    streaming.py      feeding a transformers streamer
"""

from hf_async_cb.generate.hook import install, is_installed, uninstall

__all__ = ["install", "is_installed", "uninstall"]
