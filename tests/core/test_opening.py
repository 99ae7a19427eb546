"""Opening tables (mlkv_torch.opening.open_tables), on real stores in a temporary directory: one
table batch per row layout and pooling in the order they first appear and where each table went
(`places`), a failed open closing what it opened, and the cut the tables reopen at reconciled with
the one their directory records."""
import pytest
import torch

from mlkv_torch import opening, optim
from mlkv_torch.cut import read_cut, write_cut
from mlkv_torch.disk_table import DiskTable
from mlkv_torch.opening import TableSpec, open_tables
from mlkv_torch.row_layout import RowLayout
from mlkv_torch.table_batch import DiskTableBatch

BUDGET = 4 << 20
WIDE, NARROW = RowLayout(8, torch.float32, optim.SGD()), RowLayout(4, torch.float32, optim.SGD())


def spec(tmp_path, name, layout=WIDE, mode="sum", rows=1000):
    return TableSpec(DiskTable(name, rows, str(tmp_path / name)), layout, mode)


def close(opened):
    for batch in opened.batches:
        batch.close()


def test_tables_are_grouped_by_row_layout_and_pooling_in_the_order_they_first_appear(tmp_path):
    specs = [spec(tmp_path, "a"), spec(tmp_path, "b", NARROW), spec(tmp_path, "c", mode="mean"),
             spec(tmp_path, "d"), spec(tmp_path, "e", NARROW, mode="mean"), spec(tmp_path, "f", NARROW)]
    opened = open_tables(specs, memory_budget_bytes=BUDGET)
    try:
        assert [[t.name for t in batch.tables] for batch in opened.batches] == [["a", "d"], ["b", "f"], ["c"], ["e"]]
        assert [(batch.embedding_dim, batch.mode) for batch in opened.batches] == [
            (8, "sum"), (4, "sum"), (8, "mean"), (4, "mean")]
        assert opened.places == [(0, 0), (1, 0), (2, 0), (0, 1), (3, 0), (1, 1)]
        for s, (b, k) in zip(specs, opened.places):
            assert opened.batches[b].tables[k].path == s.table.path
        assert sum(batch.memory_budget_bytes for batch in opened.batches) <= BUDGET
        assert opened.cut is None  # a fresh start
        # A row written through a table's place is that table's, in its own store.
        rows = torch.full((1, 4), 0.5)
        opened.batches[1].write_rows(1, torch.tensor([7]), rows)
        torch.testing.assert_close(opened.batches[1].read_rows(1, torch.tensor([7])), rows, rtol=0, atol=0)
        assert opened.batches[1].read_rows(0, torch.tensor([7])).ne(0.5).all()
    finally:
        close(opened)


def test_a_batch_that_fails_to_open_closes_the_batches_opened_before_it(tmp_path, monkeypatch):
    held = open_tables([spec(tmp_path, "b", NARROW)], memory_budget_bytes=BUDGET)
    held.batches[0].write_rows(0, torch.tensor([1]), torch.ones(1, 4))
    close(held)
    made = []  # held here, so a batch left open stays open (not closed by the garbage collector)

    class Recorded(DiskTableBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(opening, "DiskTableBatch", Recorded)
    with pytest.raises(FileExistsError, match="'b' at .*/b .*reopen=True"):
        open_tables([spec(tmp_path, "a"), spec(tmp_path, "b", NARROW)], memory_budget_bytes=BUDGET)
    assert [[t.name for t in batch.tables] for batch in made] == [["a"]] and made[0].closed
    # Its store's lock let go: the table opens again in this process.
    close(open_tables([spec(tmp_path, "a")], memory_budget_bytes=BUDGET))


def rows_of(opened, ids):
    return torch.cat([opened.batches[b].read_rows(k, ids).flatten() for b, k in opened.places])


def cut_of(opened, label, commit=True):
    parts = [batch.begin_checkpoint() for batch in opened.batches]
    record = {"label": label, "tables": {name: entry for part in parts for name, entry in part.finish().items()}}
    if commit:
        for part in parts:
            part.commit()
    return record


def test_a_reopen_goes_to_the_cut_given_or_else_to_the_one_the_directory_records(tmp_path):
    specs = [spec(tmp_path, "a"), spec(tmp_path, "b", NARROW)]
    ids = torch.arange(0, 1000, 7)
    cut_dir = str(tmp_path)
    opened = open_tables(specs, memory_budget_bytes=BUDGET)
    for value, (b, k) in zip((1.0, 2.0), opened.places):
        opened.batches[b].write_rows(k, ids, torch.full((len(ids), opened.batches[b].embedding_dim), value))
    first = cut_of(opened, 1)
    write_cut(cut_dir, first)
    at_first = rows_of(opened, ids)
    for value, (b, k) in zip((3.0, 4.0), opened.places):
        opened.batches[b].write_rows(k, ids, torch.full((len(ids), opened.batches[b].embedding_dim), value))
    # The next cut is written and recorded, but its owner's checkpoint (which names the first) never committed it.
    second = cut_of(opened, 2, commit=False)
    write_cut(cut_dir, second)
    past = rows_of(opened, ids)
    close(opened)
    assert not torch.equal(at_first, past)

    # Without a cut, a reopen goes to the one the directory records,
    opened = open_tables(specs, memory_budget_bytes=BUDGET, reopen=True, cut_dir=cut_dir)
    assert opened.cut == second
    torch.testing.assert_close(rows_of(opened, ids), past, rtol=0, atol=0)
    close(opened)
    # a cut given goes before it, and is recorded in its place (the newer cut the stores went back from is gone),
    opened = open_tables(specs, memory_budget_bytes=BUDGET, cut=first, cut_dir=cut_dir)
    assert opened.cut == first and read_cut(cut_dir) == first
    torch.testing.assert_close(rows_of(opened, ids), at_first, rtol=0, atol=0)
    close(opened)
    # and so the next reopen without one comes back to it.
    opened = open_tables(specs, memory_budget_bytes=BUDGET, reopen=True, cut_dir=cut_dir)
    assert opened.cut == first
    torch.testing.assert_close(rows_of(opened, ids), at_first, rtol=0, atol=0)
    close(opened)
