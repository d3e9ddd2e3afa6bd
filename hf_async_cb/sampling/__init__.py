"""Choosing the next token: the sampler and the logits processors the engine runs on the device.

    sampler.py            SamplingTensors and the torch sampler (the CPU path and the kernels' reference)
    device_processors.py  repetition penalty, n-gram and bad-word blocks, sequence bias, min length
    token_history.py      every token fed to the model, on the device, for the history processors
"""


def __getattr__(name: str):
    """The 0.2 module hf_async_cb.sampling is now sampling/sampler.py: its names still resolve."""
    import warnings

    from hf_async_cb.sampling import sampler

    if name.startswith("__") or not hasattr(sampler, name):
        raise AttributeError(f"module 'hf_async_cb.sampling' has no attribute {name!r}")
    warnings.warn(f"hf_async_cb.sampling.{name} has moved: import it from hf_async_cb.sampling.sampler",
                  DeprecationWarning, stacklevel=2)
    return getattr(sampler, name)
