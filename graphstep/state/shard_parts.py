"""Addressing a kind's values ("main" or a state name) in this rank's shard, wherever they live: the device
buffers, the host part past the offload split (CPU offload), or encoded below fp32 (the precision-aware
optimizer's stored states). ``StaticBuffers`` (buffers.py) holds the tensors; checkpoints, the debug step and
the param-write check read and write through these methods, never the raw tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from .precision import StoredState


class ShardParts:
    """The shard-addressing half of ``StaticBuffers`` (buffers.py), which supplies ``layout``, ``rank``,
    ``param_flat``, ``main_shard``, ``state``, ``state_ranges``, ``stored`` and ``host``."""

    @property
    def main_is_param(self) -> list[bool]:
        """Per buffer: the main params are the model params themselves (updated in place)."""
        return [m.data_ptr() == p.data_ptr() and m.dtype == p.dtype
                for m, p in zip(self.main_shard, self.param_flat)]

    def main_range(self, buffer: int, shard_start: int, numel: int) -> torch.Tensor:
        """Main params ``[shard_start, shard_start + numel)`` of this rank's shard of ``buffer`` (a range inside
        one bucket's shard, as every Segment and OwnedRange is): a view of ``main_shard``, or of
        ``param_flat`` where the main params are the params."""
        if not self.main_is_param[buffer]:
            return self.main_shard[buffer][shard_start:shard_start + numel]
        flat = self._flat_offset(buffer, shard_start, numel)
        return self.param_flat[buffer][flat:flat + numel]

    def _flat_offset(self, buffer: int, shard_start: int, numel: int) -> int:
        for index in self.layout.buffers[buffer].buckets:
            bucket = self.layout.buckets[index]
            if bucket.shard_offset <= shard_start < bucket.shard_offset + bucket.shard_numel or numel == 0:
                if shard_start + numel > bucket.shard_offset + bucket.shard_numel:
                    raise ValueError(f"shard range [{shard_start}, {shard_start + numel}) of buffer {buffer} crosses "
                                     f"the end of bucket {index}'s shard: address one bucket at a time")
                return bucket.shard_range(self.rank)[0] + shard_start - bucket.shard_offset
        raise ValueError(f"shard offset {shard_start} is outside buffer {buffer}'s shard")

    def main_shard_values(self, buffer: int) -> torch.Tensor:
        """A compact copy of this rank's main params of ``buffer`` (what a checkpoint saves)."""
        if not self.main_is_param[buffer] or self.layout.dp_size == 1:
            return self.main_shard[buffer].clone()
        return torch.cat([self.main_range(buffer, b.shard_offset, b.shard_numel) for b in self._buckets(buffer)])

    def load_main_shard(self, buffer: int, values: torch.Tensor) -> None:
        """Copy a compact shard (``main_shard_values``' form) into this rank's main params of ``buffer``."""
        if not self.main_is_param[buffer] or self.layout.dp_size == 1:
            self.main_shard[buffer].copy_(values)
            return
        for b in self._buckets(buffer):
            self.main_range(buffer, b.shard_offset, b.shard_numel).copy_(values[b.shard_offset:b.shard_offset
                                                                                + b.shard_numel])

    def _buckets(self, buffer: int):
        return [self.layout.buckets[i] for i in self.layout.buffers[buffer].buckets]

    def stored_kind(self, kind: str, buffer: int) -> Optional[StoredState]:
        """The ``StoredState`` of ``kind`` in ``buffer``, or None where it is kept in full precision."""
        per_buffer = self.stored.get(kind)
        return None if per_buffer is None else per_buffer[buffer]

    def _stored_offset(self, kind: str, buffer: int, start: int, size: int) -> int:
        return start if kind == "main" else self.state_ranges[kind].offset(buffer, start, size)

    def _read_stored(self, stored: StoredState, buffer: int) -> torch.Tensor:
        """All of ``stored`` as fp32, a bucket's shard at a time (the main params' remainders pair with bf16
        params that lie a bucket at a time in ``param_flat``)."""
        return torch.cat([stored.read(b.shard_offset, b.shard_offset + b.shard_numel)
                          for b in self._buckets(buffer) if b.shard_numel]
                         or [torch.zeros(0, dtype=torch.float32, device=stored.data.device)])

    def _write_stored(self, stored: StoredState, buffer: int, values: torch.Tensor) -> None:
        values = values.to(torch.float32)
        for b in self._buckets(buffer):
            if b.shard_numel:
                stored.write(b.shard_offset, b.shard_offset + b.shard_numel,
                             values[b.shard_offset:b.shard_offset + b.shard_numel])

    def _device_part(self, kind: str, buffer: int) -> torch.Tensor:
        return self.main_shard[buffer] if kind == "main" else self.state[kind][buffer]

    def device_numel(self, buffer: int) -> int:
        """How much of this rank's shard of ``buffer`` the device holds main params and state for: the
        prefix ``[0, device_numel)``; all of it without CPU offload."""
        return self.host.splits[buffer] if self.host is not None else self.layout.buffers[buffer].shard_numel

    def shard_part(self, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
        """A view of elements ``[start, start + size)`` of this rank's shard of ``kind`` ("main" or a state
        name), on the device or, past the offload split, on the host. Never straddles the split: the
        split falls between params, and callers ask for one param's piece."""
        split = self.device_numel(buffer)
        if start + size <= split:
            if kind == "main":
                return self.main_range(buffer, start, size)
            offset = self.state_ranges[kind].offset(buffer, start, size)
            if offset is None:
                raise ValueError(f"state {kind!r} is not kept for shard range [{start}, {start + size}) of buffer "
                                 f"{buffer}: that group's family does not declare it (ask keeps_state first)")
            return self.state[kind][buffer][offset:offset + size]
        if start < split:
            raise ValueError(f"shard range [{start}, {start + size}) of buffer {buffer} straddles the offload "
                             f"split at {split}")
        return self.host.part(kind, buffer)[start - split:start - split + size]

    def read_part(self, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
        """The values of ``shard_part(kind, ...)``: that view itself, or for a state stored below fp32 a copy of
        its fp32 values (a range of whole pieces: one param's part, as checkpoints address it)."""
        stored = self.stored_kind(kind, buffer)
        if stored is not None:
            offset = self._stored_offset(kind, buffer, start, size)
            return stored.read(offset, offset + size)
        return self.shard_part(kind, buffer, start, size)

    def write_part(self, kind: str, buffer: int, start: int, size: int, source: torch.Tensor) -> None:
        """Set the values of ``shard_part(kind, ...)`` to ``source`` (stored below fp32: encoded, its scale
        recomputed)."""
        stored = self.stored_kind(kind, buffer)
        if stored is not None:
            offset = self._stored_offset(kind, buffer, start, size)
            stored.write(offset, offset + size, source.to(torch.float32))
        else:
            self.shard_part(kind, buffer, start, size).copy_(source)

    def keeps_state(self, name: str, buffer: int, start: int, size: int) -> bool:
        """Whether state ``name`` has elements for shard range ``[start, start + size)`` of ``buffer``: only
        where the group's family declares it (graphstep/state/state_ranges.py)."""
        return self.state_ranges[name].offset(buffer, start, size) is not None

    def full_shard(self, kind: str, buffer: int) -> torch.Tensor:
        """A copy of this rank's whole shard of ``kind`` in ``buffer`` (on the host when part of it is); for
        a state, only the elements it keeps (``shard_like``'s shape)."""
        stored = self.stored_kind(kind, buffer)
        if stored is not None:  # never offloaded (config validation)
            return self._read_stored(stored, buffer)
        split = self.device_numel(buffer)
        device = (self.main_shard_values(buffer) if kind == "main" else self.state[kind][buffer])[:split]
        if self.host is None or self.host.part(kind, buffer).numel() == 0:
            return device.clone()
        return torch.cat([device.cpu(), self.host.part(kind, buffer)])

    def shard_like(self, kind: str, buffer: int) -> torch.Tensor:
        """A storage-less tensor with the whole shard's dtype and shape (what a checkpoint must match): a state
        stored below fp32 is saved and loaded as its fp32 values."""
        dtype = torch.float32 if self.stored_kind(kind, buffer) is not None else self._device_part(kind, buffer).dtype
        numel = self.layout.buffers[buffer].shard_numel if kind == "main" else self.state_ranges[kind].numel[buffer]
        return torch.empty(numel, dtype=dtype, device="meta")

    def compact_state(self, name: str, buffer: int, source: torch.Tensor) -> torch.Tensor:
        """``source`` in ``shard_like``'s shape: a whole shard of state ``name`` (as checkpoints written before
        state was kept per family hold it) reduced to the elements kept; a compact one as it is."""
        ranges = self.state_ranges[name]
        if ranges.whole(buffer) or source.numel() == ranges.numel[buffer]:
            return source
        return ranges.compact(buffer, source)

    def load_shard(self, kind: str, buffer: int, source: torch.Tensor) -> None:
        """Copy a whole shard (``full_shard``'s shape) into the device and host parts, in place."""
        split = self.device_numel(buffer)
        if kind != "main":
            source = self.compact_state(kind, buffer, source)
        stored = self.stored_kind(kind, buffer)
        if stored is not None:
            self._write_stored(stored, buffer, source)
            return
        if kind == "main" and self.main_is_param[buffer]:
            # All of it: past the split these are the model params, equal to the host main params (fp32).
            self.load_main_shard(buffer, source)
        else:
            self._device_part(kind, buffer)[:split].copy_(source[:split])
        if self.host is not None:
            self.host.part(kind, buffer).copy_(source[split:])
