"""Argument checks shared by the public API."""
from typing import Any


def is_int(value: Any) -> bool:
    """An int and not a bool: bool subclasses int, and True must not pass for a count of 1."""
    return isinstance(value, int) and not isinstance(value, bool)
