"""The offloaded optimizer's update behind the next step's forward (``parallel.offload_overlap``).

The step ends once its gradients and clipping factor are final on the device; a thread of its own
then runs the span updates of tessera.optim.offload in the order the next forward reads the
parameters (embedding, layer 0, ...), on a side CUDA stream:

1. that stream waits for the step's work (an event), brings the clipping factor and skip flag
   down, and each span's gradient down (double-buffered as in the synchronous step);
2. AdamW (torch's fused CPU kernel, which releases the GIL) updates the span on the host;
3. its parameters go back up, and an event recorded after that copy marks the span done.

Meanwhile the main thread launches the next step. A forward pre-hook on each module that reads
parameters first (distributed/readers.py) waits for the spans holding them: on the host until the
thread has queued their copy back, then on the device (the current stream waits for the span's
event); no host wait for the GPU. Whatever else reads or writes the parameters, main parameters,
Adam's state or the gradient buffers outside the forward joins the thread first
(``MainParamOptimizer.wait``): the next step's gradients, checkpoints, evaluation, the end of
training. An error in the thread is raised at that join.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from tessera.distributed.readers import forward_readers


def forward_spans(chunks: list[nn.Module], span_params: list[set[nn.Parameter]]):
    """(the spans in the order the forward first reads them, [(module, its spans in that order)])
    for spans holding ``span_params``: a span's place is that of the first module reading any of
    its parameters (the buffers lay the layers out back to front, so bucket order is backward order)."""
    readers = [(module, params) for chunk in chunks for module, params in forward_readers(chunk)]
    first: dict[nn.Parameter, int] = {}
    for n, (_, params) in enumerate(readers):
        for p in params:
            first.setdefault(p, n)
    place = [min((first.get(p, len(readers)) for p in params), default=len(readers)) for params in span_params]
    order = sorted(range(len(span_params)), key=lambda k: (place[k], k))
    rank = {k: n for n, k in enumerate(order)}
    waits = []
    for module, params in readers:
        spans = sorted((k for k, held in enumerate(span_params) if held & params), key=rank.__getitem__)
        if spans:
            waits.append((module, spans))
    return order, waits


class BackgroundUpdate:
    """One step's span updates on a thread, and the waits for them. :meth:`start` runs
    ``work(done)``, which calls ``done(k)`` once span ``k``'s parameters are on their way back
    (queued on :attr:`stream` on CUDA); :meth:`wait_for` returns once given spans are done;
    :meth:`join` waits for everything and raises what the thread raised."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # (the thread's own default would be 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._flags: list[threading.Event] = []
        self._events: list[torch.cuda.Event | None] = []

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, work: Callable[[Callable[[int], None]], None], spans: int) -> None:
        self.join()
        flags, events = [threading.Event() for _ in range(spans)], [None] * spans
        self._flags, self._events = flags, events

        def done(k: int) -> None:
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
                events[k] = event
            flags[k].set()

        def run() -> None:
            try:
                if self.stream is None:
                    work(done)
                else:
                    torch.cuda.set_device(self.device)  # (a new thread starts on device 0)
                    with torch.cuda.stream(self.stream):
                        work(done)
                    self.stream.synchronize()  # (joined = every copy landed: the host may write main params)
            except BaseException as e:  # raised on the training's thread by join()
                self._error = e
            finally:
                for flag in flags:  # (after an error too: the waiters wake up and find it)
                    flag.set()

        self._thread = threading.Thread(target=run, daemon=True, name="tessera-offload-update")
        self._thread.start()

    def wait_for(self, spans: list[int]) -> None:
        """Spans ``spans`` updated and back in the model before the current stream reads them:
        the host waits for the thread to have queued their copies, the device for those copies."""
        if self._thread is None:
            return
        for k in spans:
            self._flags[k].wait()
            if self._error is not None:
                self.join()  # (raises it)
            event = self._events[k]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def hook(self, spans: list[int]):
        """A forward pre-hook waiting for ``spans`` (left out of compiled graphs: it runs eagerly)."""
        @torch.compiler.disable
        def wait(module, args) -> None:
            self.wait_for(spans)
        return wait

    def join(self) -> None:
        """Wait for the whole update (the current stream too, for its copies); raise its error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        self._flags, self._events = [], []
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the offloaded optimizer's update, run behind the forward "
                               f"(parallel.offload_overlap), failed: {type(error).__name__}: {error}") from error
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


__all__ = ["BackgroundUpdate", "forward_spans"]
