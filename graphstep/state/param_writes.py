"""Writes into bf16/fp16/fp8 params after the build, taken into the main params before the next step
(docs/training-loop.md, "The params the optimizer holds").

Where the main params are a copy of their own (bf16/fp16/fp8 params, a CPU-offloaded shard), the step publishes
them over the params: a user's ``model.load_state_dict``, ``nn.init`` call or ``clamp_`` after the build
would be undone. Each param's version counter (its own: after ``p.data = view`` a param does not share its
flat buffer's) tells whether it was written, and so does the counter of its alias in ``model.state_dict()``
(graphstep/hooks/model_state_dict.py: a tensor over the param's memory with a counter of its own, which
``torch.distributed.checkpoint.load`` writes into); only then are its values compared with the main params',
element by element, so elements whose value did not change keep the main params' extra precision.
"""

from __future__ import annotations

import torch

from ..fp8 import dequantize, quantize
from ..native import param_checks

_NO_ALIAS = torch.empty(0)  # the alias of a param that has none: never written, so its counter never moves


class ParamWrites:
    """The watch over one domain's params whose main params are a copy of their own (module doc).

    Not covered: main params stored as bf16 remainders (a write there changes the main params' high bits
    already, and keeps the old low bits). A write through ``p.data`` moves no counter:
    ``copy_writes_into_main(everything=True)`` compares all."""

    def __init__(self, buffers, aliases=None):
        """``buffers``: a domain's ``StaticBuffers``, once its main params are seeded (the end of the build).
        ``aliases``: the model's state-dict aliases (``ModelStateDict``: ``alias_of(param)`` and a ``generation``
        that moves when they change), or None."""
        self._buffers = buffers
        self._aliases, self._alias_generation = aliases, None
        separate = [not is_main or buffers.host is not None for is_main in buffers.main_is_param]
        self._ranges: dict[int, list] = {}  # param index -> this rank's owned ranges of it
        for owned in buffers.layout.owned_ranges(buffers.rank):
            buffer = buffers.layout.params[owned.param].buffer
            if separate[buffer] and buffers.stored_kind("main", buffer) is None:
                self._ranges.setdefault(owned.param, []).append(owned)
        self._watched = [buffers.params[i] for i in self._ranges]
        self._alias_tensors = [_NO_ALIAS] * len(self._watched)
        self._refresh_aliases()
        self._versions = self._read_versions()

    def _refresh_aliases(self) -> bool:
        """Take the aliases anew where they changed (made or dropped: another optimizer took the params, or this
        one took them back); whether they did. A new alias's counter says nothing against the old one's."""
        aliases = self._aliases
        if aliases is None or aliases.generation == self._alias_generation:
            return False
        self._alias_generation = aliases.generation
        self._alias_tensors = [_NO_ALIAS if alias is None else alias for alias in map(aliases.alias_of, self._watched)]
        return True

    def _read_versions(self) -> tuple:
        """The watched params' version counters, and their aliases' (a never-written stand-in's where a param has
        none)."""
        return param_checks.versions(self._watched), param_checks.versions(self._alias_tensors)

    def _unwritten(self) -> bool:
        """Whether no counter moved since the last call: the check before every step, one pass per list
        (graphstep/native/param_checks.py)."""
        params_was, aliases_was = self._versions
        return (param_checks.first_other_version(self._watched, params_was) < 0
                and param_checks.first_other_version(self._alias_tensors, aliases_was) < 0)

    def copy_writes_into_main(self, everything: bool = False) -> None:
        """Copy into this rank's main params every element written into the params (or through their
        state-dict aliases) since the last call (``everything``: compare every watched param, written or not;
        so is every one after the aliases changed)."""
        everything = self._refresh_aliases() or everything
        if not everything and self._unwritten():
            return
        versions = self._read_versions()
        buffers = self._buffers
        (params_was, aliases_was), (params_now, aliases_now) = self._versions, versions
        for index, was, now, alias_was, alias_now in zip(self._ranges, params_was, params_now, aliases_was,
                                                         aliases_now, strict=True):
            if was == now and alias_was == alias_now and not everything:
                continue
            for owned in self._ranges[index]:
                buffer, size = buffers.layout.params[index].buffer, owned.param_end - owned.param_start
                param = buffers.param_flat[buffer][owned.flat_start:owned.flat_start + size]
                main = buffers.shard_part("main", buffer, owned.shard_start, size)
                current = main.to(param.device)
                meta = getattr(buffers.params[index], "fp8_meta", None)
                if meta is None:
                    main.copy_(torch.where(param != current.to(param.dtype), param.to(current.dtype), current))
                else:
                    main.copy_(_fp8_main(param, current, meta))
        self._versions = versions


def _fp8_main(data: torch.Tensor, main: torch.Tensor, meta) -> torch.Tensor:
    """``main`` where all of ``data`` is its quantization (the tensorwise recipe's ``scale`` is the one its last
    cast used; the delayed recipe's has moved on to the next cast, and ``1 / scale_inv`` is the last one), else
    ``data`` dequantized: a device-side select, not a host read.

    An fp8 weight's bytes stand for ``data * scale_inv`` (graphstep/fp8). Once written, its main params are kept
    where its bytes are still what they quantize to under the weight's scale (a graphstep checkpoint load, which
    restores main params, bytes and scales together), and otherwise all become the dequantized bytes, not just
    the elements whose bytes changed: fp8 has so few values that another weight's element often shares a byte
    with the old one, and keeping the old fine value there would make the next requantization differ from the
    loaded weight. The step itself writes an fp8 weight's bytes through the flat
    buffer and its scales in place, neither of which moves the param's or its alias's counter."""
    scale = meta.scale if meta.recipe == "tensorwise" else torch.reciprocal(meta.scale_inv)
    same = (quantize(main, scale, data.dtype).view(torch.uint8) == data.view(torch.uint8)).all()
    return torch.where(same, main, dequantize(data, meta.scale_inv, main.dtype))
