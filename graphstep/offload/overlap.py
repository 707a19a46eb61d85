"""ChunkWorker: the host part of an offloaded step on a worker thread, chunk by chunk, overlapped.

``step()`` returns at once; the worker waits for the device step's event (the step's one host wait), then per
chunk in forward order runs the host update, the cast and the H2D copies (one chunk's copy overlapping the
next chunk's update). Forward and state-dict pre-hooks make the next forward (or a model save) wait only for
the chunks holding their params; ``finish`` waits for everything. torch's CPU kernels release the GIL, so the
worker really runs alongside the main thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from ..plan.model_params import as_chunks
from ..hooks import weak_hooks


class ChunkWorker:
    def __init__(self, offload, model_chunks, ctx):
        self._offload = offload
        self._chunks = offload.chunks
        self._device = torch.device(ctx.buffers.param_flat[0].device)
        self._accelerator = self._device.type != "cpu"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphstep-offload")
        self._future: Optional[Future] = None
        self._ready = [threading.Event() for _ in self._chunks]
        self._events: list = [None] * len(self._chunks)
        self._stream = torch.Stream(device=self._device) if self._accelerator else None
        self._handles = weak_hooks.Handles(self)
        self.waited_chunks = 0
        """How many chunk waits a forward pre-hook made before the chunk was ready (for tests and stats)."""
        self._install_forward_hooks(ctx, model_chunks)

    def start(self, device_step_done, hyper_rows: list) -> None:
        self.finish()
        for ready in self._ready:
            ready.clear()
        self._future = self._pool.submit(self._run, device_step_done, hyper_rows)

    def _run(self, device_step_done, rows: list) -> None:
        try:
            if device_step_done is not None:
                device_step_done.synchronize()  # the step's one host wait, on this thread
                self._stream.wait_event(device_step_done)  # copies start after the device step's reads
            for c, chunk in enumerate(self._chunks):
                self._offload.update_chunk(chunk, rows)
                if self._stream is not None:
                    with self._stream:  # the worker's current stream: the H2D copies queue on it
                        self._offload.copy_chunk(chunk)
                    event = torch.Event(device=self._device)
                    event.record(self._stream)
                    self._events[c] = event
                else:
                    self._offload.copy_chunk(chunk)
                self._ready[c].set()
        finally:
            for ready in self._ready:  # a failure surfaces in finish(); never leave a forward hanging
                ready.set()

    def wait_chunks(self, indices) -> None:
        if self._future is None:
            return
        for c in indices:
            if not self._ready[c].is_set():
                self.waited_chunks += 1
                self._ready[c].wait()
            if self._events[c] is not None:
                torch.accelerator.current_stream(self._device).wait_event(self._events[c])

    def finish(self) -> None:
        future, self._future = self._future, None
        if future is None:
            return
        future.result()  # re-raises a failure of the host update here, on the training thread
        if self._accelerator:
            stream = torch.accelerator.current_stream(self._device)
            for event in self._events:
                if event is not None:
                    stream.wait_event(event)
        self._events = [None] * len(self._chunks)

    def close(self) -> None:
        self._handles.remove()
        try:
            self.finish()
        finally:
            self._pool.shutdown(wait=True)

    def _install_forward_hooks(self, ctx, model_chunks) -> None:
        if model_chunks is None:
            return
        modules = as_chunks(model_chunks)
        chunk_of = {}
        for c, chunk in enumerate(self._chunks):
            for index in chunk.params:
                chunk_of.setdefault(id(ctx.buffers.params[index]), set()).add(c)

        for root in modules:
            for module in root.modules():
                if not any(True for _ in module.parameters(recurse=False)):
                    continue
                needed = sorted({c for p in module.parameters() for c in chunk_of.get(id(p), ())})
                if needed:
                    hook = weak_hooks.calling(self, "_before_forward", tuple(needed))
                    self._handles.append(module.register_forward_pre_hook(hook))
                    # A model save right after the step (torch.save, safetensors, save_pretrained) must not
                    # take params the worker has not written yet.
                    hook = weak_hooks.calling(self, "_before_state_dict", tuple(needed))
                    self._handles.append(module.register_state_dict_pre_hook(hook))

    def _before_forward(self, indices: tuple[int, ...], module, args) -> None:
        self.wait_chunks(indices)

    def _before_state_dict(self, indices: tuple[int, ...], module, prefix, keep_vars) -> None:
        self.wait_chunks(indices)
