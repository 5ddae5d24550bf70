"""A one-node Slurm cluster on this machine, for launch tests (Debian slurmctld/slurmd/munge)."""
from __future__ import annotations

import os
import shutil
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
    return None


class LocalSlurm:
    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[str] = []

    def start(self, timeout: float = 60) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._conf())
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--force"], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force"], check=True)
        self._stop_daemons()
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env, check=True)
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], env=self.env, check=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(1)
        raise RuntimeError(f"Slurm did not come up: {out.stdout} {out.stderr}\n{self.logs()}")

    def sbatch(self, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["sbatch", "--wait", *args], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in (self.dir / "log").glob("*.log"))

    def stop(self) -> None:
        self._stop_daemons()

    def _stop_daemons(self) -> None:
        for d in ("slurmd", "slurmctld"):
            subprocess.run(["pkill", "-x", d], capture_output=True)
        time.sleep(0.5)

    def _conf(self) -> str:
        d, cpus = self.dir, os.cpu_count()
        return f"""ClusterName=rollpacker-test
SlurmctldHost={self.host}
SlurmUser=root
AuthType=auth/munge
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
