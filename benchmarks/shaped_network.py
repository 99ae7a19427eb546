"""A slow network on one machine: N Linux network namespaces, one per node, joined by a bridge in a
namespace of its own, each link rate-shaped with `tc` (a token bucket) in both directions.

Needs root (`ip netns`, `tc`). Traffic goes only among the namespaces this makes (addresses
10.77.0.1 .. 10.77.0.N, node i at 10.77.0.(i + 1)); they are removed by name when the `with` block
ends, also on failure, and namespaces left by an earlier run of the same prefix are removed first.

    with ShapedNetwork(nodes=2, rate="100mbit") as net:
        net.popen(0, ["python", "-c", "..."])       # in node 0's namespace
        net.tx_bytes()                              # bytes each node has sent so far

`run_job(net, config, ...)` runs the runner on such a network as a multi-node torchrun job, one rank
per node, each node's tables in its own `storage.path` and only `output_dir` shared (the
benchmarks across nodes: bench_replicas.py, bench_row_wise.py --nodes).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from common import REPO

SUBNET = "10.77.0"
PREFIX = "mlkv-net"
MASTER_PORT = 29611


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> Optional[str]:
    """None when this process can make network namespaces; else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


class ShapedNetwork:
    """`nodes` namespaces on a bridge, each link shaped to `rate` (tc's units: 1gbit, 100mbit; None:
    unshaped)."""

    def __init__(self, nodes: int, rate: Optional[str], prefix: str = PREFIX) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be in [1, 200], got {nodes}")
        self.nodes, self.rate, self.prefix = nodes, rate, prefix
        self.hub = f"{prefix}-hub"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def interface(self, node: int) -> str:
        """The node's end of its link, inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"{self.prefix[:6]}v{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "ShapedNetwork":
        self.remove()  # what an earlier run that was killed left
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in range(self.nodes):
            ns, veth, peer = self.namespace(node), self.interface(node), f"p{node}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.hub)
            _ip("-n", self.hub, "link", "set", peer, "master", "br0")
            _ip("-n", self.hub, "link", "set", peer, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:  # both directions: what the node sends, and what the bridge sends it
                for where, dev in ((ns, veth), (self.hub, peer)):
                    _ip("netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                        "burst", "256kb", "latency", "50ms")

    def remove(self) -> None:
        """Deletes this network's namespaces (their links go with them); no error for missing ones."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in listed:
            if name == self.hub or name.startswith(f"{self.prefix}-n"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def popen(self, node: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs: object) -> subprocess.Popen:
        """Starts `argv` in node `node`'s namespace, with GLOO_SOCKET_IFNAME set to its link."""
        full_env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=self.interface(node))
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv], env=full_env,
                                **kwargs)  # type: ignore[call-overload]

    def tx_bytes(self) -> List[int]:
        """Bytes each node has sent on its link so far."""
        out = []
        for node in range(self.nodes):
            path = f"/sys/class/net/{self.interface(node)}/statistics/tx_bytes"
            read = subprocess.run(["ip", "netns", "exec", self.namespace(node), "cat", path], check=True,
                                  capture_output=True, text=True)
            out.append(int(read.stdout))
        return out


def run_job(net: ShapedNetwork, config: str, output_dir: str, tables_root: str, overrides: List[str],
            resume: bool = False, timeout_s: float = 1800, nodes: Optional[int] = None) -> Dict[str, Any]:
    """One run of the runner, one rank per node of `net` (of its first `nodes`); returns rank 0's
    summary and the bytes the nodes sent."""
    before = sum(net.tx_bytes())
    nodes = net.nodes if nodes is None else nodes
    procs = []
    for node in range(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
                "--nproc_per_node=1", f"--master_addr={net.address(0)}", f"--master_port={MASTER_PORT}",
                "-m", "mlkv_torch.train", config, f"output_dir={output_dir}",
                f"storage.path={os.path.join(tables_root, f'node{node}')}", "--no-progress", *overrides]
        if resume:
            argv.append("--resume")
        log = open(os.path.join(output_dir, f"node{node}.log"), "w")
        procs.append((net.popen(node, argv, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed = []
    for node, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(node)
    if failed:
        for _, (proc, _) in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
        tails = {node: open(os.path.join(output_dir, f"node{node}.log")).read()[-3000:] for node in failed}
        raise RuntimeError(f"nodes {failed} failed: {tails}")
    with open(os.path.join(output_dir, "summary.json")) as f:
        summary = json.load(f)
    summary["link_bytes"] = sum(net.tx_bytes()) - before
    return summary
