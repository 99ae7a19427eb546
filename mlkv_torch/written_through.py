"""The tensors a disk table puts in a state dict: its rows read out of the store, which write back
to the table when written in place (`WrittenThrough`). An nn.Module's state dict holds its
parameters themselves, so ``state_dict()[key].copy_(rows)`` (TorchRec's way of copying weights
between models, and what torch.distributed.checkpoint's load does) changes the model; a disk
table's rows live in its store, so the state dict's tensors write through to it instead."""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["WrittenThrough", "TableRows"]

# In-place operators whose names do not end in "_".
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                               "__irshift__"})
# Methods whose names end in "_" but change no value.
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_"})


class TableRows(Protocol):
    """Where a WrittenThrough tensor's rows live: rows [first, stop) read now, and written."""

    def read(self, first: int, stop: int) -> torch.Tensor: ...

    def write(self, first: int, stop: int, rows: torch.Tensor) -> None: ...


class WrittenThrough(torch.Tensor):
    """A [rows, cols] tensor of a table's rows whose in-place writes reach the table: before an
    in-place operation on it or on a view of it (``copy_``, ``t[i] = ...``, ``add_``, ``uniform_``,
    ``torch.nn.init``'s functions, an ``out=``), the rows its elements lie in are read again from
    the table (so a write never puts back values training has changed since), and after it they
    are written back. Every other operation gives plain tensors (views stay written through);
    pickling (torch.save) and deepcopy give plain tensors; writes through numpy are not seen."""

    _root: torch.Tensor
    _table: TableRows

    @staticmethod
    def of(rows: torch.Tensor, table: TableRows) -> "WrittenThrough":
        """`rows` (a contiguous [rows, cols] tensor) written through to `table`."""
        if rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError(f"rows must be a contiguous 2-D tensor, got shape {tuple(rows.shape)} "
                             f"(contiguous: {rows.is_contiguous()})")
        return _view_of(rows, rows, table)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None
                           ) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        for target in written:
            target._sync("read")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        for target in written:
            target._sync("write")
        if written:
            return result
        sources = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, WrittenThrough)]
        if not sources:
            return result
        source = sources[0]
        storage = source._root.untyped_storage().data_ptr()

        def wrap(value: Any) -> Any:  # views stay written through: writes to them reach the table
            if isinstance(value, torch.Tensor) and not isinstance(value, WrittenThrough) and value.numel() \
                    and value.device == source.device and value.untyped_storage().data_ptr() == storage:
                return _view_of(value, source._root, source._table)
            return value
        return tree_map(wrap, result)

    def _rows(self) -> Tuple[int, int]:
        """The table rows [first, stop) this tensor's elements lie in."""
        with torch._C.DisableTorchFunctionSubclass():
            root = self._root
            cols = max(1, root.shape[1])
            offset = self.storage_offset() - root.storage_offset()
            last = offset + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride()))
            return max(0, offset // cols), min(root.shape[0], last // cols + 1)

    def _sync(self, direction: str) -> None:
        """Reads this tensor's rows from the table into it ("read"), or writes them back ("write")."""
        if self.numel() == 0:
            return
        first, stop = self._rows()
        if stop <= first:
            return
        with torch._C.DisableTorchFunctionSubclass():
            rows = self._root[first:stop]
            if direction == "read":
                rows.copy_(self._table.read(first, stop))
            else:
                self._table.write(first, stop, rows)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        return _plain(self).clone()


def _written(func: Any, args: Any, kwargs: Dict[str, Any]) -> list:
    """The WrittenThrough tensors `func` writes in place: its `out=`, or the tensor an in-place
    method or function (``uniform_``, ``torch.nn.init.normal_(tensor=...)``) is called on."""
    out = [t for t in tree_flatten(kwargs.get("out"))[0] if isinstance(t, WrittenThrough)]
    if out:
        return out
    name = getattr(func, "__name__", "")
    if name in _NOT_WRITES or not (name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))):
        return []
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    return [first] if isinstance(first, WrittenThrough) else []


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _view_of(tensor: torch.Tensor, root: torch.Tensor, table: TableRows) -> WrittenThrough:
    with torch._C.DisableTorchFunctionSubclass():
        view = tensor.as_subclass(WrittenThrough)
    view._root, view._table = root, table
    return view
