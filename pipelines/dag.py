"""The stage table (pipelines/stages.yaml) and what follows from it: dvc.yaml and the Snakemake rules.

    python -m pipelines.dag write     regenerate dvc.yaml from the table
    python -m pipelines.dag check     exit 1 when dvc.yaml is not what the table gives, or when the
                                      stages DVC parses differ from the rules Snakemake parses

The Snakefile calls `load_table()` and `snakemake_rules()` when it loads, so its rules follow the
table directly; tests/test_dag.py compares what DVC and Snakemake each parse.

A stage's dependencies are the table's data deps plus two kinds the table does not spell out:
  - its code: the files of every module `stages.<name>` imports within the repository, transitively (in
    functions too; not under TYPE_CHECKING), found by grimp from the imports themselves;
  - its environment: pipelines/packages/<family>.txt, the pinned versions of the packages the stages of
    its container family import (transitively, by their declared requirements), generated from
    requirements.lock by `write`. Upgrading one of them re-runs the family's stages; a package no stage
    imports (pytest, ruff) re-runs nothing. Each stage checks the versions installed where it runs against
    this file before any compute (stages.common.environment), so what dvc.lock records is what ran.
The launcher (`python -m pipelines.launch`) is how a stage is started, not what it computes: not a dep.

A sweep declared in params.yaml (stages.common.sweep) adds two stages for both tools: `sweep_<name>`, the
swept stage once per point (DVC's `foreach` over the points by name, each with its values; one Snakemake
rule with the points as its `{item}`), writing data/sweeps/<name>/<point> and ending its command with the
point's values as overrides; and `sweep_<name>_compare` (stages.sweep_compare), after every point. A point
an earlier sweep of the same stage already has (stages.common.sweep.homes) is not run again: the
comparison reads it from that sweep's folder. The report does not collect them.

What a stage measures (`measured` in the table: throughput, seconds, peak memory) is written outside its
outputs, to measured/<stage>.json (measured/<stage>/<item>.json per item; and .png for a plot), passed as
`--measured`. DVC records it as an out it does not cache (`cache: false`), to be committed to git with
dvc.lock; so the cached outs are functions of their inputs, params, code and environment alone, and a
re-run of an unchanged stage reproduces their hashes.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipelines import lock
from stages.common import config, environment, sweep

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "pipelines" / "stages.yaml"
LOCK = ROOT / "requirements.lock"
PACKAGES = environment.PACKAGES  # pipelines/packages/{family}.txt, which each stage checks before it runs
PACKAGES_HEADER = (
    "# Generated from requirements.lock by `python -m pipelines.dag write` (make dag): the pinned packages the\n"
    "# stages of the {family} family import, with everything they require. A dependency of each of those\n"
    "# stages: a new version of one of these re-runs them.\n"
)
LAUNCH = "python -m pipelines.launch"
STAGE_KEYS = {
    "args", "deps", "params", "outs", "metrics", "plots", "measured", "resources", "foreach", "collect",
    "when", "with_base",
}  # fmt: skip
WHEN = ("own", "base")  # the pipeline's own pretrain is the base model; another model is (params.yaml's base.model)
MEASURED_DIR = "measured"
MEASURED_KINDS = ("json", "png")  # the figures; a plot of them
RESOURCE_KEYS = {"nodes", "nproc_per_node", "gpus_per_node", "runtime_min", "container"}
RESOURCE_KEYS |= {"cpus_per_process", "mem_mb_per_process", "cpus_per_gpu", "mem_mb_per_gpu"}  # pipelines/cluster.py
HEADER = (
    "# Generated from pipelines/stages.yaml by `python -m pipelines.dag write` (make dag).\n"
    "# Edit the table, not this file: tests fail when the two disagree.\n"
)


# libyaml's parser where PyYAML was built with it: dvc.lock runs to thousands of lines, which the pure-Python
# parser takes a third of a second to read, and every stage's commit reads it three times.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str):
    """yaml.safe_load, through libyaml where available (the same documents, the same errors' classes)."""
    return yaml.load(text, Loader=SAFE_LOADER)


class TableError(ValueError):
    pass


@dataclass(frozen=True)
class Stage:
    name: str
    args: str
    deps: tuple[str, ...]
    params: tuple[str, ...]
    outs: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    plots: tuple = ()
    resources: dict = field(default_factory=dict)
    foreach: tuple[str, ...] = ()
    collect: bool = False
    measured: tuple[str, ...] = ()  # of MEASURED_KINDS
    module: str = ""  # the stage module it runs (stages.<module>): its own name unless a sweep's
    # A sweep's points (stages.common.sweep): (the name of its values in DVC's foreach items, values) per
    # swept key, and per point the params overrides its command ends with, {point: ((key, value as text), ...)}
    matrix: tuple = ()
    sets: dict = field(default_factory=dict)
    sweep: str = ""  # the sweep a point or comparison stage belongs to

    def runs(self) -> str:
        """The module `python -m stages.<module>` the launcher starts."""
        return self.module or self.name

    def measured_files(self) -> tuple[str, ...]:
        """measured/<stage>.<kind> (measured/<stage>/${item}.<kind> per item): uncached outs."""
        stem = f"{MEASURED_DIR}/{self.name}" + ("/${item}" if self.foreach else "")
        return tuple(f"{stem}.{kind}" for kind in self.measured)

    def outputs(self) -> tuple[str, ...]:
        """Everything the stage writes: its outs, then its measured files."""
        return self.outs + self.measured_files()

    def instances(self) -> list[tuple[str, str | None]]:
        """(DVC stage name, foreach item) for each concrete stage."""
        if not self.foreach:
            return [(self.name, None)]
        return [(f"{self.name}@{item}", item) for item in self.foreach]

    def data_deps(self, item: str | None = None) -> list[str]:
        """The deps that are data, as dvc.lock names them (`${item}` filled): the files and folders under
        data/ it reads, not its code, its family's packages, what stages measured or recorded values."""
        return [fill(d, item).rstrip("/") for d in self.deps if d.startswith("data/")]

    def cmd(self) -> str:
        """The command, `${item}` standing for the item (a sweep's point: its values follow as key=value)."""
        args = self.args + (f" --measured {self.measured_files()[0]}" if self.measured else "")
        args += "".join(f" {key}=${{item.{alias}}}" for key, alias in self.overrides())
        return f"{LAUNCH} {self.name}{'@${item}' if self.foreach else ''} {args.strip()}".strip()

    def overrides(self) -> list[tuple[str, str]]:
        """(params key, its name in DVC's foreach items) of a sweep's keys, in order."""
        first = next(iter(self.sets.values()), ())
        return [(key, alias) for (key, _), (alias, _) in zip(first, self.matrix, strict=True)]

    def command(self, item: str | None) -> str:
        """The command of one instance: `${item}` filled, and a sweep point's values."""
        text = fill(self.cmd(), item)
        for (_, value), (alias, _) in zip(self.sets.get(item, ()), self.matrix, strict=False):
            text = text.replace(f"${{item.{alias}}}", value)
        return text


def check_params(params: str | Path = "params.yaml", memo: Path | None = None) -> None:
    """Check every stage's params section against the stage's Config, as the stage itself would. The
    Snakefile calls it when it loads, so a bad key stops the invocation before any job starts (a job
    that failed on it would have cost the stage its previous outputs, which Snakemake removes first).
    Raises config.ConfigError naming the key.

    memo: a file holding the hash of what the last check that passed read (the params file, the stage
    table, every module under stages/, the Python version); when the hash is the same, the check is
    not made again, sparing each Snakemake invocation the import of every stage (and of torch)."""
    import hashlib
    import importlib

    from stages.common import config

    digest = None
    if memo is not None:
        h = hashlib.sha256(sys.version.encode())
        h.update(Path(params).read_bytes() if Path(params).is_file() else b"(no params file)")
        for path in [TABLE, *sorted((ROOT / "stages").rglob("*.py"))]:  # (by name in the repository: the
            h.update(f"\0{path.relative_to(ROOT)}\0".encode() + path.read_bytes())  # same in every copy)
        digest = h.hexdigest()
        if memo.is_file() and memo.read_text() == digest:
            return
    for st in load_table(params=Path(params)).values():
        if st.sweep:  # each point: the swept stage's section with the point's values (the comparison has none)
            for values in st.sets.values():
                where = f"sweeps.{st.sweep} ({' '.join(f'{k}={v}' for k, v in values)})"
                try:
                    module = importlib.import_module(f"stages.{st.runs()}")
                    config.load(module.Config, st.runs(), params, [f"{k}={v}" for k, v in values])
                except config.ConfigError as e:
                    raise config.ConfigError(f"{where}: {e}") from None
            continue
        config.load(importlib.import_module(f"stages.{st.name}").Config, st.name, params)
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(memo)


def is_dir(path: str) -> bool:
    """Outputs without a file suffix are folders."""
    return Path(path).suffix == ""


def fill(text, item: str | None):
    """Replace ${item} in a path, or in the keys of a {path: options} plot entry."""
    if isinstance(text, dict):
        return {fill(k, item): v for k, v in text.items()}
    return text if item is None else text.replace("${item}", item)


def base_kind(params: Path) -> str:
    """ "base" when params.yaml names a base model other than the pipeline's own pretrain (base.model), else "own"."""
    try:
        doc = parse_yaml(Path(params).read_text()) or {}
    except FileNotFoundError:
        return "own"
    model = (doc.get("base") or {}).get("model") if isinstance(doc, dict) else None
    return "base" if model else "own"


def for_base(entry: dict, kind: str, where: str) -> dict | None:
    """The table's entry as the DAG runs it for the base model's `kind` (WHEN), or None when the stage is
    not in that DAG: `${base}` replaced by the stage that makes the base model (pretrain or base), and
    `with_base`'s args and deps added while it is the base stage."""
    when = entry.get("when")
    if when is not None and when not in WHEN:
        raise TableError(f"{where}: when: {when!r}; valid: {', '.join(WHEN)}")
    if when is not None and when != kind:
        return None
    maker = "pretrain" if kind == "own" else "base"

    def sub(value):
        if isinstance(value, str):
            return value.replace("${base}", maker)
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, dict):
            return {sub(k): sub(v) for k, v in value.items()}
        return value

    extra = entry.get("with_base") or {}
    if set(extra) - {"args", "deps"}:
        raise TableError(f"{where}: with_base: {sorted(set(extra) - {'args', 'deps'})}; valid: args, deps")
    # A stage whose command or inputs follow base.model declares it, so that a dvc.yaml made for the other
    # kind of base runs it after base.model changed, and the launcher refuses the stale command.
    made = {k: sub(v) for k, v in entry.items() if k not in ("when", "with_base")}
    follows = when is not None or extra or made != {k: entry[k] for k in made}  # (it named ${base})
    entry = made
    params = list(entry.get("params") or ())
    if follows and "base" not in params:
        entry["params"] = [*params, "base.model"]
    if kind == "base":
        entry["args"] = f"{entry.get('args', '')} {extra.get('args', '')}".strip()
        entry["deps"] = list(entry.get("deps") or ()) + list(extra.get("deps") or ())
    return entry


def load_table(path: Path = TABLE, params: Path | None = None) -> dict[str, Stage]:
    """The stage table as the DAG runs it for params.yaml (beside the table's repository unless `params`)."""
    doc = parse_yaml(Path(path).read_text())
    defaults = doc.get("defaults", {})
    base_resources = defaults.get("resources", {})
    if "common_deps" in defaults:
        raise TableError(f"{path}: defaults.common_deps: code deps come from the imports (pipelines/dag.py); remove it")
    root = Path(path).resolve().parent.parent
    code = code_deps(root, tuple(f"stages.{name}" for name in doc["stages"]))
    kind = base_kind(params or root / "params.yaml")
    stages = {}
    for name, entry in doc["stages"].items():
        unknown = set(entry) - STAGE_KEYS
        if unknown:
            raise TableError(f"{path}: stage {name}: unknown key(s) {sorted(unknown)}; valid: {sorted(STAGE_KEYS)}")
        entry = for_base(entry, kind, f"{path}: stage {name}")
        if entry is None:
            continue
        res = {**base_resources, **entry.get("resources", {})}
        if set(res) - RESOURCE_KEYS:
            raise TableError(f"{path}: stage {name}: unknown resource(s) {sorted(set(res) - RESOURCE_KEYS)}")
        written = tuple(entry.get("deps", ()))
        source = [d for d in written if d.endswith(".py")]
        if source:
            raise TableError(
                f"{path}: stage {name}: deps {source}: a stage's code deps come from its imports (pipelines/dag.py); "
                f"list only data and other files it reads"
            )
        measured = tuple(entry.get("measured", ()))
        if measured and (
            measured[0] != "json" or set(measured) - set(MEASURED_KINDS) or len(set(measured)) < len(measured)
        ):
            raise TableError(
                f"{path}: stage {name}: measured {list(measured)}: use [json] or [json, png] (the figures, and "
                f"a plot of them)"
            )
        stages[name] = Stage(
            name=name,
            args=entry.get("args", ""),
            deps=written + code[f"stages.{name}"] + (PACKAGES.format(family=family(res)),),
            params=tuple(entry.get("params", ())),
            outs=tuple(entry.get("outs", ())),
            metrics=tuple(entry.get("metrics", ())),
            plots=tuple(entry.get("plots", ())),
            resources=res,
            foreach=tuple(str(i) for i in entry.get("foreach", ())),
            collect=bool(entry.get("collect", False)),
            measured=measured,
        )
    # A collecting stage (the report) reads every other stage's outputs, and what they measured.
    for name, st in list(stages.items()):
        if st.collect:
            others = [s for s in stages.values() if s.name != name]
            outs = [fill(o, item) for s in others for _, item in s.instances() for o in s.outs]
            measured = [fill(s.measured_files()[0], item) for s in others if s.measured for _, item in s.instances()]
            args = f"{st.args} --inputs {' '.join(outs)}"
            if measured:
                args += f" --measured-inputs {' '.join(measured)}"
            stages[name] = Stage(**{**st.__dict__, "deps": st.deps + tuple(outs + measured), "args": args.strip()})
    # The sweeps params.yaml declares: their points and comparisons, outside what the report collects.
    params_file = params or root / "params.yaml"
    declared = parse_yaml(params_file.read_text()) if params_file.is_file() else {}
    once = {name for name, st in stages.items() if not (st.foreach or st.collect)}
    sweeps = sweep.load(declared or {}, once, where=str(params_file))
    homes = sweep.homes(sweeps, declared or {})
    compare_deps = code_deps(root, (COMPARE_MODULE,))[COMPARE_MODULE] if sweeps else ()
    for sw in sweeps.values():
        stages |= sweep_stages(sw, stages[sw.stage], compare_deps, homes)
    return stages


SWEEPS_DIR = "data/sweeps"
COMPARE_MODULE = "stages.sweep_compare"


def sweep_stages(sw, swept: Stage, compare_deps: tuple[str, ...], homes: dict) -> dict[str, Stage]:
    """A sweep's two stages: `sweep_<name>`, the swept stage once per point into data/sweeps/<name>/<point>
    (its params overrides at the end of its command), and `sweep_<name>_compare`, the table of the points.
    `homes` (stages.common.sweep.homes): a point an earlier sweep runs is not one of `sweep_<name>`'s (a sweep
    all of whose points others run has none), and its folder is that sweep's."""
    if len(swept.outs) != 1:
        raise config.ConfigError(
            f"params.yaml: sweeps.{sw.name}.stage: {swept.name} writes {len(swept.outs)} outputs; a sweep runs a "
            f"stage of one output folder"
        )
    out, folder = swept.outs[0], f"{SWEEPS_DIR}/{sw.name}/${{item}}"

    def moved(text: str) -> str:
        return re.sub(rf"(?<![\w/]){re.escape(out)}(?=/|\s|$)", folder, text)

    aliases = sw.aliases()
    points = {p: values for p, values in sw.points().items() if homes[sw.name][p] == (sw.name, p)}
    name = f"sweep_{sw.name}"
    plots = tuple(moved(p) if isinstance(p, str) else {moved(k): v for k, v in p.items()} for p in swept.plots)
    stages = {}
    if points:  # (none when other sweeps run every point of this one: a comparison alone)
        stages[name] = Stage(
            name=name,
            args=moved(swept.args),
            deps=swept.deps,
            params=swept.params,
            outs=(folder,),
            metrics=tuple(moved(m) for m in swept.metrics),
            plots=plots,
            resources=swept.resources,
            foreach=tuple(points),
            measured=swept.measured,
            module=swept.runs(),
            matrix=tuple((aliases[key], list(values)) for key, values in sw.grid),
            sets={p: tuple((key, sweep.as_text(v)) for key, v in values.items()) for p, values in points.items()},
            sweep=sw.name,
        )
    compared = f"{SWEEPS_DIR}/{sw.name}/compare"
    point_outs = [sweep.point_folder(home) for home in homes[sw.name].values()]
    listed = " ".join(f"{p}={o}" for p, o in zip(homes[sw.name], point_outs, strict=True))
    stages[f"{name}_compare"] = Stage(
        name=f"{name}_compare",
        args=f"--sweep {sw.name} --points {listed} --output {compared}",
        deps=tuple(point_outs) + compare_deps + (PACKAGES.format(family=family(swept.resources)),),
        params=(f"sweeps.{sw.name}",),
        outs=(compared,),
        metrics=(f"{compared}/metrics.json",),
        plots=(f"{compared}/plots/{sw.metric}.png",),
        resources={**swept.resources, "nodes": 1, "nproc_per_node": 1, "gpus_per_node": 0, "runtime_min": 10},
        module="sweep_compare",
        sweep=sw.name,
    )
    return stages


def family(resources: dict) -> str:
    """The container family a stage runs in (containers/<family>/): its image's name."""
    return environment.family(resources["container"])


@functools.lru_cache(maxsize=4)
def code_deps(root: Path, modules: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """{module: the repository files that run when it is imported} (stages.common.provenance.code_files).
    A repository other than this one (a test's copy) is read in a process started there, so that its own
    files are the ones found."""
    if root != ROOT:
        code = "import json, sys; from pipelines import dag; "
        code += "print(json.dumps(dag.code_deps(dag.ROOT, tuple(sys.argv[1:]))))"
        proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TableError(proc.stderr.strip().splitlines()[-1])
        import json

        return {k: tuple(v) for k, v in json.loads(proc.stdout).items()}
    from stages.common import provenance

    deps = {}
    for module in modules:
        try:
            deps[module] = tuple(provenance.code_files(module, root))
        except KeyError:
            raise TableError(
                f"stage {module.split('.')[-1]}: no module {module} ({module.replace('.', '/')}.py)"
            ) from None
    return deps


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def family_packages(stages: dict[str, Stage]) -> dict[str, str]:
    """{family: the text of pipelines/packages/<family>.txt}: the pins of requirements.lock (without their
    hashes) naming a distribution that the family's stage modules import (any depth) or that one of those
    requires, as installed here (importlib.metadata; the environment `make venv` builds from the lock)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    from stages.common import provenance

    graph = provenance.import_graph(True)
    providers = importlib.metadata.packages_distributions()
    pinned = {normalized(pin.name): f"{pin.name}=={pin.version}" for pin in lock.parse(LOCK.read_text())}
    texts = {}
    stages = {name: st for name, st in stages.items() if not st.module}  # (a sweep's stages: the table's)
    for fam in sorted({family(st.resources) for st in stages.values()}):
        imported = set()
        for st in stages.values():
            if family(st.resources) == fam:
                imported |= {m.split(".")[0] for m in graph.find_upstream_modules(f"stages.{st.name}")}
        imported -= {"stages", "pipelines"}  # this repository (its own distribution, installed editable)
        todo = [normalized(d) for top in imported for d in providers.get(top, ())]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            try:
                requires = importlib.metadata.requires(name) or []
            except importlib.metadata.PackageNotFoundError:
                continue
            for text in requires:
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(normalized(req.name))
        lines = sorted((pinned[n] for n in seen if n in pinned), key=str.lower)
        texts[fam] = PACKAGES_HEADER.format(family=fam) + "\n".join(lines) + "\n"
    return texts


def dvc_document(stages: dict[str, Stage]) -> dict:
    out: dict = {"stages": {}}
    metrics, plots = [], []
    for st in stages.values():
        body = {"cmd": st.cmd(), "deps": list(st.deps)}
        if st.params:
            body["params"] = list(st.params)
        body["outs"] = list(st.outs) + [{path: {"cache": False}} for path in st.measured_files()]
        if st.matrix:  # (a sweep: foreach over {point: {name: value}}; a point is DVC's ${key}, our ${item})
            body = parse_yaml(yaml.safe_dump(body, sort_keys=False).replace("${item}", "${key}"))
            aliases = [alias for alias, _ in st.matrix]
            items = {p: {a: text for a, (_, text) in zip(aliases, st.sets[p], strict=True)} for p in st.foreach}
            out["stages"][st.name] = {"foreach": items, "do": body}
        else:
            out["stages"][st.name] = {"foreach": list(st.foreach), "do": body} if st.foreach else body
        for _, item in st.instances():
            metrics += [fill(m, item) for m in st.metrics]
            plots += [fill(p, item) for p in st.plots]
            plots += [fill(p, item) for p in st.measured_files() if p.endswith(".png")]
    if metrics:
        out["metrics"] = metrics
    if plots:
        out["plots"] = plots
    return out


def render_dvc(stages: dict[str, Stage]) -> str:
    return HEADER + yaml.safe_dump(dvc_document(stages), sort_keys=False, width=120)


def dvc_view(root: Path) -> dict[str, dict]:
    """Every concrete stage as DVC itself parses dvc.yaml: command, deps, params sections, outs."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    view = {}
    with Repo(str(root)) as repo:
        for stage in repo.index.stages:
            params = sorted(k for d in stage.deps if isinstance(d, ParamsDependency) for k in d.params)
            view[stage.name] = {
                "cmd": stage.cmd,
                "deps": sorted(d.def_path for d in stage.deps if not isinstance(d, ParamsDependency)),
                "params": params,
                "outs": sorted(o.def_path for o in stage.outs),
            }
    return view


def snakemake_view(root: Path) -> dict[str, dict]:
    """Every concrete stage as Snakemake holds the rules of the Snakefile (wildcards filled per item)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "rules.json"
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "--list-rules", "--config", f"dump_rules={dump}"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"snakemake could not load the Snakefile:\n{proc.stderr}")
        rules = json.loads(dump.read_text())
    view = {}
    for name, rule in rules.items():
        for item in rule["foreach"] or [None]:
            # Snakemake writes wildcard constraints into output patterns: {item,a|b}.
            sub = (lambda t: t) if item is None else (lambda t, i=item: re.sub(r"\{item(,[^}]*)?\}", i, t))
            view[name if item is None else f"{name}@{item}"] = {
                "cmd": rule["cmd"][item] if isinstance(rule["cmd"], dict) else sub(rule["cmd"]),
                "deps": sorted(sub(i) for i in rule["input"]),
                "params": sorted(rule["params"]),
                "outs": sorted(sub(o) for o in rule["output"]),
            }
    return view


def strip_launcher(cmd: str) -> str:
    """The stage's own arguments: the launcher prefix (`python -m pipelines.launch <stage>`) is how a
    stage is started here or on a cluster, not what it computes."""
    words = cmd.split()
    return " ".join(words[4:]) if words[:3] == LAUNCH.split() else cmd


def disagreements(root: Path = ROOT) -> list[str]:
    """Where DVC's and Snakemake's views of the pipeline differ (empty when they agree)."""
    dvc, smk = dvc_view(root), snakemake_view(root)
    problems = [f"stage {n} only in {'dvc.yaml' if n in dvc else 'the Snakefile'}" for n in sorted(set(dvc) ^ set(smk))]
    for name in sorted(set(dvc) & set(smk)):
        a, b = dict(dvc[name]), dict(smk[name])
        a["cmd"], b["cmd"] = strip_launcher(a["cmd"]), strip_launcher(b["cmd"])
        for key in a:
            if a[key] != b[key]:
                problems.append(f"stage {name}: {key} differ: dvc.yaml {a[key]} vs Snakefile {b[key]}")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        stages = load_table()
    except config.ConfigError as e:  # (a sweep declared in params.yaml: one line naming the key)
        print(f"error: {e}", file=sys.stderr)
        return 2
    generated = {ROOT / "dvc.yaml": render_dvc(stages)}
    generated |= {ROOT / PACKAGES.format(family=f): text for f, text in family_packages(stages).items()}
    if argv == ["write"]:
        for target, text in generated.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
        return 0
    if argv == ["check"]:
        stale = 0
        for target, text in generated.items():
            current = target.read_text() if target.exists() else ""
            if current != text:
                name = str(target.relative_to(ROOT))
                diff = difflib.unified_diff(current.splitlines(True), text.splitlines(True), name, "made")
                sys.stdout.writelines(diff)
                print(f"\n{name} is out of date: run `python -m pipelines.dag write` (make dag)", file=sys.stderr)
                stale += 1
        if stale:
            return 1
        problems = disagreements()
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            # (on the stages themselves; whether both find the same outputs current: python -m pipelines.sync)
            print("dvc.yaml, the Snakefile and pipelines/stages.yaml define the same stages")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
