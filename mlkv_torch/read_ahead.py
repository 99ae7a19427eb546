"""An iterator's items made in a thread of their own, a few ahead of the one using them: reading
and writing overlap where both let go of the GIL (the stores' scans and puts, pyarrow's parsing)."""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

__all__ = ["read_ahead"]

T = TypeVar("T")


class _Raised:
    """What the producing thread raised, handed over to be raised where the items are used."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def read_ahead(items: Iterable[T], depth: int = 1, name: str = "mlkv-read-ahead") -> Iterator[T]:
    """`items`, each made in a thread while the caller uses the ones before (at most `depth` made
    and not yet taken). An exception the items raise is raised here, at the item it replaced; the
    thread stops when the caller stops taking (the generator closed) or the items end."""
    made: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def hand_over(item: object) -> bool:
        while not stop.is_set():  # the caller may have stopped taking
            try:
                made.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not hand_over(item):
                    return
            hand_over(end)
        except BaseException as error:
            hand_over(_Raised(error))
        finally:  # a generator's own cleanup (a store it opened, say) runs here, where it ran
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = made.get()
            if item is end:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
