"""A Slurm cluster on this machine for launch tests (Debian slurmctld/slurmd/munge): emulated nodes,
each its own slurmd (``slurmd -N NAME``) on its own port. This needs a Slurm built with
``--enable-multiple-slurmd``; Debian's 22.05 is (its ``scontrol show config`` lists MULTIPLE_SLURMD)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def available() -> str | None:
    """None when the cluster can be started here, else the reason it cannot."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)}); .ci/run installs them with apt-get"
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd needs root"
    return existing_slurm()


def existing_slurm() -> str | None:
    """Why this machine may already be part of a Slurm cluster, or None. The test's daemons share
    nothing with one (own config, ports, munge key and socket, state), but a slurmd beside a real one
    would still run job steps on the same cores and cgroups: where any sign of a cluster is found,
    the test does not start."""
    inside = sorted(k for k in os.environ if k in ("SLURM_JOB_ID", "SLURM_CLUSTER_NAME", "SLURM_CONF"))
    if inside:
        return f"this process runs under Slurm ({', '.join(inside)} set): not starting test daemons beside it"
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue
        if name in ("slurmctld", "slurmd", "slurmdbd"):
            return f"a {name} is already running here (pid {comm.parent.name}): not starting test daemons beside it"
    return None


def host_node_config(nodes: int = 1) -> str:
    """The hardware part of a NodeName line, from ``slurmd -C`` (what slurmd itself will report
    when it registers): the host's CPU topology, and its memory split between ``nodes`` emulated
    nodes less 10%. A node that declares more than slurmd reports is drained ("Low RealMemory")."""
    out = subprocess.run(["/usr/sbin/slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split("\n", 1)[0].split())
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    return " ".join(f"{k}={fields[k]}" for k in keys) + f" RealMemory={int(fields['RealMemory']) * 9 // 10 // nodes}"


class LocalSlurm:
    """Slurm and munge daemons of this test only: their own key, ports, pid and state files under
    ``workdir``, their sockets (and the spool, which holds slurmstepd's) in a short directory of their
    own in /tmp, removed on stop; stopped by the pids they wrote. Nothing system-wide is read, written
    or killed, so a real cluster's daemons on the same machine are left alone.

    The nodes, ``node0``, ``node1``, ..., are each served by a slurmd of its own (``-N``) on its own
    port, all at ``NodeAddr=127.0.0.1`` on this host. A job that needs a node's address asks Slurm for
    its NodeAddr (``launch/train.sh`` does)."""

    def __init__(self, workdir: Path, nodes: int = 1):
        self.dir = Path(workdir)
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.conf = self.dir / "slurm.conf"
        self.sockets: Path | None = None  # made by start()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> "LocalSlurm":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        """Start munged, slurmctld and every node's slurmd, and wait until every node is idle; on
        any failure the daemons already started are stopped before the error is raised."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        # A Unix socket's path holds at most 107 bytes, and slurmstepd names a job step's socket
        # SPOOL/NODE/NODE_JOBID.STEPID: under a deep tmp_path (pytest-xdist's popen-gwN/ was enough)
        # every job failed to launch and was requeued, never run. So the sockets live in /tmp.
        self.sockets = Path(tempfile.mkdtemp(prefix="rp-slurm-", dir="/tmp"))  # 0700, as munged requires
        for sub in ("state", "log", "munge"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        munge = self.dir / "munge"
        munge.chmod(0o700)  # munged refuses a key directory others can write to
        subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'munge.key'}"], check=True)
        (munge / "munge.key").chmod(0o400)
        subprocess.run(["/usr/sbin/munged", "--force", f"--socket={self.sockets / 'munge.socket'}",
                        f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                        f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"], check=True)
        self.conf.write_text(self._conf())
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env, check=True)
        for name in self.nodes:
            (self.sockets / "spool" / name).mkdir(parents=True, exist_ok=True)
            started = subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf), "-N", name], env=self.env,
                                     capture_output=True, text=True)
            if started.returncode:
                raise RuntimeError(f"slurmd -N {name} exited {started.returncode}: {started.stderr.strip()}\n"
                                   f"{self.logs()}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], env=self.env, capture_output=True,
                                 text=True)
            states = dict(line.split(" ", 1) for line in out.stdout.splitlines())
            drained = {n: s for n, s in states.items() if s.startswith(("drain", "inval"))}
            if drained:
                raise RuntimeError(f"Slurm took nodes out of service: {drained}\n{self.logs()}")
            if out.returncode == 0 and sorted(states) == sorted(self.nodes) and all(
                    s.split()[0] in ("idle", "mixed", "allocated") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up: {out.stdout} {out.stderr}\n{self.logs()}")

    def sbatch(self, args: list[str], cwd: Path) -> subprocess.Popen:
        """``sbatch --wait ARGS``, started: it returns with the job's exit code once the job ends."""
        return subprocess.Popen(["sbatch", "--wait", *args], cwd=cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.dir / "log").glob("*.log")))

    def stop(self, timeout: float = 90) -> None:
        # A job still running (a test that failed or timed out) is cancelled and left to end while
        # slurmctld is up: a slurmstepd that cannot report its job's end to it outlives the daemons
        # and makes existing_slurm() refuse every later cluster on this machine.
        if (self.dir / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--partition=debug"], env=self.env, capture_output=True)
            deadline = time.time() + timeout
            while time.time() < deadline and subprocess.run(["squeue", "-h"], env=self.env, capture_output=True,
                                                            text=True).stdout.strip():
                time.sleep(0.5)
        daemons = []
        for pid_file in [*self.dir.glob("slurmd-*.pid"), self.dir / "slurmctld.pid", self.dir / "munge" / "munged.pid"]:
            with contextlib.suppress(OSError, ValueError, psutil.Error):
                proc = psutil.Process(int(pid_file.read_text().split()[0]))
                proc.send_signal(signal.SIGTERM)
                daemons.append(proc)
        _, alive = psutil.wait_procs(daemons, timeout=30)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def _conf(self) -> str:
        d, ports = self.dir, free_ports(1 + len(self.nodes))
        hardware = host_node_config(len(self.nodes))
        node_lines = "\n".join(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                               f"{hardware} State=UNKNOWN" for name, port in zip(self.nodes, ports[1:]))
        return f"""ClusterName=rollpacker-test
SlurmctldHost={self.host}
SlurmctldPort={ports[0]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.sockets / "munge.socket"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={self.sockets}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{node_lines}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def free_ports(n: int) -> list[int]:
    """Ports free now, so the test's daemons never take over a real cluster's 6817/6818."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
