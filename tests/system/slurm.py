"""A single-node SLURM cluster on this machine, for the system tests: munged, slurmctld and slurmd in
the foreground as root (no systemd), started as child processes and stopped by their PIDs.

    with LocalSlurm(tmp_path) as cluster:   # partition "main", all of this node's CPUs and memory
        cluster.wait_job(job_id)

The configuration goes to /etc/slurm/slurm.conf (where srun inside jobs looks, whatever SLURM_CONF
says); a file already there is put back afterwards. Accounting is off, so job states come from
slurmctld (scontrol), which keeps finished jobs for MinJobAge seconds.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
PARTITION = "main"


def node_line() -> str:
    """This machine as slurmd sees it (`slurmd -C`), without the uptime line."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if line.startswith("NodeName="))


def slurm_conf(state: Path) -> str:
    host = socket.gethostname().split(".")[0]
    node = re.sub(r"^NodeName=\S+", f"NodeName={host}", node_line())
    return f"""ClusterName=pipeline-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/d
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=30
{node} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, state: Path):
        self.state = Path(state)
        self.procs: list[subprocess.Popen] = []
        self.saved_conf: bytes | None = None

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, *cmd: str) -> subprocess.Popen:
        log = open(self.state / f"{Path(cmd[0]).name}.out", "ab")
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        for sub in ("ctld", "d", "munge"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        if CONF.exists():
            self.saved_conf = CONF.read_bytes()
        CONF.parent.mkdir(parents=True, exist_ok=True)
        CONF.write_text(slurm_conf(self.state))
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        # --force: munged refuses to run as root or with a socket left by an earlier run otherwise.
        self._spawn("munged", "--foreground", "--force")
        self._wait(lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, "munged", 20)
        self._spawn("slurmctld", "-D", "-i")
        self._spawn("slurmd", "-D")
        self._wait(self.node_idle, "slurmd to register an idle node", 60)

    def node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T", "-p", PARTITION], capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _wait(self, ready, what: str, seconds: float) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.state.glob("*.log")) + sorted(self.state.glob("*.out"))
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, JobName, ...)."""
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, check=True
        ).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), seconds=900) -> dict:
        deadline = time.time() + seconds
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not in {states} after {seconds}s: {self.job(job_id)}")

    def stop(self) -> None:
        # Daemons in reverse order of start, each by its PID.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        if self.saved_conf is not None:
            CONF.write_bytes(self.saved_conf)
        elif CONF.exists():
            CONF.unlink()


def available() -> str | None:
    """Why a local cluster cannot be started here, or None."""
    import os

    if os.geteuid() != 0:
        return "needs root to run munged, slurmctld and slurmd"
    missing = [
        c for c in ("munged", "munge", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol") if shutil.which(c) is None
    ]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing; bash tests/system/install.sh slurm)"
    return None
