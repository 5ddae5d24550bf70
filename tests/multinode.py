"""Nodes emulated on this machine: one ``torchrun`` agent per node, started as launch/train.sh starts them.

Every agent gets train.sh's arguments (``--nnodes N --nproc_per_node R``, a c10d rendezvous on the
head node, ``--max-restarts``) and environment (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); the
rendezvous port, which train.sh derives from the job id, is one found free at run time, and the
rendezvous id is new per cluster. What a real node has of its own, an emulated one is given:

- an address: node ``i`` is ``127.0.0.{i+1}`` (every 127/8 address reaches this machine). torchrun
  takes it as ``--local_addr``, and its c10d rendezvous orders nodes by address, so node ``i`` gets
  ``GROUP_RANK`` ``i`` and global ranks ``i*R .. i*R+R-1`` (``--node_rank`` is for the static
  rendezvous only: torchrun ignores it under c10d, as under launch/train.sh); ``ROLLPACKER_NODE_ADDR`` makes the
  coordinator's peers reach the node at it (``coordinator.exchange_endpoints``), as at another
  host's name. Node 0 hosts the rendezvous store, as the head node does (``is_host``);
- its ports: nodes share this machine's port space, so what a config fixes per node
  (``rollout.sglang_base_port``) comes from ``node_args``.

Each agent runs in a session of its own; :meth:`Node.kill` ends a whole node (the agent's process
group and its workers', which torchrun puts in sessions of their own), and leaving the ``with``
block kills every node.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import psutil
import pytest

from testkit import REPO_ROOT
from procgroup import kill_group  # tests/ is on sys.path: the test files that import this put it there
from slurm_cluster import free_ports


def node_addr(index: int) -> str:
    return f"127.0.0.{index + 1}"


class Node:
    """One emulated node: its torchrun agent, whose output goes to ``log``."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str], log: Path):
        self.index, self.log = index, log
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> dict[int, tuple[int, int]]:
        """Global rank -> (pid, GROUP_RANK) of the agent's workers now running."""
        found = {}
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return found
        for child in children:
            try:
                env = child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = (child.pid, int(env["GROUP_RANK"]))
        return found

    def kill(self) -> None:
        """SIGKILL the node: its agent's process group, then every group below it. torchrun starts
        each worker in a session of its own (so that it can signal a worker and its children
        together), so the agent's group alone would leave the workers running, orphaned."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        groups = []
        for child in tree:  # live now: their groups are theirs
            with contextlib.suppress(ProcessLookupError):
                groups.append(os.getpgid(child.pid))
        kill_group(self.proc)  # the agent's first: it must not start workers again
        for group in dict.fromkeys(g for g in groups if g != self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


class Cluster:
    """``nodes`` torchrun agents x ``nproc`` workers running ``args`` (``-m rollpacker.train ...``).

    ``node_args(i)`` are appended to node ``i``'s program arguments, ``node_env(i)`` added to its
    environment. Use as a context manager: every node is killed on the way out."""

    def __init__(self, nodes: int, nproc: int, args: list[str], *, logs: Path, max_restarts: int = 0,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 node_args: Callable[[int], list[str]] = lambda i: [],
                 node_env: Callable[[int], dict[str, str]] = lambda i: {}):
        self.nodes: list[Node] = []
        port, rdzv_id = free_ports(1)[0], uuid.uuid4().hex[:12]
        base_env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(nodes):
                cmd = [python, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={nproc}",
                       "--rdzv_backend=c10d", f"--rdzv_endpoint={node_addr(0)}:{port}",
                       f"--rdzv_id={rdzv_id}", f"--rdzv_conf=is_host={int(i == 0)}", f"--local_addr={node_addr(i)}",
                       f"--max-restarts={max_restarts}", *args, *node_args(i)]
                env_i = {**base_env, "ROLLPACKER_NODE_ADDR": node_addr(i), **node_env(i)}
                self.nodes.append(Node(i, cmd, env_i, logs / f"node{i}.log"))
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def outputs(self) -> str:
        return "\n".join(f"--- node {n.index} ---\n{n.output()[-4000:]}" for n in self.nodes)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 600, *,
                   agents_may_exit: bool = False) -> None:
        """Poll ``condition``; fail the test (with every node's output) if ``timeout`` passes or,
        unless ``agents_may_exit``, an agent exits first."""
        deadline = time.monotonic() + timeout
        while not condition():
            exited = not agents_may_exit and any(n.proc.poll() is not None for n in self.nodes)
            if exited or time.monotonic() > deadline:
                pytest.fail(f"never saw {what} (agents' exit codes {[n.proc.poll() for n in self.nodes]}):\n"
                            f"{self.outputs()}")
            time.sleep(0.01)

    def ranks(self, world: int) -> dict[int, tuple[int, int]]:
        """Global rank -> (pid, node) of every worker, once all ``world`` are running."""
        found: dict[int, tuple[int, int]] = {}

        def everyone() -> bool:
            found.clear()
            for node in self.nodes:
                found.update(node.workers())
            return len(found) == world

        self.wait_until(everyone, f"{world} workers running")
        return dict(found)

    def wait(self, timeout: float = 600) -> list[int]:
        """Every agent's exit code."""
        deadline = time.monotonic() + timeout
        try:
            return [n.proc.wait(timeout=max(1.0, deadline - time.monotonic())) for n in self.nodes]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agents ran past {timeout}s:\n{self.outputs()}")


def connected(client: int, server: int, addr: str) -> bool:
    """Whether process ``client`` holds a TCP connection to a socket of process ``server`` that it
    reached at ``addr`` (the server end's local address)."""
    try:
        ends = {c.raddr for c in psutil.Process(client).net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED}
        return any(c.laddr in ends and c.laddr.ip == addr
                   for c in psutil.Process(server).net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED)
    except psutil.NoSuchProcess:
        return False
