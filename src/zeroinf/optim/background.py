"""Optimizer kernels on a worker thread while backward goes on (`offload.step_thread`).

With the optimizer states on the host and the step inside backward, each unit's CPU AdamW ran on
the thread that runs backward's hooks, and while it ran no kernel of the rest of backward was
queued: on an H100 a 1.1B Llama's backward took 0.61-0.75 s with the optimizer on the host, of which
0.47 s was the fused CPU kernel and ~0.13 s the GPU's own backward (cProfile, bf16, 4 x 2048 tokens).

Only the kernel moves: `submit(work, complete)` runs `work` (pure CPU arithmetic on host tensors,
no stream, no engine state) on the one worker thread, in order; `complete` (the gradient's release,
the updated parameters' upload, anything that touches units or transfers) runs later on the
caller's thread, in submission order, when `complete_finished()` finds the work done or `drain()`
waits for it. So every engine object keeps being used by one thread at a time. The engine drains
before backward's last hook touches the units and again before backward returns: outside
backward nothing runs in the background.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundSteps:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zeroinf-step")
        self._queue: deque[tuple[Future[None], Callable[[], None]]] = deque()
        self.submitted = 0  # kernels run on the worker since construction (tests and reports)

    def submit(self, work: Callable[[], None], complete: Callable[[], None]) -> None:
        self._queue.append((self._executor.submit(work), complete))
        self.submitted += 1

    def complete_finished(self) -> None:
        """Run the completions of the work already done, oldest first; never waits."""
        while self._queue and self._queue[0][0].done():
            self._complete_oldest()

    def drain(self) -> None:
        """Wait for every submitted kernel and run every completion, oldest first."""
        while self._queue:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        future, complete = self._queue[0]
        try:
            future.result()
        except BaseException:
            self._abandon()
            raise
        self._queue.popleft()
        complete()

    def _abandon(self) -> None:
        """After a failed kernel: let the rest finish (none may still write states), run no completion."""
        for future, _ in self._queue:
            future.exception()
        self._queue.clear()

    def close(self) -> None:
        self._abandon()
        self._executor.shutdown(wait=True)
