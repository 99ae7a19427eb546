"""--resume on another number of processes: a 2-rank checkpoint resharded for one process and back,
every table's rows and optimizer state carried over bit for bit (read back through
`mlkv_torch.export`, itself checked against the resumed model's state dicts in test_export.py),
and the job continuing exactly where the round trip keeps every state."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

pytest.importorskip("torchrec")
pq = pytest.importorskip("pyarrow.parquet")

from mlkv_torch.config import ConfigError  # noqa: E402
from mlkv_torch.export import export_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
COMMON = ["data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2", "eval.every=100",
          "storage.memory_budget_bytes=1048576", "train.checkpoint_every=4", "pipeline.depth=2", "train.log_every=1",
          "--no-progress"]


def _train(out: Path, steps: int, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    done = subprocess.run([*launcher, "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}",
                           f"train.steps={steps}", *COMMON, *extra], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _tables(export: Path) -> dict:
    """{table: (manifest entry, {id: (weight, state)})} of an export."""
    manifest = json.loads((export / "manifest.json").read_text())
    tables = {}
    for name, entry in manifest["tables"].items():
        data = pq.read_table(export / entry["file"])
        ids = torch.tensor(data.column("id").to_numpy())
        weights = list_column(data, "weight")
        state = list_column(data, "state") if "state" in data.column_names else torch.zeros(len(ids), 0)
        order = ids.argsort()
        tables[name] = (entry, ids[order], weights[order], state[order])
    return tables


def list_column(data, column: str) -> torch.Tensor:
    """A Parquet table's column of fixed-size lists as a float32 [rows, size] tensor (through NumPy:
    a Python float per element takes seconds a table)."""
    values = data.column(column).combine_chunks()
    return torch.tensor(values.flatten().to_numpy(), dtype=torch.float32).reshape(len(values), values.type.list_size)


def same_tables(before: Path, after: Path) -> None:
    """Every row of every table at the same ids with the same weights bit for bit; optimizer state
    bit for bit where both hold the same rule's, else as `reshard.converted_state` carries it."""
    from mlkv_torch.train.reshard import converted_state

    from mlkv_torch.store import initial_rows

    old, new = _tables(before), _tables(after)
    assert sorted(old) == sorted(new)
    for name, (entry, ids, weights, state) in old.items():
        new_entry, new_ids, new_weights, new_state = new[name]
        if entry["placement"] == new_entry["placement"]:
            # The rows a disk table wrote, or every row of a table in memory.
            assert torch.equal(ids, new_ids), name
        else:
            # Every row moves: a disk table's rows it never wrote start in memory as they would have
            # on disk, and a table from memory writes every row to disk.
            assert torch.equal(new_ids, torch.arange(entry["rows"])), name
            if entry["placement"] == "disk":
                others = torch.ones(entry["rows"], dtype=torch.bool)
                others[ids] = False
                kind, a, b = entry["initial_rows"]["distribution"]
                assert torch.equal(new_weights[others], initial_rows(others.nonzero().squeeze(1), entry["dim"],
                                                                     seed=entry["initial_rows"]["seed"], low=a, high=b))
                assert not bool(new_state[others].any()), name
        at = torch.searchsorted(new_ids, ids)  # where each old row is among the new (both in id order)
        assert torch.equal(new_ids[at], ids) and torch.equal(weights, new_weights[at]), name
        kinds = [("dense_adagrad" if e["sharding"] == "data_parallel" else e["optimizer"]) for e in (entry, new_entry)]
        expected = state if kinds[0] == kinds[1] else converted_state(*kinds, state, 0, entry["dim"], entry["dim"])
        assert torch.equal(new_state[at], expected), name


def _check_next_batch(out: Path, step: int, batch: int) -> None:
    """A one-process run resumed from `out` trains batch number `batch` at `step`."""
    from mlkv_torch.config import load_config
    from mlkv_torch.train.experiment import Experiment

    config = load_config(QUICKSTART, [f"output_dir={out}", *[o for o in COMMON if "=" in o]])
    experiment = Experiment(config, resume=True)
    try:
        assert experiment.load() == step
        data = experiment.loader(step, 1)
        try:
            got, expected = next(iter(data)), experiment.source.make_batch(batch)
        finally:
            data.close()
        ids = got.sparse_features.values()
        assert torch.equal(ids, expected.sparse_features.values())
        assert not torch.equal(ids, experiment.source.make_batch(step).sparse_features.values())  # not step * 1
    finally:
        experiment.collection.close()


def _losses(out: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_two_ranks_to_one_process_and_back_carries_every_row_and_continues_as_the_job_would(tmp_path, runner_here):
    # Tables on disk and in memory, table-wise and row-wise (no replicated table: its state, torch
    # Adagrad's per element, becomes row-wise Adagrad's mean on disk, which a round trip cannot undo;
    # test_export.py reshards the planner's own plan, replicated tables and all).
    # Every row populated: the large tables outgrow their stores' index budgets, so most of their
    # rows lie in base runs, which a reshard copies in key order straight into the new tables' bases.
    plan = ["storage.sharding_types=[table_wise,row_wise]"]
    out = tmp_path / "run"
    _train(out, 12, 2, "train.checkpoint_every=8", "storage.populate=true", *plan)  # on to 12 uninterrupted
    uninterrupted = _losses(out)
    export_checkpoint(str(out), str(tmp_path / "two"))
    kept = tmp_path / "kept"  # the checkpoint the reshard reads, as a kill after its commit would leave it
    kept.mkdir()
    for name in ("checkpoint.latest", "checkpoint-8", "tables"):
        (shutil.copytree if (out / name).is_dir() else shutil.copy2)(out / name, kept / name)
    # One process (every table on disk), in this process.
    code, err = runner_here([str(QUICKSTART), f"output_dir={out}", "train.steps=8", *COMMON, "--resume"])
    assert code == 0, err[-4000:]
    assert "written by 2 ranks; its tables were resharded for one process" in err
    assert sorted(p.name for p in (out / "tables").iterdir()) == ["one-process-step8"]  # the old ones went
    assert not (out / "checkpoint.latest").exists() and (out / "checkpoint.pt").exists()
    export_checkpoint(str(out), str(tmp_path / "one"))
    same_tables(tmp_path / "two", tmp_path / "one")
    # The data goes on where the 2 ranks left it: their 8 steps trained batches 0-15.
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["batches"] == 16
    _check_next_batch(out, 8, 16)
    # The export, imported into a job of 2 ranks under the first plan, goes on as the job would have.
    imported = tmp_path / "imported"
    done = _train(imported, 12, 2, "--import", str(tmp_path / "one"), *plan)
    assert "[train] --import: step 8's tables from" in done.stderr
    assert (imported / "checkpoint.latest").exists()  # checkpointed at once: a kill from here resumes
    got = _losses(imported)
    assert [got[s] for s in range(9, 13)] == pytest.approx([uninterrupted[s] for s in range(9, 13)], rel=1e-5)
    for name in ("checkpoint.latest", "checkpoint-8", "tables/rank0", "tables/rank1"):
        (shutil.copytree if (kept / name).is_dir() else shutil.copy2)(kept / name, out / name)
    os.utime(out / "checkpoint.latest", ns=(0, 0))  # older than checkpoint.pt: a leftover
    done = _train(out, 12, 2, "--resume", *plan)  # back to two ranks, and on to step 12
    assert "written by one process; its tables were resharded for 2 ranks" in done.stderr
    # The newer checkpoint was read; what the killed reshard left went with the one it read.
    assert not (out / "checkpoint.pt").exists()
    assert sorted(p.name for p in (out / "tables").iterdir()) == ["world2-step8"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12"]
    # Every row and state went there and back: the job goes on as it did without either move.
    got = _losses(out)
    assert [got[s] for s in range(9, 13)] == pytest.approx([uninterrupted[s] for s in range(9, 13)], rel=1e-5)
    # Resuming the one-process checkpoint directly and importing its export evaluate the same model.
    resumed, from_export = (json.loads((d / "summary.json").read_text()) for d in (out, imported))
    assert resumed["auc"] == pytest.approx(from_export["auc"], rel=1e-6) and resumed["auc"] is not None


def test_column_wise_blocks_join_for_one_process_and_split_again_as_the_job_would(tmp_path, runner_here):
    # 256-wide tables sharded column-wise: TorchRec cuts each into blocks of 128 columns (MIN_CW_DIM),
    # one a rank, on disk and in memory. One process joins each table's blocks into whole rows (their
    # element-wise Adagrad state with them), then 2 ranks split them again, and train on as before.
    wide = ["model.embedding_dim=256", "model.dense_arch=[64,256]", "train.optimizer=adagrad",
            "data.synthetic.scale=1000", "storage.sharding_types=[column_wise]"]
    out = tmp_path / "run"
    _train(out, 12, 2, "train.checkpoint_every=8", *wide)
    uninterrupted = _losses(out)
    export_checkpoint(str(out), str(tmp_path / "blocks"))
    blocks = {name: entry for name, (entry, *_) in _tables(tmp_path / "blocks").items()}
    placements = {entry["placement"] for entry in blocks.values()
                  if [s[0] for s in entry["shards"]] == [0, 1] and [s[4] for s in entry["shards"]] == [128, 128]}
    assert placements == {"disk", "memory"}, blocks
    code, err = runner_here([str(QUICKSTART), f"output_dir={out}", "train.steps=8", *COMMON, *wide[:-1], "--resume"])
    assert code == 0 and "written by 2 ranks; its tables were resharded for one process" in err, err[-4000:]
    export_checkpoint(str(out), str(tmp_path / "whole"))
    same_tables(tmp_path / "blocks", tmp_path / "whole")
    done = _train(out, 12, 2, "--resume", *wide)
    assert "written by one process; its tables were resharded for 2 ranks" in done.stderr
    got = _losses(out)
    assert [got[s] for s in range(9, 13)] == pytest.approx([uninterrupted[s] for s in range(9, 13)], rel=1e-5)


def _on_two_nodes(out: Path, tables: Path, steps: int, ranks_per_node: int, *extra: str) -> List[str]:
    """The runner as a job of two nodes on this machine (two torchrun launchers on loopback), each
    node's tables on its own disk (`storage.path` tables/node<n>), `output_dir` shared; returns
    each node's stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", str(ranks_per_node), "--master_addr", "127.0.0.1", "--master_port",
                               str(port), "-m", "mlkv_torch.train", str(QUICKSTART), f"output_dir={out}",
                               f"storage.path={tables / f'node{node}'}", f"train.steps={steps}", *COMMON, *extra],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
             for node in range(2)]
    errors = [node.communicate(timeout=600)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [e[-3000:] for e in errors]
    return errors


def test_tables_on_each_nodes_own_disk_move_over_the_process_group_2_to_4_ranks_and_back(tmp_path, runner_here):
    # Two nodes, each with its tables on its own disk: 2 ranks (one a node) train, then 4 (two a
    # node) resume, then 2 again. Tables the new plan puts on a rank of the other node come over the
    # process group; the job goes on as the uninterrupted one did.
    # Every row populated: most of the large tables' rows lie in base runs, sent in id order and
    # loaded straight into the receiving tables' bases.
    out, tables = tmp_path / "run", tmp_path / "tables"
    shape = ["data.synthetic.scale=40", "storage.sharding_types=[table_wise,row_wise]"]  # some tables on disk
    _on_two_nodes(out, tables, 12, 1, "train.checkpoint_every=8", "storage.populate=true", *shape)
    uninterrupted = _losses(out)
    # One process on node 0 does not see node 1's tables, and says so.
    code, err = runner_here([str(QUICKSTART), f"output_dir={out}", "train.steps=8", *COMMON,
                             f"storage.path={tables / 'node0'}", "--resume", *shape])
    assert code != 0 and "rank 1's tables of the checkpoint are not here" in err, err[-3000:]
    errors = _on_two_nodes(out, tables, 8, 2, "--resume", *shape)
    assert "resharded for 4 ranks" in errors[0] and "rows came over the process group" in errors[0], errors[0][-3000:]
    # Each node removed its old tables once the new checkpoint was committed.
    assert [sorted(p.name for p in (tables / f"node{n}").iterdir()) for n in range(2)] == [["world4-step8"]] * 2
    errors = _on_two_nodes(out, tables, 12, 1, "--resume", *shape)
    assert "resharded for 2 ranks" in errors[0] and "rows came over the process group" in errors[0], errors[0][-3000:]
    got = _losses(out)
    assert [got[s] for s in range(9, 13)] == pytest.approx([uninterrupted[s] for s in range(9, 13)], rel=1e-5)
    # Into memory (storage.kind memory): the rows go into TorchRec's tables from a store of the
    # rank's own (received, not copied as they are), every row and state as the disk tables held them.
    nodes = [str(tables / f"node{node}") for node in range(2)]  # each node's disk, as one machine sees them
    with pytest.raises(ConfigError, match="rank 1's tables of the checkpoint are not here"):
        export_checkpoint(str(out), str(tmp_path / "half"), nodes[:1])
    done = subprocess.run([sys.executable, "-m", "mlkv_torch.export", str(out), str(tmp_path / "on_disk"),
                           "--tables", nodes[0], "--tables", nodes[1]], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = _on_two_nodes(out, tables, 12, 1, "--resume", "storage.kind=memory", *shape)
    assert "rows came over the process group" in errors[0], errors[0][-3000:]
    export_checkpoint(str(out), str(tmp_path / "in_memory"), nodes)
    same_tables(tmp_path / "on_disk", tmp_path / "in_memory")


def test_optimizer_state_converts_between_rules_as_documented():
    from mlkv_torch.train.reshard import converted_state

    sums = torch.tensor([[1.0, 2.0, 3.0, 6.0]])  # torch Adagrad's (a replicated table's), one per element
    assert converted_state("dense_adagrad", "rowwise_adagrad", sums, 0, 4, 4).tolist() == [[3.0]]
    assert converted_state("dense_adagrad", "adagrad", sums, 2, 2, 4).tolist() == [[3.0, 6.0]]  # a column shard's
    assert converted_state("adagrad", "dense_adagrad", sums, 0, 4, 4).tolist() == sums.tolist()
    assert converted_state("rowwise_adagrad", "adagrad", torch.tensor([[3.0]]), 0, 2, 4).tolist() == [[3.0, 3.0]]
    # Row-wise state read across two column shards: their mean, the whole row's.
    two_shards = torch.tensor([[2.0, 4.0]])
    assert converted_state("rowwise_adagrad", "rowwise_adagrad", two_shards, 0, 4, 4).tolist() == [[3.0]]
    moments = torch.arange(8.0).reshape(1, 8)  # Adam: first moments, then second moments
    assert converted_state("adam", "adam", moments, 1, 2, 4).tolist() == [[1.0, 2.0, 5.0, 6.0]]
    for source, target in (("adagrad", "adam"), ("adam", "adagrad"), ("adagrad", "sgd"), ("sgd", "adagrad")):
        assert converted_state(source, target, sums, 0, 4, 4) is None, (source, target)


def test_another_plan_on_as_many_ranks_moves_tables_table_wise_to_row_wise_and_disk_to_memory(tmp_path):
    # --resume with other storage settings: the plan TorchRec makes of them differs, and the tables
    # move to it: table-wise to row-wise (on disk, and from memory to disk), then every table into
    # memory (table-wise: TorchRec's in-memory kernels shard row-wise only on a GPU).
    out = tmp_path / "run"
    _train(out, 8, 2, "storage.sharding_types=[table_wise]")
    export_checkpoint(str(out), str(tmp_path / "table_wise"))
    done = _train(out, 8, 2, "--resume", "storage.sharding_types=[row_wise]")
    assert "resharded for this run's plan (its storage settings differ)" in done.stderr
    export_checkpoint(str(out), str(tmp_path / "row_wise"))
    same_tables(tmp_path / "table_wise", tmp_path / "row_wise")
    placements = {name: [(t[name][0]["placement"], t[name][0]["sharding"]) for t in (before, after)]
                  for before, after in [(_tables(tmp_path / "table_wise"), _tables(tmp_path / "row_wise"))]
                  for name in before}
    moves = {tuple(p) for p in placements.values()}
    assert {(("disk", "table_wise"), ("disk", "row_wise")),
            (("memory", "table_wise"), ("disk", "row_wise"))} <= moves, moves
    # Into memory, and on for 20 steps (the checkpoint the move took at step 8 is the only one).
    in_memory = ["storage.kind=memory", "storage.sharding_types=[table_wise]", "train.checkpoint_every=100"]
    done = _train(out, 28, 2, "--resume", *in_memory)
    assert "resharded for this run's plan" in done.stderr
    assert sorted(p.name for p in (out / "tables").iterdir()) == []  # storage kind memory: no disk table left
    export_checkpoint(str(out), str(tmp_path / "memory"))
    assert {t[0]["placement"] for t in _tables(tmp_path / "memory").values()} == {"memory"}
    same_tables(tmp_path / "row_wise", tmp_path / "memory")
    # The same 20 steps from the same state, started from its export under that plan.
    imported = tmp_path / "imported"
    _train(imported, 28, 2, "--import", str(tmp_path / "row_wise"), *in_memory)
    moved, started = _losses(out), _losses(imported)
    assert [moved[s] for s in range(9, 29)] == pytest.approx([started[s] for s in range(9, 29)], rel=1e-5)


def test_a_plan_differs_where_a_table_changes_place_or_sharding_type():
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    from mlkv_torch.train.reshard import plan_differs

    def plan(kernel: str, sharding: str) -> ShardingPlan:
        return ShardingPlan({"model.sparse_arch.embedding_bag_collection": EmbeddingModuleShardingPlan(
            {"t": ParameterSharding(sharding_type=sharding, compute_kernel=kernel, ranks=[0])})})

    # A record with the shards' layout: table-wise, column-wise and table-column-wise of a table whole
    # on rank 0 are one layout (TorchRec's planner picks among them as among equals).
    written = {"t": {"placement": "disk", "sharding": "table_column_wise", "shards": [[0]]}}
    assert not plan_differs(written, plan("customized_kernel", "table_wise"))
    assert not plan_differs(written, plan("customized_kernel", "column_wise"))
    assert plan_differs(written, plan("fused", "table_wise"))
    assert plan_differs({"t": {**written["t"], "shards": [[1]]}}, plan("customized_kernel", "table_wise"))
    # One without (written before layouts were recorded): by placement and the kind of sharding.
    written = {"t": {"placement": "disk", "sharding": "table_wise"}}
    assert not plan_differs(written, plan("customized_kernel", "column_wise"))
    assert plan_differs(written, plan("customized_kernel", "row_wise"))
    assert plan_differs(written, plan("fused", "table_wise"))
    assert not plan_differs(None, plan("fused", "row_wise"))  # one that records no tables: as it was
