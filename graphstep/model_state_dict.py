"""The model's own ``state_dict`` while graphstep manages it (placeholder: filled in by the safetensors work)."""

from __future__ import annotations


class _Inert:
    def remove(self) -> None:
        pass


def install(model_chunks, domain_buffers) -> _Inert:
    """Hooks on the model's modules; ``remove()`` takes them off."""
    return _Inert()
