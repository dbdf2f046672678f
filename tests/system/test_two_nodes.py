"""The pipeline across two SLURM nodes: pretrain asks for 2 nodes (one process each) and runs through
`snakemake --profile pipelines/profiles/slurm` on a two-node cluster made on this machine
(slurm.TwoNodeSlurm: each slurmd in network and UTS namespaces of its own). The launcher starts one
torchrun per node with srun; the ranks report both hostnames; the losses equal a single-node run of the
same world size."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import slurm
from workspace import make_clone, sh

pytestmark = [pytest.mark.system, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = slurm.available() or slurm.namespaces_available()
    if why:
        pytest.skip(why)
    with slurm.TwoNodeSlurm(tmp_path_factory.mktemp("slurm-2n")) as c:
        yield c


def losses(path) -> np.ndarray:
    rows = path.read_text().splitlines()[1:]
    return np.array([float(r.split(",")[1]) for r in rows])


def test_pretrain_on_two_nodes_equals_one_node(two_nodes, tmp_path_factory, mirror):
    clone = make_clone(tmp_path_factory.mktemp("two-nodes"))
    table = clone / "pipelines/stages.yaml"
    text = table.read_text()
    line = re.search(r"\n  pretrain:\n(?:    .*\n)*?    resources: \{([^}]*)\}", text)
    resources = re.sub(r"nproc_per_node: \d+", "nodes: 2, nproc_per_node: 1", line.group(1))
    table.write_text(text.replace(line.group(0), line.group(0).replace(line.group(1), resources)))
    tracking = clone / "cluster-tracking.db"
    out = sh(
        f"snakemake pretrain --profile pipelines/profiles/slurm --config cpu_only=1 "
        f"mlflow_tracking_uri=sqlite:///{tracking}",
        clone,
        timeout=1800,
    )
    submitted = dict(re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", out))
    jobs = {job: log for job, log in submitted.items() if "rule_pretrain" in log}
    assert len(jobs) == 1, f"pretrain went through sbatch once:\n{out[-4000:]}"
    ((job, _),) = jobs.items()
    info = two_nodes.job(job)
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2", info
    log = (clone / "logs/pretrain.log").read_text()
    joined = re.search(r"preflight: 2 processes joined on 2 host\(s\): (.*)", log)
    assert joined, log[-4000:]
    print(f"pretrain ranks: {joined.group(1)}")
    assert {"pnode1", "pnode2"} == set(re.findall(r"pnode\d", joined.group(1)))
    assert "--rdzv-endpoint=pnode" in log and "srun --overlap --nodes=2" in log

    # The same world size on one node: the losses of the two-node run.
    cmd = f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 -m stages.pretrain"
    sh(f"{cmd} --input data/tokenize --output one-node", clone, timeout=900)
    two, one = losses(clone / "data/pretrain/plots/loss.csv"), losses(clone / "one-node/plots/loss.csv")
    print(f"two nodes vs one: largest relative loss difference {np.max(np.abs(two - one) / one):.1e}")
    np.testing.assert_allclose(two, one, rtol=1e-4)
    assert subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split() == [
        "pnode1",
        "pnode2",
    ]
