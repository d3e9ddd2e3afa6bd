"""The progress bar of a generate call (BatchingConfig(progress=True), or progress="its label")."""

from __future__ import annotations

import time

from hf_async_cb.engine.requests import Request


class Progress:
    """A tqdm bar over finished requests. Its postfix, the tokens generated so far and their rate,
    is refreshed as the run goes, at most every `interval` seconds (a sum over the requests' token
    lists, no device sync), so that a few long requests show progress too. A no-op when off.
    Tokens count as each request's output does: its EOS token included."""

    interval = 0.5  # seconds between postfix refreshes
    clock = staticmethod(time.perf_counter)  # (tests give it a fake one)

    def __init__(self, requests: list[Request], enabled: bool | str) -> None:
        """`enabled`: BatchingConfig.progress, a flag or the bar's label (several bars in one run,
        such as a benchmark's, then say which is which)."""
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.requests = requests
            label = enabled if isinstance(enabled, str) else "hf_async_cb"
            self.bar = tqdm(total=len(requests), unit="req", desc=label)
            self.start = self.shown = self.clock()

    def update(self, finished: list[Request]) -> None:
        """After a step: count the requests it finished; refresh the postfix if it is due."""
        if self.bar is None:
            return
        if finished:
            self.bar.update(len(finished))
        now = self.clock()
        if now - self.shown >= self.interval:
            self._show_tokens(now, refresh=True)

    def _show_tokens(self, now: float, refresh: bool) -> None:
        self.shown = now
        tokens = sum(len(r.output_token_ids) for r in self.requests)
        rate = tokens / max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"{tokens:,} tok, {rate:,.0f} tok/s", refresh=refresh)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self._show_tokens(self.clock(), refresh=False)  # the totals, on the line close() leaves
            self.bar.close()
