"""A torchrun worker for tests/train/test_export.py: reads an export as the ranks of an import do
(`read_export_on_ranks`, each rank checksumming its share of the files) and writes what it found
to OUT.rank<r>: "read" or the ConfigError's message.

    torchrun --nproc_per_node N tests/workers/read_export_worker.py EXPORT OUT
"""
import sys

import torch.distributed as dist

from mlkv_torch.config import ConfigError
from mlkv_torch.exported_tables import read_export_on_ranks
from mlkv_torch.ranks import exit_without_finalizing


def main() -> None:
    export, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        read_export_on_ranks(export)
        found = "read"
    except ConfigError as e:
        found = str(e)
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        f.write(found)
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
