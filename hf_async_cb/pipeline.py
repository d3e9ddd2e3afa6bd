"""The decode loops. SyncLoop: schedule, build, run, wait, update, one step after another.

Timeline of the sync loop (the baseline): the device idles while the CPU schedules and builds
step N+1, and the CPU idles while the device computes it.

    CPU  | sched+build N |  wait  | update N | sched+build N+1 |  wait  | ...
    GPU  |               | step N |          |                 | step N+1 |
"""

from __future__ import annotations

from .batch import BatchBuilder
from .requests import Request
from .runner import ModelRunner
from .scheduler import Scheduler


class SyncLoop:
    def __init__(self, scheduler: Scheduler, builder: BatchBuilder, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.builder = builder
        self.runner = runner
        self.num_steps = 0

    def step(self) -> list[Request]:
        """Run one step; return the requests it finished."""
        plan = self.scheduler.schedule()
        inputs = self.builder.build(plan)
        tokens = self.runner.step(inputs).tolist()  # the one host sync of the step
        self.num_steps += 1
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
        finished = []
        for req, token in zip(inputs.sample_requests, tokens):
            if req.append_token(token):
                self.scheduler.finish(req)
                finished.append(req)
        return finished

    def drain(self) -> list[Request]:
        """Nothing is in flight in the sync loop."""
        return []
