"""Results shared through a DVC remote (a folder, as on a cluster's shared filesystem), on a copy of the
shared ci run (tests/shared_run.py): `make push` there; a fresh clone of the same commit pulls and nothing
re-runs; a clone without dvc.lock's records restores every stage from the run cache without running one;
a damaged object of DVC's cache, or an out changed in place, which DVC's own checks pass, stops a stage
that reads it before it starts, is named by `python -m pipelines.verify --rehash` with the command that
mends it, and is mended by `make pull`; a push killed half-way is completed by the next one."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from shared_run import BIN, copy_of_run, env_for, sh
from test_e2e import UP_TO_DATE, dvc_ran

pytestmark = pytest.mark.e2e
GIT = "git -c user.name=ci -c user.email=ci@localhost"


@pytest.fixture(scope="module")
def origin(tmp_path_factory, mirror) -> Path:
    """The run's copy with dvc.lock and measured/ committed, a folder remote added, and `make push` done."""
    clone = copy_of_run(tmp_path_factory.mktemp("remote") / "origin")
    sh(f"git add -A && {GIT} commit -qm run", clone)
    sh(f"dvc remote add -d store {clone.parent / 'store'} && {GIT} commit -qam 'the team remote'", clone)
    out = sh("python -m pipelines.share push", clone)  # (make push)
    entries = len(list((clone / ".dvc/cache/runs").glob("*/*/*")))
    assert f"{entries} run-cache entries" in out and entries == 14, out  # (one per stage run)
    return clone


def lock_stages(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["stages"]


def test_the_remote_holds_what_dvc_repro_pull_needs_beyond_dvc_push(origin):
    """Each measured file (an out DVC does not cache: `dvc push`, even with --run-cache, leaves it here)
    is on the remote, as is every cached out of dvc.lock."""
    store = origin.parent / "store"
    outs = [o for entry in lock_stages(origin / "dvc.lock").values() for o in entry["outs"]]
    measured = [o for o in outs if o["path"].startswith("measured/")]
    assert len(measured) == 13
    for o in outs:
        md5 = o["md5"]
        assert (store / "files/md5" / md5[:2] / md5[2:]).is_file(), f"{o['path']} ({md5}) is not on the remote"


def test_a_fresh_clone_pulls_and_nothing_reruns_and_rehash_names_what_dvc_misses(origin, tmp_path):
    other = tmp_path / "other"
    sh(f"git clone -q {origin} {other}", tmp_path)
    assert not (other / "data/pretrain").exists()
    sh("dvc pull", other)
    assert UP_TO_DATE in sh("dvc status", other)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", other)
    assert dvc_ran(sh("dvc repro", other)) == set()

    # A damaged object of DVC's cache (bit rot: its mode and time kept), checked out again, and an out
    # changed in place with its size and time kept: DVC's status (and checkout) trust the cache and their
    # records; --rehash names each file (and the damaged object), and each mend makes it whole again.
    listing = next(o for o in lock_stages(other / "dvc.lock")["memory_study"]["outs"] if o["md5"].endswith(".dir"))
    entries = yaml.safe_load((other / ".dvc/cache/files/md5" / listing["md5"][:2] / listing["md5"][2:]).read_text())
    entry = next(e for e in entries if e["relpath"] == "metrics.json")
    obj = other / ".dvc/cache/files/md5" / entry["md5"][:2] / entry["md5"][2:]
    damage(other, obj)
    assert UP_TO_DATE in sh("dvc status", other), "DVC trusts its cache (if this changes, --rehash is a second check)"
    # A stage that reads them is not handed the damaged bytes: its launcher hashes its inputs first.
    out = sh("dvc repro --force --single-item report", other, check=False)
    refused = "error: launch: report: data/memory_study/metrics.json, an input made by memory_study, is not what"
    assert refused in out and "python -m pipelines.verify --rehash` names the mend" in out, out[-3000:]
    assert "-m stages.report" not in out, "the stage did not start"
    sh("dvc checkout reports && git checkout -- measured/report.json", other)  # (DVC removed the stage's outs)
    out = sh("python -m pipelines.verify --rehash", other, check=False)
    damaged, edited = (x for x in out.splitlines() if x.startswith("BROKEN"))
    assert f"data/memory_study/metrics.json differs from dvc.lock (md5 {entry['md5']}), and so does" in damaged
    assert str(obj.relative_to(other)) in damaged and "2 broken link(s)" in out  # (all else pulled whole)
    assert "data/train_gnn/metrics.json differs from dvc.lock" in edited
    assert "DVC's cache holds the recorded bytes" in edited
    sh(f"{mend_of(damaged)} && {mend_of(edited)}", other)
    assert "every link holds" in sh("python -m pipelines.verify --rehash", other)

    # `make pull` mends both itself: the damaged object fetched again, the edited file checked out again.
    edited_bytes = (other / "data/train_gnn/metrics.json").read_bytes()
    damage(other, obj)
    flipped = obj.read_bytes()
    out = sh("python -m pipelines.share pull", other)  # (make pull)
    assert f"data/memory_study/metrics.json: DVC's cache object {obj} is damaged; fetching it again" in out, out
    assert "data/train_gnn/metrics.json is not what dvc.lock records; checking it out again" in out, out
    assert "pulled: every out is what dvc.lock records" in out  # (hashed from the bytes, as --rehash does)
    assert obj.read_bytes() != flipped and (other / "data/train_gnn/metrics.json").read_bytes() == edited_bytes


def test_a_clone_without_the_lock_records_restores_every_stage_from_the_run_cache(origin, tmp_path):
    """As on a branch whose dvc.lock was not committed: each stage's command, deps and params are those
    a run-cache entry on the remote holds, so `dvc repro --pull` checks out its outputs and runs nothing
    (no stage process starts: no MLflow store, no log)."""
    other = tmp_path / "other"
    sh(f"git clone -q {origin} {other} && {GIT} -C {other} rm -q dvc.lock", tmp_path)
    out = sh("dvc repro --pull", other)
    assert dvc_ran(out) == set(), out[-3000:]
    cached = set(re.findall(r"Stage '([\w@]+)' is cached - skipping run, checking out outputs", out))
    assert cached == set(lock_stages(origin / "dvc.lock")), out[-3000:]
    assert not (other / "mlflow.db").exists() and not (other / "logs").exists()
    assert lock_stages(other / "dvc.lock") == lock_stages(origin / "dvc.lock")
    assert UP_TO_DATE in sh("dvc status", other)


def damage(clone: Path, obj: Path) -> None:
    """Flip a byte of DVC's cache object `obj` (data/memory_study/metrics.json's) and check the out out
    again from it; flip a byte of data/train_gnn/metrics.json in place."""
    flip_first_byte(obj)
    sh("rm -rf data/memory_study && dvc checkout", clone)
    flip_first_byte(clone / "data/train_gnn/metrics.json")


def flip_first_byte(path: Path) -> None:
    """Change a file's first byte, keeping its size, mode and times (what DVC's state records)."""
    st = path.stat()
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.chmod(path, st.st_mode)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def mend_of(line: str) -> str:
    """The command of a BROKEN line's mend (before its alternative in parentheses)."""
    return line.split("; mend: ", 1)[1].split(" (or ", 1)[0]


def test_push_without_a_remote_is_one_line_naming_the_fix(tmp_path):
    sh("git init -q && dvc init -q", tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.share", "push", "--root", str(tmp_path)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no default DVC remote; add one: dvc remote add -d store" in proc.stderr


def test_an_ssh_remote_is_supported_by_what_is_installed(origin):
    """requirements.lock pins dvc-ssh: a push to an ssh:// remote gets as far as connecting (here to a
    closed port)."""
    out = sh("dvc remote add server ssh://127.0.0.1:9/dvc-store && dvc push -r server", origin, check=False)
    assert "requires 'dvc-ssh'" not in out and "Connect call failed ('127.0.0.1', 9)" in out, out


def test_a_push_killed_half_way_is_completed_by_the_next_and_a_pull_gets_every_file_whole(tmp_path):
    """`dvc push` SIGKILLed once part of the objects are on the remote: none there is partial (DVC writes
    each under a temporary name first), the next push sends the rest, and a fresh clone pulls every file
    equal to the original."""
    killed_push_round_trip(tmp_path, str(tmp_path / "store"), tmp_path / "store")


def killed_push_round_trip(tmp_path: Path, url: str, store: Path, local_config: dict | None = None) -> None:
    """The test above with the remote at `url` (its files at `store`, to look at), each of `local_config`
    set with `dvc remote modify --local` in both clones (tests/system/test_two_nodes.py: an SSH remote)."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    rng = random.Random(0)
    for i in range(200):
        (repo / "data" / f"{i:03}").write_bytes(rng.randbytes(1 << 20))
    local = " ".join(f"&& dvc remote modify --local store {k} {v}" for k, v in (local_config or {}).items())
    sh(f"git init -q && dvc init -q && dvc add -q data && dvc remote add -d store {url} {local}", repo)
    sh(f"git add -A && {GIT} commit -qm data", repo)

    def objects() -> list[Path]:  # (a temporary file of an unfinished copy starts with a dot)
        return [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]

    push = subprocess.Popen(
        [str(BIN / "dvc"), "push", "-j", "1"], cwd=repo, env=env_for(repo), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(objects()) < 10 and push.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(push.pid, signal.SIGKILL)
    push.wait()
    there = objects()
    assert 0 < len(there) < 201, f"the push was not stopped half-way ({len(there)} of 201 objects there)"
    for obj in there:  # files/md5/<2 hex>/<30 hex>[.dir]: each named by the md5 of its bytes
        assert hashlib.md5(obj.read_bytes()).hexdigest() == obj.parent.name + obj.name.removesuffix(".dir"), obj
    assert "files pushed" in sh("dvc push", repo)
    assert len(objects()) == 201
    other = tmp_path / "other"
    sh(f"git clone -q {repo} {other} && cd {other} {local} && dvc pull -q", tmp_path)
    assert all((other / "data" / f.name).read_bytes() == f.read_bytes() for f in (repo / "data").iterdir())
