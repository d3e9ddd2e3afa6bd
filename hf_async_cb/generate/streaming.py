"""Feeding a transformers streamer (TextStreamer, TextIteratorStreamer, ...) from the engine.

Stock generate calls streamer.put(input_ids) once, then streamer.put(tokens [batch]) once per step,
finished rows given pad_token_id, then streamer.end(). The engine's requests do not move in
lockstep, so this adapter holds tokens back until every row has its i-th token (or has finished),
and then puts them as stock's i-th step would.

A call that fails ends the streamer (release_streamer), where stock leaves it open: a consumer
iterating a TextIteratorStreamer in another thread would otherwise wait forever on a call that is
gone, which the engine's own refusals (options stock runs) made a new way to hang.
"""

from __future__ import annotations

import torch

from hf_async_cb.engine.requests import Request


class LockstepStreamer:
    raised_by = "streamer's put() (it streams every row of the call)"  # (how a failure of put() is named)

    def __init__(self, streamer, input_ids: torch.Tensor, pad_token_id: int | None) -> None:
        self.streamer = streamer
        self.pad = pad_token_id
        self.requests: list[Request] = []
        self.next_index = 0
        self._call(streamer.put, input_ids.cpu())

    @staticmethod
    def _call(method, *args) -> None:
        """The streamer's put or end, its own error marked as its own (release_streamer)."""
        try:
            method(*args)
        except BaseException as error:
            _mark_raised_by_streamer(error)
            raise

    def watch(self, requests: list[Request]) -> None:
        self.requests = requests

    def on_token(self, request: Request, token: int) -> None:
        while True:
            column = []
            for r in self.requests:
                if len(r.output_token_ids) > self.next_index:
                    column.append(r.output_token_ids[self.next_index])
                elif r.is_finished:
                    column.append(self.pad)
                else:
                    return  # a row has not produced this step's token yet
            if all(len(r.output_token_ids) <= self.next_index for r in self.requests):
                return  # everyone finished: nothing more to put
            self._call(self.streamer.put, torch.tensor(column, dtype=torch.long))
            self.next_index += 1

    def end(self) -> None:
        self._call(self.streamer.end)


_RAISED_BY_STREAMER = "__hf_async_cb_raised_by_streamer__"


def _mark_raised_by_streamer(error: BaseException) -> None:
    try:
        setattr(error, _RAISED_BY_STREAMER, True)
    except Exception:  # noqa: BLE001 - an exception type that takes no attributes: treated as the call's
        pass


def release_streamer(streamer, error: BaseException) -> None:
    """After a failed call: end `streamer` so that whoever waits on it (a TextIteratorStreamer's
    consumer) is released instead of waiting forever, unless the streamer itself raised (stock's
    calls then: no end(); a TextStreamer refusing a batch > 1 would print a stray newline). Stock
    generate never ends it on an error; the engine also refuses options stock runs, so without this a
    refusal in a generate thread hung the consumer for good. An error of end() is noted on `error`,
    which is what the caller raises."""
    if streamer is None or getattr(error, _RAISED_BY_STREAMER, False):
        return
    try:
        streamer.end()
    except Exception as failure:  # noqa: BLE001
        error.add_note(f"hf_async_cb: ending the streamer after this error raised too: {failure!r}")
