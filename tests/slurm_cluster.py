"""A one-node Slurm cluster on this machine, for launch tests (Debian slurmctld/slurmd/munge)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

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


class LocalSlurm:
    """Slurm and munge daemons of this test only: their own key, socket, ports, pid and state files
    under ``workdir``, stopped by the pids they wrote. Nothing system-wide is read, written or killed,
    so a real cluster's daemons on the same machine are left alone."""

    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pid_files = [self.dir / "slurmd.pid", self.dir / "slurmctld.pid", self.dir / "munge" / "munged.pid"]

    def start(self, timeout: float = 60) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        munge = self.dir / "munge"
        munge.chmod(0o700)  # munged refuses a socket directory others can write to
        subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'munge.key'}"], check=True)
        (munge / "munge.key").chmod(0o400)
        subprocess.run(["/usr/sbin/munged", "--force", f"--socket={self.munge_socket}",
                        f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                        f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"], check=True)
        self.conf.write_text(self._conf())
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env, check=True)
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], env=self.env, check=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(1)
        raise RuntimeError(f"Slurm did not come up: {out.stdout} {out.stderr}\n{self.logs()}")

    def sbatch(self, args: list[str], cwd: Path) -> subprocess.Popen:
        """``sbatch --wait ARGS``, started: it returns with the job's exit code once the job ends."""
        return subprocess.Popen(["sbatch", "--wait", *args], cwd=cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in (self.dir / "log").glob("*.log"))

    def stop(self, timeout: float = 90) -> None:
        # A job still running (a test that failed or timed out) is cancelled and left to end while
        # slurmctld is up: a slurmstepd that cannot report its job's end to it outlives the daemons
        # and makes existing_slurm() refuse every later cluster on this machine.
        subprocess.run(["scancel", "--partition=debug"], env=self.env, capture_output=True)
        deadline = time.time() + timeout
        while time.time() < deadline and subprocess.run(["squeue", "-h"], env=self.env, capture_output=True,
                                                        text=True).stdout.strip():
            time.sleep(1)
        for pid_file in self.pid_files:
            if pid_file.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        time.sleep(0.5)

    def _conf(self) -> str:
        d, cpus, ports = self.dir, os.cpu_count(), _free_ports(2)
        return f"""ClusterName=rollpacker-test
SlurmctldHost={self.host}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={self.host} CPUs={cpus} RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _free_ports(n: int) -> list[int]:
    """Ports free now, so the test's daemons never take over a real cluster's 6817/6818."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
