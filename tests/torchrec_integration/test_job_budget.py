"""DiskAwarePlanner with a job-wide memory budget: the tables' popularity from a sample of the input
and this machine's calibration decide which tables stay in memory and each disk table's load
factor; the plan carries it to the kernel; `explain()` shows it."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")

from torchrec.distributed.planner.types import ParameterConstraints, Topology  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from mlkv_torch import optim  # noqa: E402
from mlkv_torch.memory_budget import shard_memory_budget, split_host_memory  # noqa: E402
from mlkv_torch.planning.calibration import Calibration  # noqa: E402
from mlkv_torch.planning.hit_rates import access_from_batches  # noqa: E402
from mlkv_torch.row_layout import row_bytes  # noqa: E402
from mlkv_torch.torchrec import DISK_KERNEL, DiskAwarePlanner, DiskEmbeddingBagCollectionSharder  # noqa: E402
from mlkv_torch.torchrec.kernel import DiskTableOptions, planned_load_factor  # noqa: E402
from mlkv_torch.torchrec.memory_choice import BudgetTooSmallError, TableShape, choose_table_memory  # noqa: E402

MiB = 1 << 20
DIM = 16
# rows, Zipf exponent of their ids (0: uniform)
TABLES = {"small": (2_000, 1.05), "skewed": (2_000_000, 1.2), "flat": (2_000_000, 0.0), "mild": (500_000, 0.9)}
BATCH = 4096

# A calibration of figures like this machine's (the choice depends on their ratios alone).
CALIBRATION = Calibration(machine={}, disk={}, store_reads_per_s=1e5,
                          table={"16": {"hit_s": 5e-8, "miss_s": 4e-6, "update_s": 4e-8},
                                 "128": {"hit_s": 8e-8, "miss_s": 1.1e-5, "update_s": 1e-7}},
                          memory_bytes_per_s=3e10, all_to_all_bytes_per_s=None, seconds=0.0)


def zipf_ids(rows: int, exponent: float, n: int, generator: torch.Generator) -> torch.Tensor:
    if exponent == 0:
        return torch.randint(0, rows, (n,), generator=generator)
    weight = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    return torch.multinomial(weight.float(), n, replacement=True, generator=generator)


@pytest.fixture(scope="module")
def access():
    generator = torch.Generator().manual_seed(0)
    batches = [{name: zipf_ids(rows, a, BATCH, generator) for name, (rows, a) in TABLES.items()} for _ in range(6)]
    return access_from_batches(batches, {name: rows for name, (rows, _) in TABLES.items()})


@pytest.fixture(scope="module")
def ebc():
    return EmbeddingBagCollection([EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                                                      feature_names=[f"f_{name}"])
                                   for name, (rows, _) in TABLES.items()], device=torch.device("meta"))


def _planner(access, budget, constraints=None, world=2):
    topology = Topology(world_size=world, compute_device="cpu", ddr_cap=4096 * MiB, ssd_cap=64 << 30)
    return DiskAwarePlanner(topology=topology, batch_size=BATCH, constraints=constraints, access=access,
                            calibration=CALIBRATION, memory_budget_bytes=budget)


def _sharder():
    return DiskEmbeddingBagCollectionSharder("/nonexistent/not-used-by-planning", optimizer=optim.SGD(lr=0.1))


def test_the_budget_goes_to_the_rows_read_most_and_the_plan_carries_each_tables_load_factor(ebc, access, caplog):
    budget = 40 * MiB
    planner = _planner(access, budget)
    plan = planner.plan(ebc, [_sharder()]).plan[""]
    # Each table's constraint names only shardings its chosen kernels take (TorchRec warns of others).
    assert "No available compute kernels" not in caplog.text
    chosen = planner.table_memory
    assert sum(m.memory_bytes for m in chosen.values()) <= budget
    assert chosen["small"].in_memory
    for name, memory in chosen.items():
        if memory.in_memory:
            assert plan[name].compute_kernel == "fused"
        else:
            assert plan[name].compute_kernel == DISK_KERNEL
            assert plan[name].cache_params.load_factor == pytest.approx(memory.load_factor)
    assert not chosen["skewed"].in_memory and not chosen["flat"].in_memory
    # A flat table's rows are each read rarely: its memory buys few reads, the skewed one's many.
    assert chosen["skewed"].cache_rows > 2 * chosen["flat"].cache_rows
    assert chosen["skewed"].row_hit_rate > 0.5 > chosen["flat"].row_hit_rate
    # Planned again with half the budget: chosen from the user's constraints, not bound by the first choice.
    again = planner._job.memory_budget_bytes = budget // 2
    planner.plan(ebc, [_sharder()])
    assert sum(m.memory_bytes for m in planner.table_memory.values()) <= again
    assert planner.table_memory["skewed"].cache_rows < chosen["skewed"].cache_rows
    text = planner.explain()
    assert all(f"\n{name} " in text for name in TABLES) and "read share" in text


@pytest.mark.parametrize("budget_mib", [10, 40, 100])
def test_the_choice_reads_less_than_one_fraction_for_every_table(access, budget_mib):
    """Today's rule (each disk table memory_fraction of its bytes, the same budget in all) against
    the choice, both priced by the same predicted reads (measured: 0.82-0.84 of the reads)."""
    budget = budget_mib * MiB
    shapes = [TableShape(name, rows, DIM, row_bytes(DIM, torch.float32, optim.SGD(lr=0.1)), may_stay_in_memory=False)
              for name, (rows, _) in TABLES.items()]
    chosen = choose_table_memory(shapes, access, CALIBRATION, budget)
    fraction = budget / sum(s.rows * s.row_bytes for s in shapes)
    one_fraction = 0.0
    for shape in shapes:
        share = shard_memory_budget(shape.rows, shape.row_bytes, fraction)
        cache = split_host_memory(share, 1, shape.rows, shape.row_bytes, True).cache_rows
        one_fraction += access[shape.name].misses_per_batch(cache)
    chosen_reads = sum(m.reads_per_step for m in chosen.values())
    assert chosen_reads < 0.9 * one_fraction, (chosen_reads, one_fraction)
    assert sum(m.memory_bytes for m in chosen.values()) > 0.95 * budget  # the budget is spent


def test_constraints_stay_the_users_and_a_budget_too_small_says_by_how_much(ebc, access):
    planner = _planner(access, 40 * MiB, {"small": ParameterConstraints(compute_kernels=[DISK_KERNEL])})
    plan = planner.plan(ebc, [_sharder()]).plan[""]
    assert plan["small"].compute_kernel == DISK_KERNEL and not planner.table_memory["small"].in_memory
    with pytest.raises(BudgetTooSmallError, match=r"memory_budget_bytes=100,000 is [\d,]+ bytes short of the least"):
        _planner(access, 100_000).plan(ebc, [_sharder()])
    with pytest.raises(ValueError, match="needs access .* and calibration"):
        DiskAwarePlanner(topology=Topology(world_size=1, compute_device="cpu"), memory_budget_bytes=1 << 30)


def test_a_table_of_raw_ids_is_never_chosen_for_memory(access):
    """Sized by the ids it will hold, a table of raw ids would fit memory; TorchRec's in-memory
    kernels would hold its whole id space."""
    raw = EmbeddingBagCollection([EmbeddingBagConfig(name="small", embedding_dim=DIM, num_embeddings=1 << 40,
                                                     feature_names=["f_small"])], device=torch.device("meta"))
    sharder = DiskEmbeddingBagCollectionSharder("/unused", optimizer=optim.SGD(lr=0.1), live_ids={"small": 2_000})
    planner = _planner({"small": access["small"]}, 40 * MiB)
    plan = planner.plan(raw, [sharder]).plan[""]
    assert not planner.table_memory["small"].in_memory and plan["small"].compute_kernel == DISK_KERNEL


def test_the_kernel_opens_a_shard_with_the_plans_load_factor():
    options = DiskTableOptions("/unused", memory_fraction=0.1)
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=1_000_000, feature_names=["f"])
    layout = row_bytes(DIM, torch.float32, optim.SGD(lr=0.1))
    assert options.shard_budget(config, 1_000_000, layout, 0.3) == int(0.3 * 1_000_000 * layout)
    assert options.shard_budget(config, 1_000_000, layout) == int(0.1 * 1_000_000 * layout)
    shard = dataclasses.make_dataclass("Shard", [("fused_params", dict)])({"cache_load_factor": 0.3})
    assert planned_load_factor(shard, None) == 0.3
    with pytest.raises(ValueError, match="table 't': its cache load factor .* must be in \\(0, 1\\], got 1.5"):
        options.shard_budget(config, 1_000_000, layout, 1.5)


def test_under_dmp_the_kernels_open_with_the_chosen_memory_and_read_what_was_predicted(tmp_path):
    """Two ranks train on batches the sample did not see: the disk kernels' budgets are the choice's,
    and the rows a step reads are the predicted ones (measured over the second half)."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "job_budget_worker.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    chosen, measured = result["chosen"], result["measured"]
    assert chosen["small"]["in_memory"] and result["kernels"]["small"] != DISK_KERNEL
    on_disk = [name for name, m in chosen.items() if not m["in_memory"]]
    assert sorted(on_disk) == sorted(measured) == ["flat", "skewed"]
    assert all(result["kernels"][name] == DISK_KERNEL for name in on_disk)
    assert result["disk_budget"] == pytest.approx(sum(chosen[n]["memory_bytes"] for n in on_disk), rel=0.02)
    # The shards of both tables share each rank's cache, which holds the rows read most of either.
    predicted = sum(chosen[n]["reads_per_step"] for n in on_disk)
    assert sum(measured[n]["reads_per_step"] for n in on_disk) == pytest.approx(predicted, rel=0.15)
    for name in on_disk:
        assert measured[name]["row_hit_rate"] == pytest.approx(chosen[name]["row_hit_rate"], abs=0.1), name
