"""Check the chain of records behind a pipeline run, link by link, in the repository it ran in.

    python -m pipelines.verify                      every link of this run
    python -m pipelines.verify --rehash             the outs hashed from their bytes, not DVC's records
    python -m pipelines.verify --against PATH       also compare each out with another run's: PATH is a
                                                    dvc.lock, or a folder holding one (and its outs), or
                                                    a run's crate (pipelines.crate: also its params, code
                                                    and environment against this checkout's)

The links, from what a reader sees back to what made it:
  report    each row of reports/results.json equals the figure it came from (a stage's results.json
            row, an eval_perplexity figures.json perplexity) and each stage's figures equal its file
  outs      each out of dvc.lock is on disk with the md5 dvc.lock records. `dvc status` reuses the
            hashes it recorded for files whose size and time did not change, so a file changed in
            place without either, or a damaged object of DVC's cache checked out (`dvc pull` and
            `dvc checkout` trust the cache), passes it; --rehash hashes every out's bytes instead
            and names each file that differs from the listing dvc.lock's md5 stands for
  causes    each stage's code, params and packages (its deps in dvc.lock) are those of this checkout
  registry  each model an out of dvc.lock publishes (a `model/` folder: `published`) has a version
            registered from that out as dvc.lock records it (output_dvc_md5), from these params
            (params_sha256) and this code (code_sha256); the models whose report rows all pass have the
            alias `reproduced` on one of those (on another out's version, where this out's rows do not all
            pass, it is a note). Versions registered from other outs (an experiment's) are passed over
  checkpoints  each checkpoint left in checkpoints/ matches its manifest, and was written by this code
  environment  the packages installed here are the versions of the package files dvc.lock's stages
            depend on (pipelines/packages/<family>.txt); a difference is a note naming them, as the stages
            themselves refuse to run on other versions (stages.common.environment). And each out's
            meta.json records the environment it was made in (requirements.lock's sha256, the installed
            versions of its family's packages, the container image): one made in another is a note
            naming what differs from here
Only the stages of the DAG that params.yaml makes now are checked: dvc.lock keeps the records of stages
that left it (pretrain while base.model names another model), each named in a note.
One line per link: `ok`, or `BROKEN` with what is broken, where, and the command that mends it (run as
printed up to its first " (", which opens what it does or an alternative); the exit code is 1 when a link
is broken. tests/test_e2e_verify.py breaks each link and runs the mend printed for it. `--against`
prints per out `identical` (the same md5), `within the recorded tolerance` (it differs, and every
reproduced result in it, a results.json row, is within its tolerance of the other run's), or `differs`;
and `measured` for the files under measured/ (timings and memory, which differ from run to run by
nature: not compared); an out that is not identical is followed by `environment differs` where the two
runs recorded different environments for it (the packages and image that differ, here and there).
The other run's results are read from its folder only (its outs beside its dvc.lock); a lock file by
another name (published.lock) comes without them and is compared by its records only, which its first
line says: an out whose md5 differs is then `differs`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile
from pathlib import Path

import yaml

from pipelines.crate import METADATA, is_crate
from pipelines.dag import MEASURED_DIR, fill, load_table, parse_yaml
from pipelines.sync import dvc_status
from stages.common import contract

# A report row, or its figures, differs from the out it was read from: both outs restored as dvc.lock records
# them. `dvc repro report` would not do: an edit that keeps the file's size and time passes `dvc status`,
# so DVC finds nothing changed; --relink rewrites the files from DVC's cache whatever its records say.
RESTORE_REPORT = "dvc checkout --relink"
AS_RECORDED = "both as dvc.lock records them; or dvc repro -f -s report reads the figures again"
# The measured files are not in DVC's cache: the report, forced to run, reads them again.
REREAD_MEASURED = "dvc repro -f -s report"


class Report:
    def __init__(self):
        self.broken = 0

    def ok(self, link: str, what: str) -> None:
        print(f"ok      {link:<11} {what}")

    def bad(self, link: str, what: str, mend: str) -> None:
        self.broken += 1
        print(f"BROKEN  {link:<11} {what}; mend: {mend}")

    def note(self, link: str, what: str) -> None:
        print(f"note    {link:<11} {what}")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def lock_outs(lock: dict) -> dict[str, tuple[str, str]]:
    """{out path: (DVC stage, md5)} of a dvc.lock."""
    return {
        out["path"]: (stage, out.get("md5", ""))
        for stage, entry in (lock.get("stages") or {}).items()
        for out in entry.get("outs", ())
    }


def in_the_dag(root: Path, lock: dict, r: Report) -> dict:
    """dvc.lock with the records of the stages in the DAG that params.yaml makes now; a note names each other
    one (a stage that left the DAG keeps its record, which a return to it reuses)."""
    try:
        table = load_table(root / "pipelines/stages.yaml")
    except (OSError, ValueError, yaml.YAMLError):  # (a table that does not load: `dvc status` names what breaks)
        return lock
    current = {name for st in table.values() for name, _ in st.instances()}
    stages = lock.get("stages") or {}
    for name in sorted(set(stages) - current):
        r.note("causes", f"stage {name}: in dvc.lock but not in the DAG of this params.yaml (base.model): not checked")
    return {**lock, "stages": {name: entry for name, entry in stages.items() if name in current}}


def check_report(root: Path, r: Report) -> None:
    doc = read_json(root / "reports/results.json")
    if doc is None:
        r.bad("report", "reports/results.json is missing or unreadable", f"{RESTORE_REPORT} reports ({AS_RECORDED})")
        return
    for label, shown in doc.get("stage_metrics", {}).items():
        folder = root / "data" / label
        source = read_json(folder / "figures.json") or read_json(folder / "metrics.json")
        if source != shown:
            what = f"the figures of {label} in reports/results.json differ from data/{label}'s"
            r.bad("report", what, f"{RESTORE_REPORT} reports data/{label} ({AS_RECORDED})")
    rows = len(doc.get("rows", ()))
    for row in doc.get("rows", ()):
        source_name = f"data/{row['stage']}/results.json"
        mend = f"{RESTORE_REPORT} reports data/{row['stage']} ({AS_RECORDED})"
        check_row(row, read_json(root / source_name) or [], "", source_name, mend, r)
    for row in (doc.get("regression") or {}).get("rows", ()):
        rows += 1
        model, ctx = row["result"].removeprefix("token perplexity, ").rsplit(" at ", 1)
        ctx = int(ctx.split()[0])
        figures = read_json(root / "data" / row["stage"] / "figures.json") or {}
        values = {int(v["context"]): v["perplexity"] for v in figures.get("models", {}).get(model, {}).values()}
        if values.get(ctx) != row["ours"]:
            r.bad(
                "report",
                f"row '{row['result']}' shows {row['ours']}, data/{row['stage']}/figures.json has {values.get(ctx)}",
                f"{RESTORE_REPORT} reports data/{row['stage']} ({AS_RECORDED})",
            )
    if doc.get("measured"):
        rows += check_measured_rows(root, doc["measured"], r)
    if not r.broken:
        r.ok("report", f"reports/results.json: {rows} rows and {len(doc.get('stage_metrics', {}))} stages' figures")


def check_measured_rows(root: Path, name: str, r: Report) -> int:
    """The rows of the report's measured file (measured/report.json) against the stages' measured files."""
    doc = read_json(root / name)
    mend = f"{REREAD_MEASURED} (the report reads the measured files again)"
    if doc is None:
        r.bad("report", f"{name} is missing or unreadable", mend)
        return 0
    for row in doc.get("rows", ()):
        source_name = f"{MEASURED_DIR}/{row['stage']}.json"
        source = (read_json(root / source_name) or {}).get("rows", ())
        check_row(row, source, f" of {name}", source_name, mend, r)
    return len(doc.get("rows", ()))


def check_row(row: dict, source: list, where: str, source_name: str, mend: str, r: Report) -> None:
    """A report row (`where`: in which file, when not results.json) against the rows it was read from."""
    found = {x["result"]: x for x in source}
    if row["result"] not in found or found[row["result"]]["ours"] != row["ours"]:
        got = found.get(row["result"], {}).get("ours", "no such row")
        r.bad("report", f"row '{row['result']}'{where} shows {row['ours']}, {source_name} has {got}", mend)


def check_status(root: Path, lock: dict, r: Report) -> None:
    """The outs and the causes, from `dvc status` (DVC's own comparison of the workspace with dvc.lock)."""
    status = dvc_status(root)
    if status is None:
        error, mend = status_failure(root)
        r.bad("outs", f"dvc status fails: {error}", mend)
        return
    for path, (stage, md5) in sorted(lock_outs(lock).items()):
        changed = {}
        for item in status.get(stage, []):
            if isinstance(item, dict):
                changed |= item.get("changed outs") or {}
        if path in changed:
            # (what a stage measured is not in DVC's cache but committed to git beside dvc.lock)
            # (--force: DVC does not replace a changed file without it)
            restore = "git checkout" if path.startswith(f"{MEASURED_DIR}/") else "dvc checkout --force"
            again = "measures" if path.startswith(f"{MEASURED_DIR}/") else "makes"
            r.bad(
                "outs",
                f"{path} is {changed[path]} against dvc.lock (md5 {md5})",
                f"{restore} {path} (restores the recorded out; or dvc repro {stage} {again} it again)",
            )
        else:
            r.ok("outs", f"{path} {md5}")
    for stage in sorted(lock.get("stages") or {}):
        causes = []
        for item in status.get(stage, []):
            if item == "changed command":
                causes.append("its command")
            elif isinstance(item, dict):
                for dep, how in (item.get("changed deps") or {}).items():
                    causes.append(f"{dep} ({how})" if isinstance(how, str) else f"{dep} {json.dumps(how)}")
        if causes:
            r.bad(
                "causes",
                f"stage {stage}: changed since dvc.lock: {', '.join(causes)}",
                "dvc repro (or snakemake) re-runs it and what follows",
            )
        else:
            r.ok("causes", f"stage {stage}: code, params, packages and inputs as in dvc.lock")


def status_failure(root: Path) -> tuple[str, str]:
    """Why `dvc status` fails in `root` (the first line of its error), and the mend for that cause."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, capture_output=True, text=True)
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    error = lines[0].removeprefix("ERROR: ") if lines else f"exit code {proc.returncode}"
    if "dvc.yaml" in error:
        return error, "python -m pipelines.dag write (dvc.yaml written again from pipelines/stages.yaml)"
    if "dvc.lock" in error:
        return error, "git checkout dvc.lock (its committed record)"
    if "lock" in error.lower():
        return error, "dvc status (again, once the DVC command that holds its lock has ended)"
    return error, "dvc status (its error names what to mend)"


def stage_module(stage: str, root: Path) -> str:
    """The module a stage instance runs (`pretrain` for a sweep's point `sweep_lr@0.001`)."""
    name = stage.partition("@")[0]
    table = load_table(root / "pipelines/stages.yaml")
    return table[name].runs() if name in table else name


def current_section(stage: str, root: Path) -> dict:
    """The params section a stage instance reads in `root`, its item's overrides applied."""
    from stages.common import config

    name, _, item = stage.partition("@")
    table = load_table(root / "pipelines/stages.yaml")
    st = table[name]
    args = st.command(item or None).split()[4:]  # (a sweep's point: its values at the end)
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    cls = importlib.import_module(f"stages.{st.runs()}").Config
    return config.as_dict(config.load(cls, st.runs(), root / "params.yaml", overrides))


def differing_outs(root: Path, lock: dict) -> dict[str, list[tuple[str, str | None, Path | None]]]:
    """{out path: [(file, the md5 dvc.lock records for it or None, its damaged object in DVC's cache or
    None)]} of each DVC-cached out of dvc.lock whose bytes now differ from the record (a missing out: one
    entry naming the out itself, with no md5). Each out is hashed as DVC hashes it (a folder: the md5 of
    its file listing), without DVC's state database; a folder that differs is named down to its files,
    from the listing in DVC's cache."""
    from dvc.repo import Repo
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB

    found: dict[str, list[tuple[str, str | None, Path | None]]] = {}
    with Repo(str(root)) as repo:
        cache = repo.cache.local
        # the cache's folder without its state database (the recorded hashes must not be reused)
        stateless = HashFileDB(cache.fs, cache.path, read_only=True, hash_name=cache.hash_name)
        for path, (_, md5) in sorted(lock_outs(lock).items()):
            if path.startswith(f"{MEASURED_DIR}/"):
                continue  # (not cached: git holds it, and what it measured differs from run to run)
            if not (root / path).exists():
                found[path] = [(path, None, None)]
                continue
            _, _, obj = build(stateless, str(root / path), repo.fs, "md5", ignore=repo.dvcignore, dry_run=True)
            if obj.hash_info.value == md5:
                continue
            recorded = {"": md5}  # (file path below the out: md5 recorded)
            if md5.endswith(".dir"):
                listing = read_json(Path(cache.oid_to_path(md5))) or []
                recorded = {entry["relpath"]: entry["md5"] for entry in listing}
                now = {"/".join(key): hi.value for key, _, hi in obj}
            else:
                now = {"": obj.hash_info.value}
            for rel in sorted(set(now) | set(recorded)):
                if now.get(rel) == recorded.get(rel):
                    continue
                want = recorded.get(rel)
                obj_path = Path(cache.oid_to_path(want)) if want is not None else None
                damaged = obj_path if obj_path is not None and file_md5(obj_path) != want else None
                found.setdefault(path, []).append((f"{path}/{rel}" if rel else path, want, damaged))
    return found


def rehash_outs(root: Path, lock: dict, r: Report) -> None:
    """Each DVC-cached out of dvc.lock hashed from its bytes now against dvc.lock (differing_outs), each
    file that differs named with its mend."""
    outs = lock_outs(lock)
    found = differing_outs(root, lock)
    for path, (_, md5) in sorted(outs.items()):
        if path.startswith(f"{MEASURED_DIR}/"):
            continue
        if path not in found:
            r.ok("outs", f"{path} {md5} (rehashed)")
            continue
        stage = outs[path][0]
        for name, want, damaged in found[path]:
            if want is None and name == path:
                r.bad("outs", f"{path} is missing", f"dvc checkout {path} (or dvc pull {path})")
            elif want is None:
                r.bad("outs", f"{name} is not in the listing dvc.lock records", f"dvc checkout --relink {path}")
            elif damaged is not None:
                shown = damaged.relative_to(root) if damaged.is_relative_to(root) else damaged
                what = f"differs from dvc.lock (md5 {want}), and so does DVC's cache object {shown}"
                r.bad("outs", f"{name} {what}", f"rm -f {name} {shown} && dvc pull {path} (or dvc repro -f -s {stage})")
            else:
                what = f"differs from dvc.lock (md5 {want}); DVC's cache holds the recorded bytes"
                r.bad("outs", f"{name} {what}", f"dvc checkout --relink {path} (or dvc repro -f -s {stage})")


def file_md5(path: Path) -> str | None:
    """md5 of a file's bytes (None when it is missing)."""
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "md5").hexdigest()
    except OSError:
        return None


def published(stage: str, out: Path) -> list[str]:
    """The registered names of the models a stage instance (`<stage>` or `<stage>@<item>`, as dvc.lock names
    it) published in its out: a Hugging Face folder `model/` is the stage's model (`pretrain`,
    `finetune_qlora-nf4`), each `model/<variant>/` one per variant (`extend_context-yarn`), as each stage
    registers them (stages.common.stage.register_models, named by registry.model_name). The base stage's
    copy of a hub model or folder is none: its record is the source and commit in its meta.json."""
    from stages.common import registry

    section, _, item = stage.partition("@")
    if section == "base":  # a copy of another's model, not registered: data/base/meta.json names its source
        return []
    folder, name = out / "model", registry.model_name(section, item or None)
    if (folder / "config.json").is_file():
        return [name]
    # (variants: `extend_context-yarn`, or a sweep point's `sweep_context-2.0-yarn`)
    return sorted(registry.model_name(name, p.parent.name) for p in folder.glob("*/config.json"))


def published_models(root: Path, lock: dict) -> dict[str, tuple[str, str, str]]:
    """{registered name: (out path, DVC stage, the md5 dvc.lock records)} of each model an out of dvc.lock
    publishes: the versions the registry must hold."""
    found = {}
    for path, (stage, md5) in sorted(lock_outs(lock).items()):
        if not path.startswith(f"{MEASURED_DIR}/"):
            found |= {name: (path, stage, md5) for name in published(stage, root / path)}
    return found


def reproduced_models(root: Path) -> set[str]:
    """The registered models whose rows in reports/results.json all pass: the report gives each the alias
    `reproduced` (stages.report.mark_reproduced)."""
    from stages import report

    doc = read_json(root / "reports/results.json")
    try:
        subjects = report.row_subjects(doc)
    except (KeyError, TypeError, ValueError):  # (the report link names an unreadable report)
        return set()
    return {name for name, (_, passes) in subjects.items() if passes and all(p is True for p in passes)}


def check_registry(root: Path, lock: dict, r: Report) -> None:
    """Each model the outs publish has a version registered from its out as dvc.lock records it, from these
    params and this code; the ones the report passed carry the alias on such a version. Versions registered
    from elsewhere (an experiment, another folder) are passed over: they neither stand for nor hide ours."""
    import mlflow

    from stages.common import ckpt, registry
    from stages.common.tracking import store

    expected = published_models(root, lock)
    uri = store.tracking_uri(root)
    if uri.startswith("sqlite:") and not (root / "mlflow.db").is_file():
        r.note("registry", f"no MLflow store at {uri} (PIPELINE_TRACKING=off?): {len(expected)} published model(s) "
               "not checked")  # fmt: skip
        return
    client = mlflow.MlflowClient(uri)
    models = {m.name: m for m in client.search_registered_models(max_results=1000)}
    if expected and not set(expected) & set(models):
        # (a clone: its outs came with `make pull`, the MLflow store that registered them did not)
        r.note("registry", f"the MLflow store at {uri} holds none of the {len(expected)} published model(s): not "
               "the store whose runs made these outs (MLflow runs do not travel with make pull); set "
               "MLFLOW_TRACKING_URI to that store to check them")  # fmt: skip
        return
    aliased = reproduced_models(root)
    for name, (output, stage, md5) in sorted(expected.items()):
        where = f"models:/{name} ({output}, stage {stage})"
        rerun = f"dvc repro -f -s {stage}" + (" && dvc repro -f -s report" if name in aliased else "")
        rerun += " (the stage registers a version from the out it makes again" + (
            ", the report sets the alias)" if name in aliased else ")"
        )
        versions = client.search_model_versions(f"name = '{name}'") if name in models else []
        ours = [v for v in versions if v.tags.get("output_dvc_md5") == md5]
        if not ours:
            if name not in models:
                what = "not in the registry (its registered model was deleted, or never registered)"
            elif not versions:
                what = "has no versions (each was deleted)"
            else:
                newest = max(versions, key=lambda v: int(v.version))
                what = (
                    f"no version registered from the out dvc.lock records (md5 {md5}); "
                    f"the newest, v{newest.version}, says {newest.tags.get('output_dvc_md5')}"
                )
            r.bad("registry", f"{where}: {what}", rerun)
            continue
        version = max(ours, key=lambda v: int(v.version))
        try:
            params = registry.params_sha256(current_section(stage, root))
        except Exception as e:  # noqa: BLE001 - the stage's code as it is now: anything may break its import
            module = f"stages.{stage.split('@')[0]}"
            problem = f"{module} does not import now ({type(e).__name__}: {e}), so its params cannot be read"
            fix = f"fix the code it imports (python -c 'import {module}' shows where it fails)"
            r.bad("registry", f"{where} v{version.version}: {problem}", fix)
            continue
        code = ckpt.writer_record(f"stages.{stage_module(stage, root)}")["code_sha256"]
        problems = []
        if version.tags.get("params_sha256") != params:
            problems.append(f"params_sha256 {version.tags.get('params_sha256', '')[:12]} is not this params.yaml's")
        if version.tags.get("code_sha256") != code:
            problems.append(f"code_sha256 {version.tags.get('code_sha256', 'unrecorded')[:12]} is not this code's")
        mend = rerun if problems else "dvc repro -f -s report (the report sets the alias on a version of this out)"
        alias = models[name].aliases.get(registry.ALIAS) if isinstance(models[name].aliases, dict) else None
        elsewhere = alias is not None and str(alias) not in {str(v.version) for v in ours}
        if elsewhere and name in aliased:
            problems.append(f"alias {registry.ALIAS} names v{alias}, not a version of this out")
        elif alias is None and name in aliased:
            problems.append(f"no version has the alias {registry.ALIAS}, which the report's passing rows give it")
        if problems:
            r.bad("registry", f"{where} v{version.version}: {'; '.join(problems)}", mend)
        else:
            r.ok("registry", f"{where} v{version.version}: out, params and code as recorded")
        if elsewhere and name not in aliased:  # (an earlier out passed; this one has no passing rows to move it)
            r.note("registry", f"models:/{name}@{registry.ALIAS} is v{alias}, of another out: the report's rows "
                   "about this out do not all pass (or there are none), so the alias stays where it was")  # fmt: skip
    for name in sorted(set(models) - set(expected)):
        r.note("registry", f"models:/{name}: no out of this dvc.lock publishes it (an experiment's, or another run's)")


def check_checkpoints(root: Path, r: Report) -> None:
    from stages.common import ckpt

    base = root / "checkpoints"
    steps = sorted(base.glob("*/*/step-*")) if base.is_dir() else []
    for path in steps:
        stage = path.parent.parent.name
        problem = ckpt.checkpoint_problem(path)
        if problem:
            r.bad("checkpoints", f"{path.relative_to(root)}: {problem}", f"rm -r {path.relative_to(root)}")
            continue
        change = ckpt.writer_change(ckpt.read_writer(path), ckpt.writer_record(f"stages.{stage}"))
        if change:
            r.note("checkpoints", f"{path.relative_to(root)}: written by other code ({change}); a re-run refuses it "
                   f"unless PIPELINE_RESUME=fresh or across-code")  # fmt: skip
        elif across := ckpt.read_writer(path).get(ckpt.ACROSS_CODE):
            r.note("checkpoints", f"{path.relative_to(root)}: intact, written by this code in a run that resumed "
                   f"across a change ({across}); a run resuming it is tagged so")  # fmt: skip
        else:
            r.ok("checkpoints", f"{path.relative_to(root)}: intact, written by this code")
    if not steps:
        r.ok("checkpoints", "none left (every run finished)")


def check_environment(root: Path, lock: dict, r: Report) -> None:
    """The packages installed here against each family's package file (pipelines/packages/<family>.txt)
    that dvc.lock's stages depend on. A difference is a note, not a broken link: every stage refuses to run
    on packages other than the recorded ones (stages.common.environment), so dvc.lock's record of what
    made its outs holds; the note says that a stage re-run here would be refused, and names the packages.
    (This interpreter is not always where the stages ran: a family's container has its own.)"""
    import fnmatch

    from stages.common import environment

    users: dict[str, list[str]] = {}
    for stage, entry in sorted((lock.get("stages") or {}).items()):
        for dep in entry.get("deps") or ():
            if fnmatch.fnmatch(str(dep.get("path", "")), environment.PACKAGES.format(family="*")):
                users.setdefault(dep["path"], []).append(stage)
    for path, stages in sorted(users.items()):
        try:
            pins = environment.recorded(root / path)
        except OSError:
            continue  # (a changed dep of those stages: the causes link names it)
        found = environment.differences(pins, environment.installed())
        whose = f"{path} (recorded for {len(stages)} stage(s) of dvc.lock: {', '.join(stages)})"
        if found:
            family = Path(path).stem
            r.note(
                "environment",
                f"the packages installed here differ from {whose}: {environment.describe(found)}; a re-run of "
                f"those stages here is refused: `make venv` installs the recorded versions (in containers/"
                f"{family}.sif the stages run on the image's own)",
            )
        else:
            r.ok("environment", f"the packages installed here are those of {whose}")
    check_recorded_environments(root, lock, r)


def recorded_environment(folder: Path) -> dict | None:
    """The environment an out was made in, as its meta.json records it (stages.common.environment.run_record);
    None for an out without one (no meta.json, or made before outputs recorded it)."""
    meta = read_json(folder / "meta.json")
    record = meta.get("environment") if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and "lock_sha256" in record else None


def check_recorded_environments(root: Path, lock: dict, r: Report) -> None:
    """Each out's recorded environment (its meta.json) against the one here: this checkout's requirements.lock,
    the installed versions of its family's packages, the container this runs in. A difference is a note naming
    it: the out is what dvc.lock records, made in another environment (another lock, image or machine)."""
    from stages.common import environment

    now: dict[str, dict] = {}
    table = load_table(root / "pipelines" / "stages.yaml", root / "params.yaml")
    for path, (stage, _) in sorted(lock_outs(lock).items()):
        if path.startswith(f"{MEASURED_DIR}/") or not (root / path / "meta.json").is_file():
            continue
        record = recorded_environment(root / path)
        if record is None:
            r.note("environment", f"stage {stage}: {path}/meta.json records no environment (made before outputs "
                   "recorded theirs): not compared")  # fmt: skip
            continue
        section = stage.partition("@")[0]
        section = table[section].runs() if section in table else section  # (a sweep's point: the swept stage's)
        if section not in now:
            now[section] = environment.run_record(section, root)
        changes = environment.record_changes(record, now[section])
        if changes:
            r.note("environment", f"stage {stage}: {path} was made in another environment than this one: "
                   f"{environment.describe_changes(changes)}")  # fmt: skip
        else:
            r.ok("environment", f"stage {stage}: {path} was made in this environment ({environment_label(record)})")


def environment_label(record: dict) -> str:
    """`requirements.lock 1a2b3c4d5e6f, 194 lm packages, image apptainer lm.sif sha256:...` of a run_record."""
    from stages.common import environment

    parts = [f"{environment.LOCK} {(record.get('lock_sha256') or 'none')[:12]}"]
    if record.get("container_family"):
        parts.append(f"{len(record.get('packages') or {})} {record['container_family']} packages")
    parts.append(f"image {environment.image_label(record.get('image')) or 'none'}")
    return ", ".join(parts)


def against_source(root: Path, against: Path) -> tuple[Path, Path | None]:
    """The other run's dvc.lock, and the folder that holds its outs: a run's folder (`against` itself, or the
    folder of a file named dvc.lock). Any other lock file comes without its outs (None: compared by its records
    only), as does one in this repository, whose outs there are this run's. This run's own dvc.lock or
    folder is no other run: ValueError, with what to give instead."""
    if against.is_dir():
        lock, folder = against / "dvc.lock", against
    else:
        lock, folder = against, against.parent if against.name == "dvc.lock" else None
    if lock.resolve() == (root / "dvc.lock").resolve():
        raise ValueError(
            f"--against {against}: that is this run's own dvc.lock; give another run's folder (its dvc.lock "
            "and outs) or a copy of its dvc.lock"
        )
    if folder is not None and folder.resolve() == root.resolve():
        folder = None
    return lock, folder


def compare(root: Path, lock: dict, against: Path) -> int:
    """Per out of this run: identical, within the recorded tolerance, or differs from the other run's. The
    tolerance is read from the other run's outs, never from this workspace's: a lock file without its outs
    is compared by its records (md5) only, and says so."""
    other_lock_file, other_root = against_source(root, against)
    other_lock = parse_yaml(other_lock_file.read_text())
    if other_root is None:
        print(
            f"by records only: {against} comes without its run's outs, so an out whose md5 differs is `differs`, "
            "its results not compared within their tolerance (--against the other run's folder compares them)"
        )
    theirs = lock_outs(other_lock)
    counts = {"identical": 0, "within the recorded tolerance": 0, "differs": 0, "measured": 0}
    for path, (_, md5) in sorted(lock_outs(lock).items()):
        if path not in theirs:
            print(f"{'absent':<29} {path} (not in {against})")
            continue
        where = ""
        if path.startswith(f"{MEASURED_DIR}/"):
            verdict = "measured"  # timings and memory of each run: not expected to agree
        elif theirs[path][1] == md5:
            verdict = "identical"
        elif other_root is not None and within_tolerance(root / path, other_root / path):
            verdict = "within the recorded tolerance"
        else:
            verdict = "differs"
            if other_root is not None and not (other_root / path).exists():
                where = f" (not in {other_root})"
        counts[verdict] += 1
        print(f"{verdict:<29} {path}{where}")
        if verdict != "identical" and other_root is not None:
            compare_environments(root / path, other_root / path, path)
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 0 if counts["differs"] == 0 else 1


def compare_crate(root: Path, lock: dict, crate: Path) -> int:
    """--against a run's crate: its outs as compare() compares a run's folder (the crate's dvc.lock; its outs
    where it holds them, else each stage's results rebuilt from the report's rows), then its params, code
    and environment against this checkout's (pipelines.crate.differences)."""
    from pipelines import crate as crates

    with tempfile.TemporaryDirectory() as tmp:
        code = compare(root, lock, crates.unpack(crate, Path(tmp)))
    return code | crates.differences(root, crate)


def compare_environments(ours: Path, theirs: Path, path: str) -> None:
    """A line naming what differs between the environments two runs recorded for the same out (their
    meta.json): the lock, the packages, the image. Nothing when they agree or either has no record."""
    from stages.common import environment

    a, b = recorded_environment(ours), recorded_environment(theirs)
    changes = environment.record_changes(a, b) if a is not None and b is not None else []
    if changes:
        print(f"{'environment differs':<29} {path}: {environment.describe_changes(changes, 'here', 'there')}")


def within_tolerance(ours: Path, theirs: Path) -> bool:
    """Both outs hold the same reproduced results (results.json rows), each within its tolerance."""
    a, b = read_json(ours / "results.json"), read_json(theirs / "results.json")
    if not isinstance(a, list) or not isinstance(b, list) or not a or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.get("result") != y.get("result"):
            return False
        try:
            if abs(float(x["ours"]) - float(y["ours"])) > float(x["tolerance"]):
                return False
        except (KeyError, TypeError, ValueError):
            return False
    return True


def damaged_input(label: str, root: Path) -> str | None:
    """Under `dvc repro` or Snakemake: the first input file of stage `label` (its deps that another
    stage's outs hold) whose bytes are not what dvc.lock records for that stage, as one line with the
    mend; None when every one is, or outside those tools (a stage run by hand may read outputs made by
    hand), or with PIPELINE_VERIFY_INPUTS=off. A missing file, a folder whose listing DVC's cache lacks,
    and records of stages the pipeline no longer has are left to the stage and DVC."""
    if not (os.environ.get(contract.DVC_ROOT) or os.environ.get(contract.SNAKEMAKE)):
        return None
    if os.environ.get(contract.VERIFY_INPUTS, "on").strip().lower() == "off":
        return None
    from pipelines import commit

    table = load_table()
    name, _, item = label.partition("@")
    deps = [fill(d, item or None).rstrip("/") for d in table[name].deps]
    stages = {n for st in table.values() for n, _ in st.instances()}
    with contextlib.chdir(root), commit.commit_lock():  # (Snakemake's jobs commit beside this one)
        try:
            outs = lock_outs(commit.parse_yaml(commit.LOCK_FILE.read_text()) or {})
        except (OSError, ValueError, AttributeError, TypeError, commit.yaml.YAMLError):
            return None  # none yet, or cut short (Snakemake repairs it)
    cache = dvc_cache_dir(root)
    for out, (producer, md5) in sorted(outs.items()):
        path = out.rstrip("/")
        inside = [d for d in deps if d == path or d.startswith(f"{path}/") or path.startswith(f"{d}/")]
        if producer not in stages or not commit.HASH.fullmatch(str(md5)) or not inside:
            continue
        files = {path: md5}
        if md5.endswith(".dir"):  # a folder: DVC's listing of it, in its cache
            listing = read_json(cache / "files/md5" / md5[:2] / md5[2:])
            if not isinstance(listing, list):
                continue
            files = {f"{path}/{e['relpath']}": e["md5"] for e in listing}
        for file, want in sorted(files.items()):
            if not any(file == d or file.startswith(f"{d}/") or path.startswith(f"{d}/") for d in inside):
                continue
            now = file_md5(root / file)
            if now is not None and now != want:
                return (
                    f"{file}, an input made by {producer}, is not what dvc.lock records (md5 {want}, its bytes "
                    f"{now}): a damaged DVC cache object or a change made in place; `python -m pipelines.verify "
                    f"--rehash` names the mend, or re-run {producer}"
                )
    return None


def dvc_cache_dir(root: Path) -> Path:
    """DVC's cache folder: `cache.dir` of .dvc/config.local, else of .dvc/config (relative to .dvc/), else
    .dvc/cache."""
    import configparser

    for name in ("config.local", "config"):
        parser = configparser.ConfigParser()
        try:
            parser.read(root / ".dvc" / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            return (root / ".dvc" / os.path.expanduser(parser.get("cache", "dir"))).resolve()
    return root / ".dvc/cache"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.verify", description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another run's dvc.lock, or a folder holding one")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    parser.add_argument("--rehash", action="store_true", help="hash every out's bytes (slower: reads them all)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    crate = args.against is not None and is_crate(args.against)
    if args.against is not None and not crate and not (args.against.is_file() or (args.against / "dvc.lock").is_file()):
        parser.error(f"--against {args.against}: no dvc.lock there (nor a crate's {METADATA})")
    if args.against is not None and not crate:
        try:
            against_source(root, args.against)
        except ValueError as e:
            parser.error(str(e))
    try:
        lock = parse_yaml((root / "dvc.lock").read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        print(
            f"BROKEN  outs        {root / 'dvc.lock'} is unreadable ({' '.join(str(e).split())}); "
            "mend: git checkout dvc.lock (its committed record)"
        )
        return 1
    r = Report()
    lock = in_the_dag(root, lock, r)
    check_report(root, r)
    check_status(root, lock, r)
    if args.rehash:
        rehash_outs(root, lock, r)
    check_registry(root, lock, r)
    check_checkpoints(root, r)
    check_environment(root, lock, r)
    print(f"{r.broken} broken link(s)" if r.broken else "every link holds")
    code = 1 if r.broken else 0
    if crate:
        code |= compare_crate(root, lock, args.against)
    elif args.against is not None:
        code |= compare(root, lock, args.against)
    return code


if __name__ == "__main__":
    from stages.common.stage import exit_now  # (without the teardown of torch and MLflow: a second of CPU)

    exit_now(main())
