"""Make Snakemake's modification-time view agree with DVC's content-hash view of what is current.

`dvc checkout` (and `dvc repro`, `dvc pull`) write outputs with fresh modification times: a restored
upstream folder is then newer than the downstream outputs made from it, and Snakemake would re-run
stages whose inputs did not change. DVC knows better: it compares content hashes with dvc.lock.
The Snakefile calls `align()` when it loads; for each stage that `dvc status` reports as
current, in dependency order, outputs older than an input get that input's time (plus 1 ms), so
Snakemake sees them as up to date too. Stages DVC would re-run (code, params, inputs or outputs differ
from dvc.lock) get outputs older than their newest input, so Snakemake re-runs them even when it has
no records of its own that would show the change (after `dvc repro` or `dvc checkout`, which leave
none): the two tools agree through DVC's content hashes, never through Snakemake's metadata alone.

Times alone cannot tell Snakemake about an output changed in place (a hand edit, a partial restore):
for an output older than an input it compares the input's checksum with the one it recorded when it
made the output, and a stage such as prepare_data reads only code, unchanged. `align()` therefore also
finds the outputs DVC reports modified and has Snakemake forget its records of them (`snakemake
--cleanup-metadata`): with their times aged below their inputs', Snakemake re-makes them and what
follows, as `dvc repro` would.

A Snakemake killed while a job ran leaves that job's outputs marked incomplete; a stage that still
finished and committed (killed between its end and Snakemake's bookkeeping) would be re-made for that
mark alone. `align()` also forgets the marks on outputs DVC records as current.

    python -m pipelines.sync          # the same, by hand
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from pipelines.dag import fill, load_table


def snakemake_mtime(path: Path) -> float:
    """The time Snakemake compares: a folder's .snakemake_timestamp if it has one, else its own mtime."""
    stamp = path / ".snakemake_timestamp"
    return (stamp if path.is_dir() and stamp.exists() else path).stat().st_mtime


def set_mtime(path: Path, t: float) -> None:
    os.utime(path, (t, t))
    stamp = path / ".snakemake_timestamp"
    if path.is_dir() and stamp.exists():
        os.utime(stamp, (t, t))


def dvc_status(root: Path) -> dict | None:
    """`dvc status --json`: stage name -> what changed; None when DVC cannot tell (no repository, a
    lock held by a running `dvc repro`, a damaged dvc.lock)."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    try:
        status = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        return None
    return {name.rsplit(":", 1)[-1]: items for name, items in status.items()}


def is_stale(items: list) -> bool:
    """Whether DVC would re-run a stage for these status entries: its command, a dependency (a file or
    params) or an output's content changed. Not for an output only missing from the cache (`dvc gc`), nor
    for dependencies DVC merely has no record of ("new": no dvc.lock entry to compare with)."""
    for item in items:
        if item == "changed command":
            return True
        if isinstance(item, dict):
            if any(v != "new" for v in (item.get("changed deps") or {}).values()):
                return True
            if "modified" in (item.get("changed outs") or {}).values():
                return True
    return False


def modified_outputs(status: dict, root: Path = Path(".")) -> list[str]:
    """The outputs, as the Snakefile names them, of every stage whose outputs DVC finds modified."""
    table = load_table(root / "pipelines/stages.yaml")
    found = []
    for st in table.values():
        for name, item in st.instances():
            changed = [i.get("changed outs") or {} for i in status.get(name, []) if isinstance(i, dict)]
            if any("modified" in c.values() for c in changed):
                found += [fill(o, item) for o in st.outputs()]
    return found


def forget_records(paths: list[str], snakefile: str | Path = "Snakefile", root: Path = Path(".")) -> None:
    """Snakemake's records (metadata) of `paths` removed, by Snakemake itself (the Snakefile it loads for
    that takes no pipeline lock, and skips this alignment: PIPELINE_NO_SYNC)."""
    env = {**os.environ, "PIPELINE_NO_SYNC": "1"}
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--cores", "1", "--cleanup-metadata"]
    # (a path without a record is reported and left alone: there is nothing to forget)
    subprocess.run([*cmd, *paths], cwd=root, env=env, capture_output=True, text=True)


def marked_incomplete(root: Path = Path(".")) -> set[str]:
    """The outputs Snakemake marked incomplete when their job started and never unmarked: its main process
    died before the job ended (Snakemake 9 keeps one file per output under .snakemake/incomplete, named by
    the output path in URL-safe base64, split into parts of which all but the last start with "@")."""
    base = root / ".snakemake" / "incomplete"
    found = set()
    for marker in base.rglob("*") if base.is_dir() else []:
        if marker.is_file() and marker.name != "migration_underway":
            parts = marker.relative_to(base).parts
            try:
                found.add(base64.urlsafe_b64decode("".join(p.removeprefix("@") for p in parts)).decode())
            except (ValueError, UnicodeDecodeError):
                continue
    return found


def finished_unrecorded(status: dict, root: Path = Path(".")) -> list[str]:
    """Outputs Snakemake marks incomplete that DVC records as current: the stage finished and committed
    after its Snakemake died (a kill between the stage's end and Snakemake's bookkeeping). Re-running it
    would redo work that dvc.lock already holds."""
    marked = marked_incomplete(root)
    if not marked:
        return []
    table = load_table(root / "pipelines/stages.yaml")
    return [
        out
        for st in table.values()
        for name, item in st.instances()
        if name not in status
        for out in (fill(o, item) for o in st.outputs())
        if out in marked and (root / out).exists()
    ]


def align(root: Path = Path("."), snakefile: str | Path = "Snakefile") -> tuple[list[str], list[str]]:
    """align_mtimes, and Snakemake's records of the outputs DVC finds modified forgotten (forget_records),
    as are its incomplete marks on outputs DVC records as current (finished_unrecorded): returns (outputs
    whose times were set, outputs whose records were forgotten)."""
    status = dvc_status(root)
    if status is None:
        return [], []
    bumped, forget = align_mtimes(root, status), modified_outputs(status, root) + finished_unrecorded(status, root)
    if forget:
        forget_records(forget, snakefile, root)
    return bumped, forget


def align_mtimes(root: Path = Path("."), status: dict | None = None) -> list[str]:
    """Age the outputs of DVC-changed stages below their inputs, and bump outputs of DVC-current stages
    that are older than their inputs; returns the outputs whose times were set."""
    status = dvc_status(root) if status is None else status
    if status is None:
        return []
    changed = set(status)
    stale = {name for name, items in status.items() if is_stale(items)}
    # (DVC stage name, its input paths, its output paths) for every stage instance of the table
    instances = [
        (name, [root / fill(d, item) for d in st.deps], [root / fill(o, item) for o in st.outputs()])
        for st in load_table(root / "pipelines/stages.yaml").values()
        for name, item in st.instances()
    ]
    bumped = []
    for name, deps, outs in instances:
        if name in stale and deps and all(p.exists() for p in deps + outs):
            oldest = max(snakemake_mtime(p) for p in deps) - 1.0
            for out in outs:
                if snakemake_mtime(out) > oldest:
                    set_mtime(out, oldest)
                    bumped.append(str(out.relative_to(root)))
    # Repeat until nothing moves, so a bump upstream reaches every stage below it.
    for _ in range(len(instances)):
        moved = False
        for name, deps, outs in instances:
            if name in changed or not deps or not all(p.exists() for p in deps + outs):
                continue
            newest_input = max(snakemake_mtime(p) for p in deps)
            for out in outs:
                if snakemake_mtime(out) < newest_input:
                    set_mtime(out, newest_input + 0.001)
                    bumped.append(str(out.relative_to(root)))
                    moved = True
        if not moved:
            break
    return bumped


if __name__ == "__main__":
    done, forced = align()
    print("aligned: " + (", ".join(done) if done else "nothing to do"))
    if forced:
        print("modified since dvc.lock (re-made by the next run): " + ", ".join(forced))
