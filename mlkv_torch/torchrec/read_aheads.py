"""Which read-ahead a table module's next training forward pools from: each batch read ahead keeps
its tickets (one a table batch, `DiskTableBatch.lookahead`), and the forward of that batch hands
them to `pool` (`read_ahead=`), which then takes the read-ahead's deduplication and cache slots
instead of finding the batch among the read-aheads by its ids (on CUDA: no host synchronisation).

Two ways say which batch a forward is: `LookaheadPipeline` names it (`ReadAheads.name_next` with
the token its `lookahead` returned, as the window's batch enters the step), and TorchRec's
prefetch contract queues it (`prefetch` one batch ahead, each forward taking the oldest queued in
order). A forward nobody named and with nothing queued, and every evaluation, finds its rows as
before."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Deque, List, Optional

__all__ = ["Tickets", "ReadAheads"]

Tickets = List[Optional[int]]  # a batch's tickets, one a table batch (None: it read nothing ahead)

_KEPT = 64  # as DiskTableBatch keeps its read-aheads: older ones are let go


class ReadAheads:
    """A module's read-aheads not yet pooled: named by token, or queued (TorchRec's prefetch)."""

    def __init__(self) -> None:
        self._named: "OrderedDict[int, Tickets]" = OrderedDict()
        self._queued: Deque[Tickets] = deque(maxlen=_KEPT)
        self._next: Optional[Tickets] = None

    def add(self, token: Optional[int], tickets: Tickets) -> None:
        """The tickets of the batch read ahead as `token`; None: queued for the next forwards in order."""
        if token is None:
            self._queued.append(tickets)
            return
        self._named[token] = tickets
        while len(self._named) > _KEPT:
            self._named.popitem(last=False)

    def name_next(self, token: Optional[int]) -> None:
        """The next training forward pools the batch read ahead as `token` (None: no read-ahead of
        its own); read-aheads named before it are let go (their batches were skipped)."""
        self._next = None
        while self._named:
            oldest, tickets = next(iter(self._named.items()))
            if token is None or oldest > token:
                break
            self._named.popitem(last=False)
            if oldest == token:
                self._next = tickets

    def take(self, training: bool) -> Optional[Tickets]:
        """The tickets the forward about to run pools from (None: it finds its rows itself). An
        evaluation takes none and leaves them for the training batches they belong to."""
        if not training:
            return None
        if self._next is not None:
            tickets, self._next = self._next, None
            return tickets
        return self._queued.popleft() if self._queued else None
