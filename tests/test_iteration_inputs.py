"""graphstep.Iteration's static inputs (graphstep/iteration/inputs.py) on the CPU: a batch is copied into tensors
that keep their addresses, directly (no pinned memory, no side stream: those are for CUDA, where
tests/cuda/test_iteration_cuda.py checks them)."""

import torch

from graphstep.iteration.inputs import StaticBatch


def test_on_the_cpu_a_batch_is_copied_directly_into_static_tensors():
    first = [(torch.arange(6).reshape(2, 3), torch.ones(2)), (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2))]
    static = StaticBatch(first, torch.device("cpu"))
    assert static.side_stream is None and not static.pins  # the CUDA path is not taken
    addresses = [t.data_ptr() for t in static.tensors]
    for batch in (first, [(x + 1, y * 2) for x, y in first]):
        static.copy_in(batch)
        flat = [t for mb in batch for t in mb]
        assert all(torch.equal(s, x) for s, x in zip(static.tensors, flat))
        assert [t.data_ptr() for t in static.tensors] == addresses
        assert all(s.data_ptr() != x.data_ptr() for s, x in zip(static.tensors, flat))  # copies, not the caller's
