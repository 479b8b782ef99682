"""Asynchronous compressed calls: one worker thread per group, and the Work it returns.

``async_op=True`` is a promise that the caller's thread goes on while the collective
runs (DDP's reducer and FSDP2's prefetching all-gathers compute behind it). An exact
collective keeps it through gloo's own threads; a compressed one also quantizes and
decodes, so on CPU the whole call (codec and inner collectives) runs on the group's
worker thread, and the caller gets an :class:`AsyncWork` at once. torch's ops release
the GIL while they compute, as gloo's waits do, so the caller's compute and the call
really overlap.

Order is the contract that makes this safe: every rank must issue a group's inner
collectives in the same order. The worker runs the group's calls one at a time in the
order they were submitted, and anything the caller issues on the group outside the
worker (an exact call, a synchronous compressed one, a forwarded broadcast or barrier)
first :meth:`Engine.drain`\\s it: waits for the calls in flight to finish. What a failed
call means for the group (every later call fails, unless every rank refused it alike) is
the driver's (:meth:`qcomm.driver.GroupState.fail`), for synchronous and asynchronous
calls alike.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class AsyncWork(dist.Work):
    """The Work of a compressed call running on a group's worker: ``wait()`` blocks until
    it has finished and raises its error; ``is_completed()`` and ``get_future()`` tell
    the truth (the future holds ``result``, the output tensors, as gloo's does)."""

    def __init__(self, future: concurrent.futures.Future, result) -> None:
        super().__init__()
        self._future = future
        self._result = result
        self._torch_future = torch.futures.Future()
        future.add_done_callback(self._finished)

    def _finished(self, future: concurrent.futures.Future) -> None:
        err = future.exception()
        if err is None:
            self._torch_future.set_result(self._result)
        else:
            self._torch_future.set_exception(err)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        try:
            self._future.result(seconds or None)
        except concurrent.futures.TimeoutError:
            raise dist.DistBackendError(
                f"qcomm: a compressed call did not finish within {timeout}") from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self):
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> torch.futures.Future:
        return self._torch_future

    def result(self):
        return self._result

    def synchronize(self) -> None:
        self.wait()


class Engine:
    """A group's worker: runs submitted calls one at a time, in submission order, on one
    daemon thread (a call stuck on a dead peer must not keep the process from exiting;
    its group's timeout ends it)."""

    def __init__(self, name: str = "qcomm") -> None:
        self._name = name
        self._queue: queue.SimpleQueue | None = None
        self._last: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._worker: int | None = None  # the worker thread's ident

    def submit(self, fn, result) -> AsyncWork:
        """Run ``fn()`` after every call submitted before it; its Work holds ``result``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                thread = threading.Thread(target=self._loop, args=(self._queue,),
                                          name=self._name, daemon=True)
                thread.start()
                self._worker = thread.ident
            self._last = future
            self._queue.put((fn, future))
        return AsyncWork(future, result)

    def _loop(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, future = job
            future.set_running_or_notify_cancel()
            try:
                self._run(fn)
            except BaseException as err:  # noqa: BLE001 (delivered through the Work)
                future.set_exception(err)
            else:
                future.set_result(None)

    def _run(self, fn) -> None:
        with torch.no_grad():  # grad mode is per thread: the caller's does not carry
            fn()

    def drain(self) -> None:
        """Wait for the calls in flight (their errors stay with their Works)."""
        last = self._last
        if last is not None and threading.get_ident() != self._worker:
            concurrent.futures.wait([last])

    def shutdown(self) -> None:
        """Stop the worker once the calls already submitted have run."""
        with self._lock:
            jobs, self._queue = self._queue, None
        if jobs is not None:
            jobs.put(None)


class Works(dist.Work):
    """One Work for several (a list form's, a coalescing window's): ``wait()`` waits for
    each in turn; the future holds ``result`` once all have finished."""

    def __init__(self, works: list, result=None) -> None:
        super().__init__()
        self._works = works
        self._result = result if result is not None else []

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout) if timeout else work.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self):
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def get_future(self) -> torch.futures.Future:
        result = self._result

        def finished(done):
            for future in done.wait():
                future.wait()  # raises the first failure
            return result

        return torch.futures.collect_all([w.get_future() for w in self._works]).then(finished)

    def result(self):
        return self._result

    def synchronize(self) -> None:
        self.wait()


class StreamWork(dist.Work):
    """The Work of a compressed call queued on qcomm's own CUDA stream (NCCL's contract):
    ``wait()`` makes the waiting thread's current stream wait for the call, without
    blocking the host; ``is_completed()`` asks the event; ``get_future()`` is CUDA-aware
    (a consumer's ``wait()`` orders its stream after the call)."""

    def __init__(self, stream, result, device: torch.device) -> None:
        super().__init__()
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._device = device
        self._result = result
        self._future = torch.futures.Future(devices=[device])
        with torch.cuda.stream(stream):
            self._future.set_result(result)  # records the stream's progress for waiters

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self):
        return self._result

    def synchronize(self) -> None:
        self._event.synchronize()


def on_side_stream(streams: dict, body, device: torch.device, tensors, result) -> StreamWork:
    """Run ``body()`` (which queues CUDA work) on the group's stream for ``device`` after
    what the caller's stream has queued; ``tensors`` (inputs and outputs, allocated on
    the caller's stream) are marked used by that stream, so the caching allocator does
    not hand their memory out again before the call has passed."""
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)
    with torch.cuda.stream(stream):
        body()
    return StreamWork(stream, result, device)
