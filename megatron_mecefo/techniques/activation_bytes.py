"""Count the activation bytes autograd saves for backward, as the memory measure of takeover."""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Iterable, List, Optional, Type

import torch


class SavedActivationBytes:
    """Within the block, record every tensor autograd saves; ``nbytes`` sums the activations.

    ``nbytes`` is taken when the block exits (the end of the forward): only tensors still held
    by a live graph count, since a graph dropped mid-forward frees its saves and the allocator
    may hand their addresses to later ones. Storages are counted once however often they are
    saved. Tensors the module holds across steps anyway (parameters, buffers and cached
    low-rank bases V) cost no activation memory and are left out. With ``scope``, only what is
    saved while ``scope`` runs its forward counts (e.g. the decoder of a GPTModel).

    Example::

        with SavedActivationBytes(model, scope=model.decoder) as saved:
            loss = model(...)
        print(saved.nbytes)
    """

    def __init__(self, module: torch.nn.Module, scope: Optional[torch.nn.Module] = None) -> None:
        self.module = module
        self.scope = scope
        self._saved: List[weakref.ref] = []
        self.nbytes = 0
        """Activation bytes held for backward when the block exited."""
        self._inside = scope is None
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._inside:
            self._saved.append(weakref.ref(tensor))
        return tensor

    def _set_inside(self, inside: bool) -> None:
        self._inside = inside

    def __enter__(self) -> "SavedActivationBytes":
        self._saved = []
        if self.scope is not None:
            self._handles = [
                self.scope.register_forward_pre_hook(lambda *_: self._set_inside(True)),
                self.scope.register_forward_hook(lambda *_: self._set_inside(False)),
            ]
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        held = {t.untyped_storage().data_ptr() for t in self._persistent()}
        alive = {}
        for ref in self._saved:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                alive[storage.data_ptr()] = storage.nbytes()
        self._saved = []
        self.nbytes = sum(n for ptr, n in alive.items() if ptr not in held)

    def _persistent(self) -> Iterable[torch.Tensor]:
        yield from self.module.parameters()
        yield from self.module.buffers()
        for m in self.module.modules():
            basis = getattr(m, "mecefo_basis", None)
            if basis is not None:
                yield basis
