"""SLURM clusters on this machine, for the system tests: munged, slurmctld and slurmd in the foreground
as root (no systemd), started as child processes and stopped by their PIDs. LocalSlurm is one node (this
machine); TwoNodeSlurm, which the system tests use, two nodes in network namespaces (below).

    with TwoNodeSlurm(tmp_path) as cluster:   # partition "main", each node all of this machine's CPUs
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
import sys
import time
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
PARTITION = "main"
# The plugin first asks for a job's state 40 s after submitting it, and waits 10 s longer after each
# round that saw no job finish (checks at 40, 90, 150 s ...). The tests' jobs run for seconds to a minute:
# their first check comes after 1 s, and tests/system/snakemake_slurm.py keeps the rounds at most 2 s
# apart (checks at 1, 3, 5 s ...), so that a job's end is seen within seconds, not ~15 s on average.
SNAKEMAKE = (
    f"{sys.executable} {Path(__file__).with_name('snakemake_slurm.py')} --profile pipelines/profiles/slurm "
    "--slurm-init-seconds-before-status-checks 1"
)


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
# A requeued job waits this long before it starts again (default 120 s): the test's preempted job.
AuthInfo=cred_expire=30
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
        self._start_controller(slurm_conf(self.state))
        self._spawn("slurmd", "-D")
        self._wait(self.node_idle, "slurmd to register an idle node", 60)

    def _start_controller(self, conf: str) -> None:
        """Write slurm.conf (keeping the file that was there), then start munged and slurmctld."""
        if CONF.exists():
            self.saved_conf = CONF.read_bytes()
        CONF.parent.mkdir(parents=True, exist_ok=True)
        CONF.write_text(conf)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        # --force: munged refuses to run as root or with a socket left by an earlier run otherwise.
        self._spawn("munged", "--foreground", "--force")
        self._wait(lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, "munged", 20)
        self._spawn("slurmctld", "-D", "-i")

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


# ---------------------------------------------------------------------------------- two nodes
NODES = {"pnode1": "10.231.0.11", "pnode2": "10.231.0.12"}
BRIDGE, CONTROLLER_ADDRESS = "pl-br0", "10.231.0.1"


def two_node_conf(state: Path) -> str:
    """slurm.conf for two compute nodes, each this machine's CPUs and memory at its own address; the
    controller on the bridge's address; each slurmd's files named by its node (%n)."""
    conf = slurm_conf(state)
    host = socket.gethostname().split(".")[0]
    conf = conf.replace(f"SlurmctldHost={host}", f"SlurmctldHost={host}({CONTROLLER_ADDRESS})")
    for key, name in (("SlurmdSpoolDir", "d"), ("SlurmdPidFile", "slurmd.pid"), ("SlurmdLogFile", "slurmd.log")):
        stem, dot, ext = name.partition(".")
        conf = conf.replace(f"{key}={state}/{name}", f"{key}={state}/{stem}-%n{dot}{ext}")
    resources = re.sub(r"^NodeName=\S+ ", "", node_line())
    lines = "\n".join(f"NodeName={n} NodeAddr={a} {resources} State=UNKNOWN" for n, a in NODES.items())
    return re.sub(r"^NodeName=.*$", lines, conf, flags=re.M)


class TwoNodeSlurm(LocalSlurm):
    """Two SLURM compute nodes on this machine: each slurmd in a network namespace of its own (its own
    address on a veth pair to a bridge the controller listens on) and a UTS namespace (its own
    hostname), names in /etc/hosts; slurmctld and munged as for one node. The filesystem is shared, as on
    a cluster. Everything made is removed at the end: daemons stopped by PID, namespaces, links, the
    /etc/hosts lines."""

    def __init__(self, state: Path):
        super().__init__(state)
        self.saved_hosts: str | None = None
        self.made: list[list[str]] = []  # commands that undo what was made, in reverse order

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def start(self) -> None:
        for sub in ("ctld", "munge", *(f"d-{n}" for n in NODES)):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self._ip("link", "add", BRIDGE, "type", "bridge")
        self.made.append(["link", "del", BRIDGE])
        self._ip("addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", BRIDGE)
        self._ip("link", "set", BRIDGE, "up")
        for i, (name, address) in enumerate(NODES.items(), 1):
            ns, veth = f"pl-{name}", f"pl-veth{i}"
            self._ip("netns", "add", ns)
            self.made.append(["netns", "del", ns])
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", veth, "master", BRIDGE)
            self._ip("link", "set", veth, "up")
            for args in (
                ("addr", "add", f"{address}/24", "dev", "eth0"),
                ("link", "set", "eth0", "up"),
                ("link", "set", "lo", "up"),
            ):
                self._ip("-n", ns, *args)
        hosts = Path("/etc/hosts")
        self.saved_hosts = hosts.read_text()
        hosts.write_text(self.saved_hosts + "".join(f"{a} {n}\n" for n, a in NODES.items()))
        self._start_controller(two_node_conf(self.state))
        for name in NODES:
            # nsenter, not `ip netns exec`, which mounts a sysfs of its own without /sys/fs/cgroup
            script = f"hostname {name} && exec slurmd -D"
            self._spawn("nsenter", f"--net=/run/netns/pl-{name}", "unshare", "--uts", "sh", "-c", script, name)
        self._wait(self.node_idle, "both slurmd to register idle nodes", 90)

    def node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T", "-p", PARTITION], capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.split() == ["idle"] * len(NODES)

    def stop(self) -> None:
        super().stop()
        if self.saved_hosts is not None:
            Path("/etc/hosts").write_text(self.saved_hosts)
        for args in reversed(self.made):
            subprocess.run(["ip", *args], capture_output=True)
        self.made.clear()


def namespaces_available() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    import os

    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for c in ("ip", "nsenter", "unshare"):
        if shutil.which(c) is None:
            return f"{c} is not installed (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "add", "pl-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "pl-probe"], capture_output=True)
    return None
