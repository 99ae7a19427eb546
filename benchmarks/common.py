"""What the benchmarks share: the process and machine figures they read, Zipf-distributed ids, the
reference models (torch's embedding bag, TorchRec's DLRM over the Criteo Kaggle tables), a timer of
repeated runs, and the report writers (progress lines, markdown tables, JSON).

A benchmark run as `python benchmarks/bench_X.py` finds this module beside it (the script's folder
is first on sys.path); it uses mlkv_torch through its public API only. Heavy imports (torch,
torchrec) happen inside the functions that need them, so a benchmark's subprocess that does not use
them does not pay for them.
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# process and machine figures (Linux /proc)
# --------------------------------------------------------------------------------------------

def _proc_field_kib(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def proc_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...); -1 when absent."""
    return _proc_field_kib("/proc/self/status", field)


def meminfo_kib(field: str) -> int:
    """A field of /proc/meminfo in KiB (MemTotal, Cached, ...); -1 when absent."""
    return _proc_field_kib("/proc/meminfo", field)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_caches() -> Optional[str]:
    """Writes back dirty pages and drops the page cache (root only); returns an error text or None."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"drop_caches failed: {e}"


def system_busy_seconds() -> float:
    """CPU seconds all processes spent busy (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    v = [int(x) for x in parts]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def dir_bytes(path: str, apparent: bool = False) -> int:
    """Bytes of every file under path: allocated blocks, or with apparent=True the file sizes."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:  # a file may vanish meanwhile (compaction)
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if apparent else st.st_blocks * 512
    return total


def wait_for_quiet_machine(seconds: float) -> None:
    """Waits up to `seconds` for other processes to leave the cores (below 0.3 busy over 5 s)."""
    deadline, busy = time.time() + seconds, 0.0
    while time.time() < deadline:
        b0 = system_busy_seconds()
        time.sleep(5)
        busy = (system_busy_seconds() - b0) / 5
        if busy < 0.3:
            break
    print(f"# waited for a quiet machine: {busy:.2f} cores busy at the start", flush=True)


def machine_facts() -> Dict[str, Any]:
    """The machine and the code a report's figures come from: commit, host, CPUs, memory, versions."""
    import torch

    cpu_model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import fbgemm_gpu
        fbgemm_version = getattr(fbgemm_gpu, "__version__", "?")
    except ImportError:
        fbgemm_version = None
    commit, dirty = None, None
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"commit": commit, "uncommitted_changes": dirty, "host": platform.node(), "cpus": os.cpu_count(),
            "cpu_model": cpu_model,
            "memory_gib": meminfo_kib("MemTotal") / (1 << 20), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "fbgemm_gpu": fbgemm_version}


# --------------------------------------------------------------------------------------------
# the workload: Zipf ids
# --------------------------------------------------------------------------------------------

def zipf_cdf(rows: int, s: float):
    """The CDF of a Zipf(s) law bounded to ranks 1..rows (float64 numpy array)."""
    import numpy as np

    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    return cdf


def zipf_ranks(cdf, uniform):
    """Ranks (0 = hottest) drawn by inverse CDF from uniform draws in [0, 1)."""
    import numpy as np

    return np.minimum(np.searchsorted(cdf, uniform, side="right"), len(cdf) - 1)


# --------------------------------------------------------------------------------------------
# timing repeated runs
# --------------------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    return statistics.median(values)


def upper_median(values: Sequence[float]) -> float:
    """The middle element of the sorted values, the upper one of two for an even count: what
    bench_store and bench_embedding report as a batch's median latency."""
    return sorted(values)[len(values) // 2]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: the smallest value with q% of them at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def latency_summary(seconds: Sequence[float], scale: float = 1.0) -> Dict[str, float]:
    """Repeated runs' figures, times multiplied by `scale` (1e3: milliseconds): count, total, mean,
    median (the upper median, as the reports have always given it), p90, p99 and max."""
    s = [x * scale for x in seconds]
    if not s:
        return {"runs": 0}
    return {"runs": len(s), "total": sum(s), "mean": sum(s) / len(s), "median": upper_median(s),
            "p90": percentile(s, 90), "p99": percentile(s, 99), "max": max(s)}


class Timer:
    """Wall time of repeated runs: `with timer:` (or `timer.call(fn, ...)`) around each run, then
    `summary()` gives their count, total, mean, median, p90, p99 and max (`latency_summary`)."""

    def __init__(self) -> None:
        self.seconds: List[float] = []
        self._began = 0.0

    def __enter__(self) -> "Timer":
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds.append(time.perf_counter() - self._began)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self:
            return fn(*args, **kwargs)

    @property
    def total(self) -> float:
        return sum(self.seconds)

    def summary(self, scale: float = 1.0) -> Dict[str, float]:
        """The runs' figures, times multiplied by `scale` (1e3: milliseconds)."""
        return latency_summary(self.seconds, scale)


# --------------------------------------------------------------------------------------------
# the reference models
# --------------------------------------------------------------------------------------------

def torch_embedding_bag(rows: int, dim: int, lr: float, optimizer: str = "sgd", weights=None,
                        include_last_offset: bool = False, device=None):
    """The in-memory reference: torch.nn.EmbeddingBag (sum, sparse gradient) and torch's sparse
    optimizer ("sgd": SGD, "adam": SparseAdam); with `weights`, its rows start from them."""
    import torch

    bag = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=include_last_offset,
                                device=device)
    if weights is not None:
        with torch.no_grad():
            bag.weight.copy_(weights)
    opt = (torch.optim.SGD(bag.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.SparseAdam(bag.parameters(), lr=lr))
    return bag, opt


DENSE_FEATURES = 13  # of Criteo Kaggle, in every DLRM here


def criteo_kaggle_rows(scale: int) -> Dict[str, int]:
    """Criteo Kaggle's 26 tables divided by `scale` (at least 2 rows each), by name t0..t25."""
    from mlkv_torch.data import CRITEO_KAGGLE_CARDINALITIES

    return {f"t{i}": max(2, n // scale) for i, n in enumerate(CRITEO_KAGGLE_CARDINALITIES)}


def table_configs(rows: Dict[str, int], dim: int) -> List[Any]:
    """TorchRec's EmbeddingBagConfig of every table, one feature f_<name> each."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=n, feature_names=[f"f_{name}"])
            for name, n in rows.items()]


def dlrm(collection, dim: int):
    """TorchRec's DLRM over `collection`: 13 dense features, dense arch [64, dim], over arch [64, 1];
    the same dense weights every time (seeded)."""
    import torch
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    return DLRM(embedding_bag_collection=collection, dense_in_features=DENSE_FEATURES,
                dense_arch_layer_sizes=[64, dim], over_arch_layer_sizes=[64, 1], dense_device=torch.device("cpu"))


def dlrm_batches(rows: Dict[str, int], batch: int, zipf: float, rank: int, count: int):
    """`count` DLRM batches (dense features, one Zipf id per table per sample, labels) of one rank:
    the ids of every rank follow the same law (hot ids scattered by a fixed permutation per table)."""
    import numpy as np
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(1000 + rank)
    id_samplers = [(zipf_cdf(n, zipf), np.random.default_rng(i).permutation(n)) for i, n in enumerate(rows.values())]
    batches = []
    for _ in range(count):
        ids = [perm[zipf_ranks(cdf, rng.random(batch))] for cdf, perm in id_samplers]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{name}" for name in rows], values=torch.from_numpy(np.concatenate(ids)),
            lengths=torch.ones(len(rows) * batch, dtype=torch.int64))
        batches.append((torch.from_numpy(rng.standard_normal((batch, DENSE_FEATURES), dtype=np.float32)),
                        sparse, torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))))
    return batches


def dlrm_train_step(model, opt, batch, losses: List[float]) -> None:
    """One DLRM training step on (dense, sparse, labels); appends the loss."""
    import torch

    dense, sparse, labels = batch
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse).squeeze(1), labels)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))


def set_initial_rows(dmp, rows: Dict[str, int], dim: int) -> None:
    """Every table of a DistributedModelParallel DLRM starts from mlkv_torch.initial_rows, as a
    DiskEmbeddingBagCollection with seed 0 would (disk tables: every row written to the store)."""
    import torch

    from mlkv_torch import initial_rows
    from mlkv_torch.torchrec.tables import table_seed

    state = dmp.state_dict()
    for name, n in rows.items():
        for shard in state[f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight"].local_shards():
            for start in range(0, n, 1 << 20):
                ids = torch.arange(start, min(n, start + (1 << 20)))
                shard.tensor.detach()[start:start + ids.numel()] = initial_rows(ids, dim, seed=table_seed(0, name),
                                                                                 num_embeddings=n)
    dmp.load_state_dict(state)


def losses_equal(a: Sequence[float], b: Sequence[float]) -> bool:
    """Two runs' losses equal at every step (float32 training: rtol 1e-5, atol 1e-6)."""
    import numpy as np

    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))


# --------------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------------

class ReportLog:
    """Prints report lines as they come and keeps them for the report file."""

    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)


def runner_summary(cmd: Sequence[str], output_dir: str) -> Optional[Dict[str, Any]]:
    """Runs the runner's command line `cmd` (writing to `output_dir`) from the repository; its
    summary.json, or None (its stderr's end printed) if it failed."""
    import sys

    done = subprocess.run(list(cmd), capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    with open(os.path.join(output_dir, "summary.json")) as f:
        return json.load(f)


def write_json_report(path: str, report: Any) -> None:
    """Writes a benchmark's report as JSON to `path`, making its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def fmt_rate(x: Optional[float]) -> str:
    """A rate in short form: 1.23M, 45.6k, 789; "-" for None."""
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> List[str]:
    """A markdown table's lines; `align` gives each column's rule ("---", "---:"), by default "---"
    each: e.g. align="l r r" for a left column and two right-aligned ones."""
    rules = ["---:" if a == "r" else "---" for a in (align.split() if align else ["l"] * len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rules) + "|"] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
