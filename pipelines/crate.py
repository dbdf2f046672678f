"""A pipeline run as a Workflow Run RO-Crate (the Provenance Run Crate profile 0.5), for publishing it.

    python -m pipelines.crate [--out run.crate.zip] [--root .] [--include-outputs]
    python -m pipelines.crate check run.crate.zip     validate it offline (rocrate-validator, REQUIRED level)

The crate describes the run that dvc.lock records in the workspace: the Snakefile as the main entity (a
ComputationalWorkflow, with pipelines/stages.yaml and dvc.yaml as parts), one HowToStep per stage (per
foreach item) and one CreateAction per stage run with its params (PropertyValue, the values dvc.lock
records), its inputs and outputs (dvc.lock's md5s), its code (the files dvc.lock records, and meta.json's
code_sha256), its environment (requirements.lock's sha256, the CPU of meta.json), its MLflow run; the
report's rows as results, the data's licences (docs/data.md), the git commit and an OrganizeAction for the
engine's run. Outputs are referenced by path and md5 (a local `#` identifier), not copied, unless
--include-outputs. The same records give the same bytes: entities sorted, timestamps only those the
records hold (the MLflow runs' start and end, the commit's date), the zip's entries dated 1980-01-01.
`python -m pipelines.verify --against run.crate.zip` compares a workspace's run with one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from pipelines.dag import load_table, parse_yaml
from stages.common import provenance
from stages.common.config import UserError, flatten

ROOT = Path(__file__).resolve().parent.parent
METADATA = "ro-crate-metadata.json"
# The JSON-LD contexts the crate names, and the files of them shipped for offline validation.
CONTEXTS = {
    "https://w3id.org/ro/crate/1.1/context": "ro-crate-1.1.jsonld",
    "https://w3id.org/ro/terms/workflow-run/context": "workflow-run.jsonld",
}
# The version of the RO-Crate 1.1 context shipped in pipelines/crate_contexts/ (its own "version" field).
CONTEXTS_VERSION = "1.1.3"
CONTEXT_DIR = ROOT / "pipelines/crate_contexts"
PROFILES = {  # the profiles the crate conforms to: @id, name, version
    "https://w3id.org/ro/wfrun/process/0.5": ("Process Run Crate", "0.5"),
    "https://w3id.org/ro/wfrun/workflow/0.5": ("Workflow Run Crate", "0.5"),
    "https://w3id.org/ro/wfrun/provenance/0.5": ("Provenance Run Crate", "0.5"),
    "https://w3id.org/workflowhub/workflow-ro-crate/1.0": ("Workflow RO-Crate", "1.0"),
}
WORKFLOW = "Snakefile"
COPIED = (WORKFLOW, "pipelines/stages.yaml", "dvc.yaml", "params.yaml", "dvc.lock", "reports/results.json")
# The datasets of docs/data.md's licence table that a run reads, by the prepare_data param that selects them.
DATASETS = {
    "TinyShakespeare": lambda p: p.get("corpus") == "tinyshakespeare",
    "WikiText-2": lambda p: "wikitext2" in (p.get("benchmarks") or []) or p.get("corpus") == "wikitext2",
    "Stanford Alpaca": lambda p: p.get("instructions") == "alpaca",
    "Planetoid": lambda p: bool(p.get("graphs")),
}
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def environment(root: Path, meta: dict) -> dict[str, str]:
    """The environment a stage run's record names: requirements.lock's sha256 and the CPU of its meta.json
    (kernels, so the last digits of results, follow it), with its own environment record when it has one."""
    recorded = (meta.get("environment") or {}).get("lock_sha256")  # the lock the run found (stages.common.environment)
    recorded = recorded or hashlib.sha256((root / "requirements.lock").read_bytes()).hexdigest()
    found = {"requirements.lock sha256": recorded}
    for key, value in sorted((meta.get("cpu") or {}).items()):
        found[key] = ",".join(value) if isinstance(value, list) else str(value)
    for key, value in sorted(flatten(meta.get("environment") or {}).items()):
        found[f"environment.{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return found


def mlflow_runs(root: Path) -> dict[str, object]:
    """{stage label: its newest FINISHED MLflow run} from the workspace's embedded store (mlflow.db), and the
    pipeline's parent run under "" ; {} without a store. A stage run is named with its label
    (stages.common.tracking.runs)."""
    if not (root / "mlflow.db").is_file():
        return {}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    found: dict[str, object] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=10000):
            label = "" if run.data.tags.get("pipeline_role") == "parent" else run.info.run_name
            if label not in found or run.info.start_time > found[label].info.start_time:
                found[label] = run
    return found


def iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat().replace("+00:00", "Z")


def licences(root: Path, params: dict) -> list[dict]:
    """The rows of docs/data.md's licence table for the datasets these prepare_data params read."""
    rows = []
    for line in (root / "docs/data.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and any(cells[0].startswith(name) and used(params) for name, used in DATASETS.items()):
            rows.append({"dataset": cells[0], "source": cells[2], "license": cells[3], "meaning": cells[4]})
    return rows


def data_entity(path: str, md5: str, size, nfiles, include: bool) -> dict:
    folder = md5.endswith(".dir")
    ident = (path.rstrip("/") + "/" if folder else path) if include else f"#{path}"
    entity = {"@id": ident, "@type": "Dataset" if folder else "File", "name": path, "md5": md5}
    if size is not None:
        entity["contentSize"] = str(size)
    if folder:
        entity["description"] = f"a folder of {nfiles} files; md5: DVC's hash of its listing"
    return entity


def property_value(ident: str, key: str, value, pid: str) -> dict:
    value = json.dumps(value) if isinstance(value, (list, dict)) or value is None else value
    return {"@id": ident, "@type": "PropertyValue", "name": key, "propertyID": pid, "value": value}


class Graph:
    """The crate's entities by @id, the first of an @id kept (a dep shared by stages is one entity)."""

    def __init__(self):
        self.entities: dict[str, dict] = {}

    def add(self, entity: dict) -> dict:
        self.entities.setdefault(entity["@id"], entity)
        return {"@id": entity["@id"]}

    def sorted(self) -> list[dict]:
        return sorted(self.entities.values(), key=lambda e: e["@id"])


def meta_of(root: Path, record: dict) -> dict:
    """The meta.json of a stage run's first out (a folder), {} when it writes none."""
    for out in record.get("outs", ()):
        if out.get("md5", "").endswith(".dir"):
            return read_json(root / out["path"] / "meta.json") or {}
    return {}


def result_rows(root: Path) -> list[dict]:
    """The rows of reports/results.json (the reproduced results, then the regression check) as PropertyValues."""
    doc = read_json(root / "reports/results.json") or {}
    rows = [*doc.get("rows", ()), *(doc.get("regression") or {}).get("rows", ())]
    found = []
    for n, row in enumerate(rows):
        pv = property_value(f"#result/{n}", row["result"], row["ours"], "reports/results.json")
        extra = {k: row[k] for k in ("stage", "paper", "relation", "published", "tolerance", "pass") if k in row}
        found.append(pv | {"description": json.dumps(extra, sort_keys=True)})
    return found


def pinned(root: Path, package: str) -> str:
    """A package's version as requirements.lock pins it ('' when it does not)."""
    found = re.search(rf"^{re.escape(package)}==(\S+)", (root / "requirements.lock").read_text(), re.M | re.I)
    return found.group(1) if found else ""


def commit_date(root: Path) -> str:
    """The date of the workspace's commit (the crate's datePublished: a date its records hold)."""
    proc = subprocess.run(["git", "log", "-1", "--format=%cI"], cwd=root, capture_output=True, text=True)
    return proc.stdout.strip() or "1970-01-01T00:00:00Z"


def ran_with(rec: dict, module: str) -> dict:
    """The params a stage run read: its dvc.lock params, flattened, with the `key=value` overrides its command
    ends with (a sweep's point: `train.lr=0.003`) applied to its module's section."""
    params = flatten(rec.get("params", {}).get("params.yaml", {}))
    words = rec.get("cmd", "").split()
    for word in words[4:]:  # (after `python -m pipelines.launch <stage>`)
        key, sep, value = word.partition("=")
        if sep and not word.startswith("-") and f"{module}.{key}" in params:
            params[f"{module}.{key}"] = parse_yaml(value)
    return params


def stage_action(root: Path, g: Graph, label: str, rec: dict, out_ids: dict, run, lock_file: dict, module="") -> dict:
    """A stage run's CreateAction (and its tool, params, environment and MLflow run as entities of `g`);
    `module`: the stage module it ran (a sweep's point: the swept stage's), by default its own name."""
    name = label.partition("@")[0]
    module = module or name
    meta = meta_of(root, rec)
    inputs, code_files, requirements = [], [], [lock_file]
    for dep in rec.get("deps", ()):
        path = dep["path"]
        if path in out_ids:
            inputs.append({"@id": out_ids[path]})
            continue
        ref = g.add(data_entity(path, dep.get("md5", ""), dep.get("size"), None, False))
        (code_files if path.endswith(".py") else requirements if "/packages/" in path else inputs).append(ref)
    tool = {"@id": f"#tool/{name}", "@type": "SoftwareApplication", "name": f"stages.{module}",
            "hasPart": code_files, "softwareRequirements": requirements}  # fmt: skip
    code = meta.get("code_sha256") or (run.data.tags.get("code_sha256") if run is not None else None)
    if code:
        tool["softwareVersion"] = f"code_sha256:{code}"
    g.add(tool)
    section = rec.get("params", {}).get("params.yaml", {})
    params = [
        g.add(property_value(f"#param/{label}/{k}", k, v, f"params:{label}")) for k, v in ran_with(rec, module).items()
    ]
    env = environment(root, meta)
    env_refs = [
        g.add(property_value(f"#environment/{label}/{k}", k, v, f"environment:{label}")) for k, v in env.items()
    ]
    action = {
        "@id": f"#action/{label}",
        "@type": "CreateAction",
        "name": f"Run of stage {label}",
        "description": rec.get("cmd", ""),
        "instrument": {"@id": tool["@id"]},
        "object": inputs + params,
        "result": [{"@id": out_ids[o["path"]]} for o in rec.get("outs", ())],
        "environment": env_refs,
    }
    if run is not None:
        action |= {"startTime": iso(run.info.start_time), "endTime": iso(run.info.end_time)}
        action["identifier"] = g.add(mlflow_entity(run))
    if name == "report":
        action["result"] += [g.add(row) for row in result_rows(root)]
    if name == "prepare_data":
        for n, row in enumerate(licences(root, section.get(name, {}))):
            lic = g.add({"@id": f"#license/{n}", "@type": "CreativeWork", "name": row["license"],
                         "description": f"{row['dataset']}; source: {row['source']}; {row['meaning']}"})  # fmt: skip
            for ref in action["result"]:
                g.entities[ref["@id"]].setdefault("license", []).append(lic)
    return g.add(action)


def mlflow_entity(run) -> dict:
    return property_value(f"#mlflow/{run.info.run_id}", "MLflow run", run.info.run_id, "mlflow_run_id")


def build(root: Path, include: bool) -> tuple[list[dict], list[str]]:
    """The crate's entities, and the workspace files it holds besides its metadata."""
    lock = parse_yaml((root / "dvc.lock").read_text()) or {}
    records = lock.get("stages") or {}
    table = load_table(root / "pipelines/stages.yaml")
    labels = [name for st in table.values() for name, _ in st.instances() if name in records]
    if not labels:
        raise UserError(f"{root / 'dvc.lock'} records no stage of this DAG: run the pipeline first (make run)")
    runs, commit, g = mlflow_runs(root), provenance.git_commit(root), Graph()
    files = [name for name in COPIED if (root / name).is_file()]
    out_ids = {}
    for label in labels:
        for out in records[label].get("outs", ()):
            out_ids[out["path"]] = g.add(data_entity(out["path"], out.get("md5", ""), out.get("size"),
                                                     out.get("nfiles"), include))["@id"]  # fmt: skip
            if include:
                path = root / out["path"]
                files += [str(p.relative_to(root)) for p in [path, *path.rglob("*")] if p.is_file()]
    lock_file = g.add({"@id": "#requirements.lock", "@type": "File", "name": "requirements.lock",
                       "sha256": environment(root, {})["requirements.lock sha256"]})  # fmt: skip
    steps, controls = [], []
    for position, label in enumerate(labels, start=1):
        module = table[label.partition("@")[0]].runs()  # (a sweep's point: the swept stage's module)
        action = stage_action(root, g, label, records[label], out_ids, runs.get(label), lock_file, module)
        tool = g.entities[action["@id"]]["instrument"]
        step = g.add({"@id": f"#step/{label}", "@type": "HowToStep", "name": label, "position": str(position),
                      "workExample": tool})  # fmt: skip
        steps.append(step)
        controls.append(g.add({"@id": f"#control/{label}", "@type": "ControlAction", "name": f"Orchestrate {label}",
                               "instrument": step, "object": action}))  # fmt: skip
    engine_run(root, g, runs.get(""), controls, [{"@id": out_ids[p]} for p in sorted(out_ids)])
    tools = sorted({g.entities[f"#action/{x}"]["instrument"]["@id"] for x in labels})
    for name in files:
        if name in COPIED and name != WORKFLOW:
            kind = ["File", "SoftwareSourceCode"] if name in ("pipelines/stages.yaml", "dvc.yaml") else "File"
            g.add({"@id": name, "@type": kind, "name": name})
    g.add({"@id": WORKFLOW, "@type": ["File", "SoftwareSourceCode", "ComputationalWorkflow", "HowTo"],
           "name": "The pipeline: Snakemake's rules, built from pipelines/stages.yaml (dvc.yaml: the same stages)",
           "version": commit, "programmingLanguage": {"@id": "#snakemake"}, "step": steps,
           "hasPart": [{"@id": "pipelines/stages.yaml"}, {"@id": "dvc.yaml"},
                       *({"@id": t} for t in tools)]})  # fmt: skip
    g.add({"@id": "#snakemake", "@type": "ComputerLanguage", "name": "Snakemake",
           "url": {"@id": "https://snakemake.github.io"}})  # fmt: skip
    for ident, (pname, version) in PROFILES.items():
        g.add({"@id": ident, "@type": "CreativeWork", "name": pname, "version": version})
    g.add({"@id": "https://spdx.org/licenses/MIT", "@type": "CreativeWork", "name": "MIT License"})
    g.add({"@id": "./", "@type": "Dataset", "name": f"Pipeline run at commit {commit}",
           "description": "A run of the pipeline as dvc.lock records it: its stages, params, code, environment, "
                          "outputs (by md5) and the report's results; the data's licences are on prepare_data's "
                          f"output. Contexts: RO-Crate {CONTEXTS_VERSION}, workflow-run terms.",
           "datePublished": commit_date(root), "license": {"@id": "https://spdx.org/licenses/MIT"},
           "conformsTo": [{"@id": p} for p in PROFILES], "mainEntity": {"@id": WORKFLOW},
           "hasPart": [{"@id": f} for f in COPIED if f in files] + [{"@id": out_ids[p]} for p in sorted(out_ids)],
           "mentions": [{"@id": "#organize"}, {"@id": "#run"},
                        *({"@id": f"#action/{x}"} for x in labels)]})  # fmt: skip
    g.add({"@id": METADATA, "@type": "CreativeWork", "about": {"@id": "./"},
           "conformsTo": [{"@id": "https://w3id.org/ro/crate/1.1"},
                          {"@id": "https://w3id.org/workflowhub/workflow-ro-crate/1.0"}]})  # fmt: skip
    return g.sorted(), sorted(set(files))


def engine_run(root: Path, g: Graph, parent, controls: list, results: list) -> None:
    """The run of the whole workflow (a CreateAction) and the engine's OrganizeAction over the stage runs;
    the engine is DVC when its MLflow parent run says so (`dvc repro`), else Snakemake."""
    dvc = parent is not None and parent.data.tags.get("pipeline_run", "").startswith("dvc-")
    engine = "DVC" if dvc else "Snakemake"
    g.add({"@id": "#engine", "@type": "SoftwareApplication", "name": engine,
           "softwareVersion": pinned(root, engine.lower())})  # fmt: skip
    parts = [{"@id": WORKFLOW}, {"@id": "pipelines/stages.yaml"}, {"@id": "dvc.yaml"}]  # (what the engines read)
    run = {"@id": "#run", "@type": "CreateAction", "name": "Run of the pipeline", "instrument": parts,
           "object": [{"@id": "params.yaml"}], "result": results}  # fmt: skip
    organize = {"@id": "#organize", "@type": "OrganizeAction", "name": f"{engine}'s run of the pipeline",
                "instrument": {"@id": "#engine"}, "object": controls, "result": {"@id": "#run"}}  # fmt: skip
    if parent is not None:
        times = {"startTime": iso(parent.info.start_time), "endTime": iso(parent.info.end_time)}
        run |= times
        organize |= times | {"identifier": g.add(mlflow_entity(parent))}
    g.add(run)
    g.add(organize)


def metadata(entities: list[dict]) -> bytes:
    doc = {"@context": list(CONTEXTS), "@graph": entities}
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write(root: Path, out: Path, include: bool) -> tuple[int, int]:
    """Write the crate to `out` (a .zip, else a folder); (entities, files held besides the metadata)."""
    entities, files = build(root, include)
    blob = metadata(entities)
    if out.suffix == ".zip":
        tmp = out.with_name(f".{out.name}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for name, data in [(METADATA, blob), *((f, None) for f in files)]:
                info = zipfile.ZipInfo(name, ZIP_DATE)
                info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
                z.writestr(info, data if data is not None else (root / name).read_bytes())
        tmp.replace(out)
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / METADATA).write_bytes(blob)
        for name in files:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, out / name)
    return len(entities), len(files)


CHECK_DIR = ROOT / ".cache/crate-check"
TOOL_LOCK = ROOT / "pipelines/tools/crate-check.lock"
PROFILE = "provenance-run-crate-0.5"


def validator() -> Path:
    """The Python of .cache/crate-check/venv, which holds rocrate-validator as its lock pins it (installed with
    hashes required, on first use or after the lock changed). UserError when pip cannot install it (no PyPI)."""
    venv = CHECK_DIR / "venv"
    stamp = venv / "crate-check.lock.sha256"
    want = hashlib.sha256(TOOL_LOCK.read_bytes()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == want):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        cmd = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        proc = subprocess.run([*cmd, "--require-hashes", "-r", str(TOOL_LOCK)], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            raise UserError(f"crate check: pip could not install the validator from {TOOL_LOCK.name} ({last}): it "
                            "needs PyPI, or a package index pip is configured for")  # fmt: skip
        stamp.write_text(want)
    return venv / "bin/python"


def check(crate: Path) -> int:
    """Validate `crate` against the Provenance Run Crate profile at the REQUIRED level, offline; print the
    validator's summary and each issue; 0 when it passes."""
    cache = str(CHECK_DIR / "http-cache")
    cmd = [str(validator()), str(ROOT / "pipelines/tools/crate_check.py"), cache]
    cmd += [*(f"{url}={CONTEXT_DIR / name}" for url, name in CONTEXTS.items()), "--", "validate", "-p", PROFILE]
    cmd += ["-l", "required", "--no-paging", "-f", "json", "--offline", "--cache-path", cache, str(crate.resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout[proc.stdout.index("{") :])
    except ValueError:
        print(
            f"crate check: rocrate-validator gave no report (exit code {proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )
        return 2
    issues, stats = report.get("issues", []), report.get("statistics", {})
    passed = report.get("passed") is True and not issues
    version, profiles = report.get("meta", {}).get("version", "?"), ", ".join(stats.get("profiles", []))
    print(f"crate check: {crate}: {'valid' if passed else 'NOT valid'}: {PROFILE} at the REQUIRED level, offline "
          f"(rocrate-validator {version}; profiles {profiles}): "
          f"{stats.get('total_passed_checks', '?')} of {stats.get('total_checks', '?')} checks passed, "
          f"{len(issues)} issue(s)")  # fmt: skip
    for issue in issues:
        check_ = issue.get("check") if isinstance(issue.get("check"), dict) else {}
        message = " ".join(str(issue.get("message", "")).split())
        print(f"  {check_.get('identifier', '?')} ({check_.get('name', '?')}): {message}")
    return 0 if passed else 1


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["check"]:
        parser = argparse.ArgumentParser(prog="python -m pipelines.crate check", description=check.__doc__)
        parser.add_argument("crate", type=Path, help="a crate: its .zip or folder")
        return check(parser.parse_args(args[1:]).crate)
    parser = argparse.ArgumentParser(prog="python -m pipelines.crate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("run.crate.zip"), help="a .zip, else a folder")
    parser.add_argument("--root", type=Path, default=Path("."), help="the workspace (default: here)")
    parser.add_argument("--include-outputs", action="store_true", help="copy the outs into the crate")
    opts = parser.parse_args(args)
    try:
        entities, files = write(opts.root.resolve(), opts.out, opts.include_outputs)
    except UserError as e:
        print(f"crate: {e}", file=sys.stderr)
        return 2
    size = opts.out.stat().st_size if opts.out.is_file() else sum(p.stat().st_size for p in opts.out.rglob("*"))
    print(f"crate: {opts.out}: {entities} entities, {files} files besides the metadata, {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def is_crate(path: Path) -> bool:
    """A crate's zip, or a folder holding a crate's metadata."""
    return (path.is_file() and zipfile.is_zipfile(path)) or (path / METADATA).is_file()


def crate_files(crate: Path) -> dict[str, bytes]:
    """Every file a crate holds, by its path in the crate."""
    if crate.is_file():
        with zipfile.ZipFile(crate) as z:
            return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}
    return {str(p.relative_to(crate)): p.read_bytes() for p in sorted(crate.rglob("*")) if p.is_file()}


def unpack(crate: Path, dest: Path) -> Path:
    """The crate as another run's folder for `pipelines.verify --against` (dest): its files, and where it holds
    no outs, each stage's results.json rebuilt from the report's rows (the results compared within their
    tolerance)."""
    files = crate_files(crate)
    for name, data in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    rows = json.loads(files.get("reports/results.json", b"{}")).get("rows", [])
    for stage in sorted({row["stage"] for row in rows}):
        target = dest / "data" / stage / "results.json"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps([row for row in rows if row["stage"] == stage], indent=1))
    return dest


def cpu_kind(env: dict) -> str:
    return ", ".join(str(env[k]) for k in ("cpu_model", "cpu_capability") if env.get(k)) or "unrecorded"


def differences(root: Path, crate: Path) -> int:
    """The crate's run against this checkout, one line each: the machine kind (the CPU of the runs' records),
    then per stage the params (the values dvc.lock recorded against params.yaml's now), the code files and
    package lists (md5 recorded against the files now), and requirements.lock; 1 when any differs."""
    from pipelines.verify import file_md5

    files = crate_files(crate)
    graph = {e["@id"]: e for e in json.loads(files[METADATA])["@graph"]}
    theirs = {e["name"]: e["value"] for i, e in graph.items() if i.startswith("#environment/")}
    records = (parse_yaml(files["dvc.lock"].decode()) or {}).get("stages") or {}
    ours_lock = (parse_yaml((root / "dvc.lock").read_text()) or {}).get("stages") or {}
    here = next((environment(root, m) for m in (meta_of(root, r) for r in ours_lock.values()) if m.get("cpu")), {})
    same = cpu_kind(theirs) == cpu_kind(here)
    note = "" if same else " (outs that differ are compared within their tolerance)"
    print(f"{'same machine' if same else 'other machine':<29} the crate's run: {cpu_kind(theirs)}; "
          f"this run: {cpu_kind(here)}{note}")  # fmt: skip
    params_now = parse_yaml((root / "params.yaml").read_text()) or {}
    found = []
    for label, rec in sorted(records.items()):
        recorded = flatten(rec.get("params", {}).get("params.yaml", {}))
        now = flatten({key: dotted(params_now, key) for key in rec.get("params", {}).get("params.yaml", {})})
        for key in sorted(recorded.keys() | now.keys()):
            if str(recorded.get(key)) != str(now.get(key)):  # (dvc.lock writes 5e-05, which YAML 1.1 reads as text)
                found.append(
                    f"params  stage {label}: {key} is {recorded.get(key)!r} in the crate, {now.get(key)!r} here"
                )
        for dep in rec.get("deps", ()):
            path = dep["path"]
            if path.endswith(".py") or "/packages/" in path:
                md5 = file_md5(root / path)
                if md5 != dep.get("md5"):
                    kind = "code" if path.endswith(".py") else "environment"
                    found.append(f"{kind}  stage {label}: {path} has md5 {dep.get('md5')} in the crate, {md5} here")
    lock_here = environment(root, {})["requirements.lock sha256"]
    if graph.get("#requirements.lock", {}).get("sha256") != lock_here:
        found.append(f"environment  requirements.lock: sha256 {graph.get('#requirements.lock', {}).get('sha256')} "
                     f"in the crate, {lock_here} here")  # fmt: skip
    for line in found:
        print(f"{'differs':<29} {line}")
    print(f"params, code and environment: {'as in the crate' if not found else f'{len(found)} difference(s)'}")
    return 1 if found else 0


def dotted(doc: dict, key: str):
    """params.yaml's value at a dvc.lock params key (a section, or a dotted key such as base.model)."""
    for part in key.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc
