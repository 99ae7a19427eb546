"""The tensors a disk table puts in a state dict: its rows read out of the store, which write back
to the table when written in place (`WrittenThrough`). An nn.Module's state dict holds its
parameters themselves, so ``state_dict()[key].copy_(rows)`` (TorchRec's way of copying weights
between models, and what torch.distributed.checkpoint's load does) changes the model; a disk
table's rows live in its store, so the state dict's tensors write through to it instead."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["WrittenThrough"]

# In-place operators whose names do not end in "_".
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                               "__irshift__"})
# Methods whose names end in "_" but change no value.
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "retain_grad", "record_stream"})

RowWriter = Callable[[int, int, torch.Tensor], None]
"""Writes rows [first, stop) of a table from a [stop - first, cols] tensor."""


class WrittenThrough(torch.Tensor):
    """A [rows, cols] tensor of a table's rows whose in-place writes reach the table: after an
    in-place operation on it or on a view of it (``copy_``, ``t[i] = ...``, ``add_``, ``uniform_``,
    an ``out=``), the rows the written elements lie in are written back with the row writer. Every
    other operation gives plain tensors; pickling (torch.save) and deepcopy give plain tensors."""

    _root: torch.Tensor
    _write_rows: RowWriter

    @staticmethod
    def of(rows: torch.Tensor, write_rows: RowWriter) -> "WrittenThrough":
        """`rows` (a contiguous [rows, cols] tensor) written through with `write_rows`."""
        if rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError(f"rows must be a contiguous 2-D tensor, got shape {tuple(rows.shape)}")
        return _view_of(rows, rows, write_rows)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None
                           ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        written = kwargs.get("out") if isinstance(kwargs.get("out"), WrittenThrough) else None
        if written is None and args and isinstance(args[0], WrittenThrough) and name not in _NOT_WRITES \
                and (name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))):
            written = args[0]
        if written is not None:
            written._write_back()
            return result
        source = args[0] if args and isinstance(args[0], WrittenThrough) else None
        if source is not None and isinstance(result, torch.Tensor) and result is not source \
                and result.device == source.device and result.numel() \
                and result.untyped_storage().data_ptr() == source._root.untyped_storage().data_ptr():
            return _view_of(result, source._root, source._write_rows)  # a view: writes to it reach the table
        return result

    def _write_back(self) -> None:
        """Writes the rows this tensor's elements lie in (a view may touch a part of the table)."""
        if self.numel() == 0:
            return
        with torch._C.DisableTorchFunctionSubclass():
            root = self._root
            cols = max(1, root.shape[1])
            offset = self.storage_offset() - root.storage_offset()
            last = offset + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride()))
            first, stop = max(0, offset // cols), min(root.shape[0], last // cols + 1)
            if stop > first:
                self._write_rows(first, stop, root[first:stop])

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        return _plain(self).clone()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


def _view_of(tensor: torch.Tensor, root: torch.Tensor, write_rows: RowWriter) -> WrittenThrough:
    with torch._C.DisableTorchFunctionSubclass():
        view = tensor.as_subclass(WrittenThrough)
    view._root, view._write_rows = root, write_rows
    return view
