"""A user's transform of Parquet row groups, named by import path (``data.parquet.transform``).

A transform is a function ``f(table, **args) -> table`` of pyarrow Tables: it gets a row group's
columns (the declared ones the file has and those it `reads`) and returns the columns the schema
declares, one row per row it got (derived features: bucketized prices, crossed ids, a cleaned
label). It runs where the row group is decoded (a loader thread, or a Ray actor on another node),
once per row group read, so it is given as an import path, "package.module:function", which
every process imports for itself; the module must be importable there (installed, or on
PYTHONPATH).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Tuple

__all__ = ["RowGroupTransform", "import_function"]


def import_function(path: str) -> Callable[..., Any]:
    """The callable at `path`, "package.module:function" (or "package.module.function");
    ValueError names what cannot be imported or is not callable."""
    module_name, colon, name = path.partition(":")
    if not colon:
        module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{path!r} is no import path of a function: write 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{path!r}: module {module_name!r} cannot be imported here ({e}); it must be installed "
                         f"or on PYTHONPATH wherever batches are made") from e
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{path!r}: module {module_name!r} has no function {name!r}")
    return function


@dataclass(frozen=True)
class RowGroupTransform:
    """A row-group transform: `function`'s import path, the file columns it `reads` besides the
    declared ones, and keyword `args` it is called with. Picklable: a Ray actor loads it itself."""

    function: str
    reads: Tuple[str, ...] = ()
    args: Dict[str, Any] = field(default_factory=dict)

    def load(self) -> Callable[[Any], Any]:
        """The transform as a function of a pyarrow Table (its args bound)."""
        function = import_function(self.function)
        args = dict(self.args)
        return lambda table: function(table, **args)
