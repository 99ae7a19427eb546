"""Small Python objects exchanged between torchrun ranks through the process group's key-value
store, not through a gloo collective.

Why: a gloo worker thread lets go of a finished collective (and of the tensors it holds) a moment
after the waiting rank has resumed. When that rank is already tearing Python down (a collective
just before exit), letting go of a tensor made in Python needs the GIL, Python ends the worker
thread with ``pthread_exit``, and the process aborts with "terminate called without an active
exception" (seen in a core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
``take_gil`` -> ``PyThread_exit_thread``, during ``Py_FinalizeEx``). The store holds bytes, no
tensors, so an exchange at the end of a run cannot race the interpreter's exit.

The last training step's gradient allreduces (DDP's, in backward) race it the same way: each gloo
work keeps the backward's thread-local state, which holds a Python object, and gloo's threads
outlive ``destroy_process_group``. ``exit_without_finalizing`` ends a rank's process once its exit
handlers have run, without the interpreter's teardown where that race aborts (seen at 2 runs in 30
of examples/dmp.py on a loaded machine; pytorch#190489).
"""
from __future__ import annotations

import atexit
import itertools
import os
import pickle
import sys
from typing import Any, List, NoReturn, Optional

import torch
import torch.distributed as dist

_exchanges = itertools.count()  # every rank makes the same calls in the same order


def all_gather_objects(obj: Any) -> List[Any]:
    """Every rank's `obj`, in rank order (as ``dist.all_gather_object``); each rank must call it
    the same number of times."""
    store = dist.distributed_c10d._get_default_store()
    exchange = next(_exchanges)
    store.set(f"mlkv/exchange{exchange}/{dist.get_rank()}", pickle.dumps(obj))
    return [pickle.loads(store.get(f"mlkv/exchange{exchange}/{rank}")) for rank in range(dist.get_world_size())]


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a collective's tensors must be for `group` (None: the default group): the current GPU
    for NCCL, which refuses CPU tensors, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """Ends this torchrun rank's process with `code`: the exit handlers run (they close open disk
    tables), the standard streams are flushed, and the process leaves without Python's teardown
    (see the module's docstring)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
