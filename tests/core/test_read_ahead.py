"""read_ahead: an iterator's items made in a thread, a few ahead; checked against the iterator itself."""
import threading

import pytest

from mlkv_torch.read_ahead import read_ahead


def test_items_come_in_order_and_at_most_depth_ahead():
    made, threads = [], set()

    def items():
        for i in range(50):
            made.append(i)
            threads.add(threading.current_thread().name)
            yield i

    taken = []
    for item in read_ahead(items(), depth=2, name="test-ahead"):
        assert len(made) - len(taken) <= 2 + 1  # the queue's two, and one being handed over
        taken.append(item)
    assert taken == list(range(50)) and threads == {"test-ahead"}


def test_an_error_is_raised_at_the_item_it_replaced():
    def items():
        yield 1
        yield 2
        raise ValueError("the third item")

    taken = []
    with pytest.raises(ValueError, match="the third item"):
        for item in read_ahead(items()):
            taken.append(item)
    assert taken == [1, 2]


def test_stopping_early_ends_the_thread_and_closes_the_items():
    closed = threading.Event()

    def items():
        try:
            for i in range(1000):
                yield i
        finally:
            closed.set()

    made = items()  # held here: only read_ahead's close can close it
    ahead = read_ahead(made, depth=1)
    assert [next(ahead), next(ahead)] == [0, 1]
    ahead.close()
    assert closed.is_set()
    assert not any(t.name == "mlkv-read-ahead" for t in threading.enumerate())
