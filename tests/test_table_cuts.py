"""Cuts of a DiskEmbeddingBagCollection: after a SIGKILL at any point (while training past the cut,
or half-way through the next cut), ``reopen=True`` brings every table back to the last committed
cut exactly (rows, optimizer state, Adam's step), never a mix; real child processes, real stores."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from test_store_crash import Child

torchrec = pytest.importorskip("torchrec")
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from mlkv_torch import optim  # noqa: E402
from mlkv_torch.cut import read_cut  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Two row layouts (dims 8 and 4): two kernels, so a cut spans two batches of stores. Budget small
# enough that rows are evicted and written back while training.
SETUP = textwrap.dedent(
    """
    import sys
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from mlkv_torch import optim
    from mlkv_torch.torchrec import DiskEmbeddingBagCollection

    TABLES = [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=3000, feature_names=["fa"]),
              EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=500, feature_names=["fb"]),
              EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=2000, feature_names=["fc"])]

    def batch(step):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (3 * 16,), generator=g)
        n = int(lengths.sum())
        values = torch.cat([torch.randint(0, 3000, (n,), generator=g) % torch.tensor([3000, 500, 2000]).repeat_interleave(
            torch.stack([lengths[i * 16:(i + 1) * 16].sum() for i in range(3)]))])
        return KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=values, lengths=lengths)

    def collection(path, **kwargs):
        return DiskEmbeddingBagCollection(TABLES, path=path, optimizer=optim.Adam(lr=0.05), memory_budget_bytes=160 << 10,
                                          seed=3, **kwargs)

    def train(ebc, first, last):
        for step in range(first, last):
            out = ebc(batch(step))
            (out.values() * torch.linspace(-1, 1, out.values().shape[1])).sum().backward()

    def state_of(ebc):
        ebc.flush()
        return {name: (*bag.snapshot(include_state=True), bag.steps) for name, bag in ebc.embedding_bags.items()}
    """
)

CHILD = SETUP + textwrap.dedent(
    """
    path, expected, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    ebc = collection(path)
    train(ebc, 0, 12)
    ebc.checkpoint(label=12)
    torch.save(state_of(ebc), expected)
    train(ebc, 12, 30)
    if scenario == "half":  # the next cut reaches the first kernel's stores only
        ebc._batches[0].checkpoint()
    print("READY", flush=True)
    sys.stdin.read()
    """
)


def run_child(tmp_path, scenario: str):
    path, expected = str(tmp_path / "tables"), str(tmp_path / "expected.pt")
    child = Child(f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n" + CHILD, path, expected, scenario)
    try:
        assert child.read_line(timeout=300) == "READY"
    finally:
        child.kill()
    return path, torch.load(expected)


def reopened_state(path, **kwargs):
    namespace = {}
    exec(SETUP, namespace)
    ebc = namespace["collection"](path, reopen=True, **kwargs)
    try:
        return namespace["state_of"](ebc), ebc
    except BaseException:
        ebc.close()
        raise


def assert_same_tables(got, expected):
    assert sorted(got) == sorted(expected)
    for name in expected:
        weight, state, steps = got[name]
        torch.testing.assert_close(weight, expected[name][0], rtol=0, atol=0, msg=f"table {name} weights")
        torch.testing.assert_close(state, expected[name][1], rtol=0, atol=0, msg=f"table {name} optimizer state")
        assert steps == expected[name][2] == 12, name


@pytest.mark.parametrize("scenario", ["training", "half"])
def test_killed_after_a_cut_reopens_exactly_at_it(tmp_path, scenario):
    path, expected = run_child(tmp_path, scenario)
    assert read_cut(path)["label"] == 12
    got, ebc = reopened_state(path)
    try:
        assert_same_tables(got, expected)
        # The reopened tables train on, and a new cut commits.
        namespace = {}
        exec(SETUP, namespace)
        namespace["train"](ebc, 12, 14)
        assert ebc.checkpoint(label=14)["tables"]["a"]["step"] == 14
    finally:
        ebc.close()


def test_a_store_two_checkpoints_past_the_cut_is_refused_by_name(tmp_path):
    path, _ = run_child(tmp_path, "training")
    record = read_cut(path)
    got, ebc = reopened_state(path)
    namespace = {}
    exec(SETUP, namespace)
    namespace["train"](ebc, 12, 14)
    ebc.checkpoint(label=14)
    namespace["train"](ebc, 14, 16)
    ebc.checkpoint(label=16)
    ebc.close()
    with pytest.raises(ValueError, match=r"table 'a' cannot reopen at the cut 12 .*has checkpoints"):
        namespace["collection"](path, cut=record)


def test_an_explicit_cut_older_than_the_recorded_one_wins(tmp_path):
    """A training checkpoint names its cut; the collection's record may already name the next
    (the crash came between the two commits): the stores go back to the checkpoint's."""
    path, expected = run_child(tmp_path, "training")
    older = read_cut(path)
    namespace = {}
    exec(SETUP, namespace)
    ebc = namespace["collection"](path, reopen=True)
    namespace["train"](ebc, 12, 15)
    newer = ebc.checkpoint(label=15)
    ebc.close()
    assert read_cut(path) == newer
    got, ebc = reopened_state(path, cut=older)
    try:
        assert_same_tables(got, expected)
        assert read_cut(path) == older
    finally:
        ebc.close()
