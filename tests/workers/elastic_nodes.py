"""A TorchElastic job whose nodes come and go: two nodes (network namespaces on a bridge, one rank
each, `torchrun --nnodes 1:2 --max-restarts 3`, c10d rendezvous on node 0, the tables on a path both
see), node 1 killed (every process in its namespace) once the job has checkpointed, the job going on
with node 0 alone, then node 1 started again and the job growing back to two nodes until it ends.
Prints a JSON record of what happened (tests/train/test_elastic_nodes.py checks it); needs root.

    python tests/workers/elastic_nodes.py WORK_DIR
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from shaped_network import ShapedNetwork  # noqa: E402

STEPS, CHECKPOINT_EVERY = 1000, 25
RDZV_PORT = 29671  # in node 0's namespace, which has ports of its own
TIMEOUT_S = 1200


def _launch(net: ShapedNetwork, node: int, work: Path, attempt: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1",
            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.address(0)}:{RDZV_PORT}",
            "--rdzv-id", "elastic-nodes", "--local-addr", net.address(node),
            # node 0 hosts the rendezvous (its address is not this machine's host name's)
            "--rdzv-conf", f"last_call_timeout=2,is_host={int(node == 0)}",
            "-m", "mlkv_torch.train", str(REPO / "configs" / "quickstart.yaml"), f"output_dir={work / 'run'}",
            f"storage.path={work / 'tables'}", f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
            "train.log_every=1", "data.synthetic.scale=100", "train.batch_size=256", "eval.batches=2",
            "eval.every=100000", "storage.memory_budget_bytes=1048576", "--no-progress"]
    log = open(work / f"node{node}-{attempt}.log", "w")
    # A store of each attempt's own: a node that joins again counts its attempts from 0 (cli.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return net.popen(node, argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _steps(work: Path) -> list:
    try:
        return [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line]
    except FileNotFoundError:
        return []


def _wait(what: str, done, node0: subprocess.Popen, work: Path, began: float) -> None:
    while not done():
        if node0.poll() is not None or time.monotonic() - began > TIMEOUT_S:
            raise SystemExit(f"node 0 {'ended' if node0.poll() is not None else 'timed out'} before {what}:\n"
                             + (work / "node0-a.log").read_text()[-4000:])
        time.sleep(0.5)


def main(work: Path) -> int:
    (work / "run").mkdir(parents=True)
    began = time.monotonic()
    with ShapedNetwork(nodes=2, rate=None, prefix="mlkv-elastic") as net:
        node0, node1 = _launch(net, 0, work, "a"), _launch(net, 1, work, "a")
        _wait("its second checkpoint", lambda: max(_steps(work), default=0) > 2 * CHECKPOINT_EVERY + 5, node0, work,
              began)
        killed_at = max(_steps(work))
        for pid in subprocess.run(["ip", "netns", "pids", net.namespace(1)], capture_output=True,
                                  text=True).stdout.split():
            os.kill(int(pid), signal.SIGKILL)  # the node is gone: its agent and its worker
        node1.wait()
        log = work / "node0-a.log"
        _wait("it trained alone", lambda: "resharded for one process" in log.read_text(), node0, work, began)
        node1 = _launch(net, 1, work, "b")
        codes = [node0.wait(timeout=TIMEOUT_S), node1.wait(timeout=TIMEOUT_S)]
    text = log.read_text()
    resumed = [(int(a), b) for a, b in re.findall(r"the checkpoint at step ([0-9]+) was written by ([^;]+);", text)]
    pointer = json.loads((work / "run" / "checkpoint.latest").read_text()) \
        if (work / "run" / "checkpoint.latest").exists() else {}
    print(json.dumps({"codes": codes, "killed_at": killed_at, "resumed": resumed, "steps": _steps(work),
                      "batches": pointer.get("batches"),
                      "seconds": time.monotonic() - began, "node0_log_tail": text[-3000:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
