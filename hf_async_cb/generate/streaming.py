"""Feeding a transformers streamer (TextStreamer, TextIteratorStreamer, ...) from the engine.

Stock generate calls streamer.put(input_ids) once, then streamer.put(tokens [batch]) once per step,
finished rows given pad_token_id, then streamer.end(). The engine's requests do not move in
lockstep, so this adapter holds tokens back until every row has its i-th token (or has finished),
and then puts them as stock's i-th step would.
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
        streamer.put(input_ids.cpu())

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
            self.streamer.put(torch.tensor(column, dtype=torch.long))
            self.next_index += 1

    def end(self) -> None:
        self.streamer.end()
