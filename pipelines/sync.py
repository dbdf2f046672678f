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

Snakemake's records of an output (.snakemake/metadata) hold the params, command and inputs of the run
that made it. After a run with other params, `git checkout params.yaml dvc.lock && dvc checkout` puts
back the outputs dvc.lock holds, and DVC finds them current, but their records still describe the other
run: Snakemake would re-run them for their params. `align()` forgets the records of outputs DVC records as
current that disagree with what their rule declares now (records_of_other_runs).

    python -m pipelines.sync          # the same, by hand; then Snakemake's plan (snakemake -n) is
                                      # compared with DVC's (dvc_plan): exit 1 where they differ
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pipelines.dag import Stage, fill, load_table, parse_yaml


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


def reruns(items: list) -> bool:
    """Whether `dvc repro` re-runs a stage for these status entries: for any but outputs only missing from
    the cache (`dvc gc`), which it leaves as they are."""
    for item in items:
        if not isinstance(item, dict) or set(item) != {"changed outs"}:
            return True
        if any(v != "not in cache" for v in item["changed outs"].values()):
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


def per_output_files(base: Path) -> dict[str, Path]:
    """Output path -> its file under one of Snakemake's per-output folders (.snakemake/incomplete,
    .snakemake/metadata): Snakemake 9 names each by the output path in URL-safe base64, split into parts
    of which all but the last start with "@"."""
    found = {}
    for file in base.rglob("*") if base.is_dir() else []:
        if file.is_file() and file.name != "migration_underway":
            parts = file.relative_to(base).parts
            try:
                found[base64.urlsafe_b64decode("".join(p.removeprefix("@") for p in parts)).decode()] = file
            except (ValueError, UnicodeDecodeError):
                continue
    return found


def marked_incomplete(root: Path = Path(".")) -> set[str]:
    """The outputs Snakemake marked incomplete when their job started and never unmarked: its main process
    died before the job ended."""
    return set(per_output_files(root / ".snakemake" / "incomplete"))


def rule_sections(st: Stage, params: dict) -> str:
    """The params sections of a stage as its Snakemake rule declares them (params `sections`), so Snakemake
    records them and a change re-runs the stage."""
    return json.dumps({s: param(params, s) for s in st.params}, sort_keys=True)


def param(params: dict, key: str):
    """A params section, or one value of it by a dotted key (base.model) as DVC reads such a key."""
    value = params
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def declared(st: Stage, name: str, item: str | None, params: dict) -> tuple[set[str], list[str]]:
    """What Snakemake records of a stage instance's run that can differ from one run to the next: the
    rule's params (the command, the DVC stage name, the params sections; the Snakefile) and its inputs."""
    return {st.command(item), name, rule_sections(st, params)}, sorted(fill(d, item) for d in st.deps)


def records_of_other_runs(status: dict, root: Path = Path(".")) -> list[str]:
    """Outputs of stages DVC records as current whose Snakemake records describe another run: other params
    sections, another command or other inputs than the rule declares now (a run with other params, then
    `dvc checkout` of what dvc.lock holds). Snakemake would re-run them for their params or inputs, which
    DVC has just compared with dvc.lock and found current."""
    records = per_output_files(root / ".snakemake" / "metadata")
    if not records or not (root / "params.yaml").is_file():
        return []
    params = parse_yaml((root / "params.yaml").read_text()) or {}
    found = []
    for st in load_table(root / "pipelines/stages.yaml").values():
        for name, item in st.instances():
            if reruns(status.get(name, [])):
                continue
            want_params, want_input = declared(st, name, item, params)
            for out in (fill(o, item) for o in st.outputs()):
                if out in records and (root / out).exists():
                    try:
                        record = json.loads(records[out].read_text())
                        params_now = {ast.literal_eval(p) for p in record.get("params") or []}
                    except (OSError, ValueError, SyntaxError):
                        params_now = None  # unreadable: Snakemake could not use it either
                    if params_now != want_params or record.get("input") != want_input:
                        found.append(out)
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


def align(
    root: Path = Path("."), snakefile: str | Path = "Snakefile", status: dict | None = None
) -> tuple[list[str], list[str]]:
    """align_mtimes, and Snakemake's records of the outputs DVC finds modified forgotten (forget_records),
    as are its incomplete marks on outputs DVC records as current (finished_unrecorded) and its records of
    other runs on them (records_of_other_runs): returns (outputs whose times were set, outputs whose
    records were forgotten). status: `dvc status` as dvc_status reads it, asked here when not given."""
    status = dvc_status(root) if status is None else status
    if status is None:
        return [], []
    forget = modified_outputs(status, root) + finished_unrecorded(status, root)
    forget += [out for out in records_of_other_runs(status, root) if out not in forget]
    bumped = align_mtimes(root, status)
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


def snakemake_plan(root: Path = Path("."), snakefile: str | Path = "Snakefile") -> set[str]:
    """The rules `snakemake -n` would run, as it plans them now (not aligned again: PIPELINE_NO_SYNC)."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--cores", "1", "-n"]
    env = {**os.environ, "PIPELINE_NO_SYNC": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`snakemake -n` failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return set(re.findall(r"^\s*(?:local)?rule (\w+):", proc.stdout + proc.stderr, re.M)) - {"all"}


def dvc_plan(status: dict, root: Path = Path(".")) -> set[str]:
    """The stages (by rule name) `dvc repro` would run: those it re-runs for their `dvc status` entries,
    and every stage that reads what one of them writes, downstream."""
    instances = [
        (st.name, [fill(d, item) for d in st.deps], [fill(o, item) for o in st.outputs()], reruns(status.get(name, [])))
        for st in load_table(root / "pipelines/stages.yaml").values()
        for name, item in st.instances()
    ]
    planned = {i for i, (_, _, _, rerun) in enumerate(instances) if rerun}
    while True:
        written = [out for i in planned for out in instances[i][2]]
        follow = {
            i
            for i, (_, deps, _, _) in enumerate(instances)
            if i not in planned and any(d == o or d.startswith(o + "/") for d in deps for o in written)
        }
        if not follow:
            return {instances[i][0] for i in planned}
        planned |= follow


def plans_differ(status: dict, root: Path = Path("."), snakefile: str | Path = "Snakefile") -> str:
    """Where Snakemake's plan (`snakemake -n`, not aligned again) and DVC's (dvc_plan) differ, in words; ""
    when both would run the same stages."""
    snakemake, dvc = snakemake_plan(root, snakefile), dvc_plan(status, root)
    if snakemake == dvc:
        return ""
    return f"snakemake -n would run {sorted(snakemake) or 'nothing'}, dvc repro {sorted(dvc) or 'nothing'}"


if __name__ == "__main__":
    status = dvc_status(Path("."))
    if status is None:
        raise SystemExit(
            "not aligned: `dvc status` failed (a running `dvc repro` holds DVC's lock?); run it to see why"
        )
    done, forced = align(status=status)
    differ = plans_differ(status)
    print(("aligned: " if not differ else "times set: ") + (", ".join(done) if done else "nothing to do"))
    if forced:
        print("Snakemake's records forgotten (outputs modified since dvc.lock are re-made): " + ", ".join(forced))
    if differ:
        print(f"not aligned: {differ}", file=sys.stderr)
        raise SystemExit(1)
