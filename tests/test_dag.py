"""One truth for the DAG: dvc.yaml follows pipelines/stages.yaml, and what DVC parses equals what
Snakemake parses, stage by stage (command without the launcher prefix, deps, params, outs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, ci_params, stage_env

from pipelines import dag, sync
from stages.common import config


def copy_repo(dest):
    """The files that define the DAG, in a fresh git+DVC repository."""
    for name in ("Snakefile", "dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("pipelines", "stages", ".dvc"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def test_dvc_yaml_and_the_package_lists_are_generated_from_the_table_and_the_lock():
    stages = dag.load_table()
    assert (ROOT / "dvc.yaml").read_text() == dag.render_dvc(stages), "run: python -m pipelines.dag write"
    for family, text in dag.family_packages(stages).items():
        path = ROOT / dag.PACKAGES.format(family=family)
        assert path.read_text() == text, f"{path.name} does not follow requirements.lock: make dag"


def test_code_deps_are_the_imports():
    """Each stage depends on the files of the modules it imports, at any depth: the training stack for
    the training stages, never for the others (an edit to the mesh re-runs only what trains)."""
    stages = dag.load_table()
    training = {"stages/common/loop.py", "stages/common/mesh.py", "stages/common/pipeline.py"}
    for name in ("pretrain", "extend_context", "finetune_qlora", "memory_study"):
        assert training <= set(stages[name].deps), name
    for name in ("prepare_data", "tokenize", "eval_perplexity", "context_study", "train_gnn", "report"):
        assert not training & set(stages[name].deps), name
    assert "stages/pretrain.py" in stages["memory_study"].deps, "memory_study builds pretrain's model"
    assert "stages/models/gnn.py" in stages["train_gnn"].deps
    assert "pipelines/packages/gnn.txt" in stages["train_gnn"].deps
    assert "pipelines/packages/lm.txt" in stages["pretrain"].deps
    lm = (ROOT / "pipelines/packages/lm.txt").read_text()
    assert "\ntorch==" in lm and "\ntransformers==" in lm and "\npeft==" in lm
    assert "pytest" not in lm and "ruff" not in lm and "snakemake" not in lm, "test and runner packages re-run nothing"


def test_a_new_import_becomes_a_dep_and_a_hand_written_code_dep_is_refused(tmp_path):
    root = copy_repo(tmp_path)
    module = root / "stages/prepare_data.py"
    module.write_text(module.read_text() + "\n\ndef _later():\n    from stages.common import shards  # noqa: F401\n")
    assert "stages/common/shards.py" in dag.load_table(root / "pipelines/stages.yaml")["prepare_data"].deps
    table = root / "pipelines/stages.yaml"
    text = table.read_text().replace("deps: [data/prepare_data]", "deps: [data/prepare_data, stages/x.py]", 1)
    table.write_text(text)
    with pytest.raises(dag.TableError, match=r"stage tokenize: deps \['stages/x.py'\]: a stage's code deps come"):
        dag.load_table(table)


def test_the_import_contracts_hold_and_a_broken_layer_is_named(tmp_path):
    """lint-imports (make lint) checks the layers written in pyproject.toml: it passes on the code, and
    fails naming the contract when the shared code imports a stage."""

    def lint(root):
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)

    for name in ("stages", "pipelines"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = lint(tmp_path)
    assert kept.returncode == 0 and "0 broken" in kept.stdout, kept.stdout + kept.stderr
    losses = tmp_path / "stages/common/losses.py"
    losses.write_text(losses.read_text() + "\nfrom stages import pretrain  # noqa: E402, F401\n")
    broken = lint(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "the shared code and the models never import a stage BROKEN" in broken.stdout, broken.stdout
    assert "stages.common.losses -> stages.pretrain" in broken.stdout, broken.stdout


def test_the_docs_draw_the_current_graph(tmp_path):
    """docs/pipeline.md's mermaid block is what `dvc dag --mermaid` prints for this dvc.yaml, and the
    README's picture names every stage and foreach item."""
    repo = copy_repo(tmp_path)
    shown = subprocess.run(["dvc", "dag", "--mermaid"], cwd=repo, capture_output=True, text=True, check=True).stdout
    page = (ROOT / "docs/pipeline.md").read_text()
    block = page.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block.strip() == shown.strip(), "paste `dvc dag --mermaid` into docs/pipeline.md's mermaid block"
    picture = next(block for block in (ROOT / "README.md").read_text().split("```") if "──>" in block)
    drawn = set(re.findall(r"[a-z_]+(?:@\{[a-z0-9_,]+\}|@[a-z0-9_]+)?", picture))
    for st in dag.load_table().values():
        for job, _ in st.instances():
            stage, _, item = job.partition("@")
            assert job in drawn or any(
                d.startswith(f"{stage}@{{") and item in d[len(stage) + 2 : -1].split(",") for d in drawn
            ), f"the README's picture of the pipeline does not name {job}"


def test_dvc_and_snakemake_see_the_same_stages():
    assert dag.disagreements(ROOT) == []
    stages = dag.dvc_view(ROOT)
    expected = [name for st in dag.load_table().values() for name, _ in st.instances()]
    assert list(stages) == expected, "every table stage (each foreach item) reaches DVC"
    assert stages["tokenize"]["deps"].count("data/prepare_data") == 1
    report = stages["report"]
    assert {"data/prepare_data", "data/tokenize"} <= set(report["deps"]), "report collects every other stage"


def test_the_committed_dvc_lock_is_the_current_dag_on_the_current_params():
    """dvc.lock (the tiny default's run, committed so that `dvc exp show` and `dvc metrics show` have
    main's figures) holds every stage of dvc.yaml with its command, dependencies, outputs and the values
    of its params sections in params.yaml. After changing any of those: `make run`, commit dvc.lock."""
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "dvc.lock"], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0, "dvc.lock is not committed"
    from ruamel.yaml import YAML

    yaml12 = YAML(typ="safe")  # YAML 1.2, as DVC reads them (5e-05 is a float)
    lock = yaml12.load((ROOT / "dvc.lock").read_text())["stages"]
    params = yaml12.load((ROOT / "params.yaml").read_text())
    stages = dag.dvc_view(ROOT)
    assert sorted(lock) == sorted(stages), "dvc.lock is not of this DAG: run `make run` and commit dvc.lock"
    for name, stage in stages.items():
        entry = lock[name]
        problems = []
        if entry["cmd"] != stage["cmd"]:
            problems.append("its command")
        if sorted(d["path"] for d in entry.get("deps", [])) != stage["deps"]:
            problems.append("its dependencies")
        if sorted(o["path"] for o in entry["outs"]) != stage["outs"]:
            problems.append("its outputs")
        locked = entry.get("params", {}).get("params.yaml", {})
        changed = [k for k in stage["params"] if locked.get(k) != sync.param(params, k)]  # (base.model: a dotted key)
        if changed:
            problems.append(f"params {changed}")
        differs = ", ".join(problems)
        assert not problems, f"dvc.lock: stage {name} differs in {differs}: `make run`, then commit dvc.lock"


def test_a_dep_edited_in_dvc_yaml_only_is_caught(tmp_path):
    root = copy_repo(tmp_path)
    doc = yaml.safe_load((root / "dvc.yaml").read_text())
    doc["stages"]["tokenize"]["deps"].append("stages/common/sources.py")
    (root / "dvc.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    problems = dag.disagreements(root)
    assert len(problems) == 1 and problems[0].startswith("stage tokenize: deps differ")


def test_an_output_edited_in_the_table_only_is_caught(tmp_path):
    root = copy_repo(tmp_path)
    table = root / "pipelines/stages.yaml"
    table.write_text(table.read_text().replace("outs: [data/tokenize]", "outs: [data/tokenize, data/extra.bin]"))
    problems = dag.disagreements(root)
    assert any(p.startswith("stage tokenize: outs differ") for p in problems), problems


def test_foreach_stages_map_to_dvc_foreach_and_snakemake_wildcards(tmp_path):
    root = copy_repo(tmp_path)
    table = root / "pipelines/stages.yaml"
    doc = yaml.safe_load(table.read_text())
    doc["stages"]["per_model"] = {
        "args": "--model ${item} --output data/per_model/${item}",
        "deps": ["data/tokenize"],
        "params": ["report"],
        "outs": ["data/per_model/${item}"],
        "metrics": ["data/per_model/${item}/metrics.json"],
        "foreach": ["small", "large"],
        "measured": ["json", "png"],
    }
    table.write_text(yaml.safe_dump(doc, sort_keys=False))
    (root / "stages/per_model.py").write_text("from stages import report  # noqa: F401\n")
    (root / "dvc.yaml").write_text(dag.render_dvc(dag.load_table(table)))
    stages = dag.dvc_view(root)
    assert {"per_model@small", "per_model@large"} <= set(stages)
    measured = ["measured/per_model/large.json", "measured/per_model/large.png"]
    assert stages["per_model@large"]["outs"] == ["data/per_model/large", *measured]
    assert stages["per_model@large"]["cmd"].endswith("--measured measured/per_model/large.json")
    assert "data/per_model/small" in stages["report"]["deps"], "report collects each instance"
    assert "measured/per_model/small.json" in stages["report"]["deps"], "and what each measured"
    assert " measured/per_model/small.json " in stages["report"]["cmd"].split("--measured-inputs")[1]
    assert dag.disagreements(root) == []
    generated = yaml.safe_load((root / "dvc.yaml").read_text())
    body = generated["stages"]["per_model"]
    assert body["foreach"] == ["small", "large"] and "${item}" in body["do"]["cmd"]
    # measured files: outs DVC does not cache (committed to git with dvc.lock); the plot is a DVC plot
    assert body["do"]["outs"][1:] == [{f"measured/per_model/${{item}}.{k}": {"cache": False}} for k in ("json", "png")]
    assert "measured/per_model/small.png" in generated["plots"]


def test_unknown_table_key_is_an_error(tmp_path):
    table = tmp_path / "stages.yaml"
    table.write_text("stages:\n  tokenize:\n    args: x\n    output: [y]\n")
    with pytest.raises(dag.TableError, match="stage tokenize: unknown key\\(s\\) \\['output'\\]"):
        dag.load_table(table)


@pytest.mark.parametrize("measured", [["png"], ["json", "csv"], ["json", "json"]])
def test_a_bad_measured_entry_is_an_error(tmp_path, measured):
    table = tmp_path / "stages.yaml"
    table.write_text(yaml.safe_dump({"stages": {"tokenize": {"args": "x", "measured": measured}}}))
    with pytest.raises(dag.TableError, match=r"stage tokenize: measured .*: use \[json\] or \[json, png\]"):
        dag.load_table(table)


def test_a_bad_params_key_stops_snakemake_before_any_job(tmp_path):
    """Snakemake removes a job's old outputs before it runs; a stage that then fails on its params would
    leave the pipeline without them. The Snakefile checks every section when it loads instead."""
    repo = copy_repo(tmp_path)
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("\n  context_length: 256", "\n  context_length: 256\n  stpes: 30", 1))
    (repo / "data/pretrain").mkdir(parents=True)
    (repo / "data/pretrain/meta.json").write_text("{}")
    proc = subprocess.run(["snakemake", "--cores", "1", "data/pretrain"], cwd=repo, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "unknown key pretrain.stpes; valid keys are:" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert (repo / "data/pretrain/meta.json").read_text() == "{}", "the old output is untouched"


def test_a_params_check_that_passed_is_not_made_again_until_the_params_change(tmp_path, monkeypatch):
    """The Snakefile's check imports every stage (and torch) once per params and stage code: a memo of
    the last check that passed spares the next invocations that, and never lets a bad key through."""
    params, memo = ci_params(tmp_path), tmp_path / ".snakemake/params-checked"
    dag.check_params(params, memo=memo)
    assert memo.is_file()
    import importlib

    def no_import(name, *args):
        raise AssertionError(f"imported {name} for params already checked")

    monkeypatch.setattr(importlib, "import_module", no_import)
    dag.check_params(params, memo=memo)  # the same params and code: not checked again
    monkeypatch.undo()
    params.write_text(params.read_text().replace("\n  context_length: 64", "\n  context_length: 64\n  stpes: 3", 1))
    with pytest.raises(config.ConfigError, match="unknown key pretrain.stpes"):
        dag.check_params(params, memo=memo)


def test_only_what_dvc_would_rerun_is_made_stale_for_snakemake():
    from pipelines.sync import is_stale

    assert is_stale([{"changed deps": {"params.yaml": {"modified": ["context_study.unscaled_growth"]}}}])
    assert is_stale([{"changed deps": {"stages/pretrain.py": "modified"}}]) and is_stale(["changed command"])
    assert is_stale([{"changed outs": {"data/pretrain": "modified"}}])
    assert not is_stale([{"changed outs": {"data/pretrain": "not in cache"}}]), "after dvc gc: still current"
    assert not is_stale([{"changed deps": {"stages/pretrain.py": "new"}}]), "no dvc.lock entry to compare with"


def test_dvcs_plan_is_the_stages_it_reruns_and_everything_downstream():
    """pipelines.sync compares `snakemake -n` with this plan: a stage DVC re-runs, and every stage reading what
    it writes, by rule name; outputs missing only from the cache re-run nothing."""
    from pipelines.sync import dvc_plan

    params = [{"changed deps": {"params.yaml": {"context_study": "modified"}}}]
    assert dvc_plan({"context_study": params}, ROOT) == {"context_study", "report"}
    after_pretrain = {"pretrain", "extend_context", "finetune_qlora", "eval_perplexity", "eval_harness"}
    assert dvc_plan({"pretrain": ["changed command"]}, ROOT) == after_pretrain | {"context_study", "report"}
    assert dvc_plan({"train_gnn": [{"changed outs": {"data/train_gnn": "deleted"}}]}, ROOT) == {"train_gnn", "report"}
    assert dvc_plan({"train_gnn": [{"changed outs": {"data/train_gnn": "not in cache"}}]}, ROOT) == set()
    assert dvc_plan({}, ROOT) == set()


def test_the_incomplete_marks_of_a_dead_snakemake_are_read_as_snakemake_writes_them(tmp_path):
    """pipelines.sync reads the outputs Snakemake marked incomplete from Snakemake's own file layout: its
    record paths (written here by Snakemake's code, with names cut short so long paths are split), and
    only outputs that DVC records as current and that exist are handed back to be forgotten."""
    from types import SimpleNamespace

    from snakemake.persistence.file import FilePersistence

    from pipelines import sync

    base = tmp_path / ".snakemake" / "incomplete"
    base.mkdir(parents=True)
    (base / "migration_underway").touch()
    writer = SimpleNamespace(_fetch_max_len=lambda subject: 16)
    names = ["data/pretrain", "data/finetune_qlora/nf4", "data/eval_perplexity/" + "p" * 60]
    for name in names:
        marker = Path(FilePersistence._record_path(writer, str(base), name))
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text('{"external_jobid": null}')
    assert len(list(base.rglob("*"))) > len(names) + 1, "long names are split into folders"
    assert sync.marked_incomplete(tmp_path) == set(names)

    shutil.copytree(ROOT / "pipelines", tmp_path / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    for out in ("data/pretrain", "data/finetune_qlora/nf4"):
        (tmp_path / out).mkdir(parents=True)
    # pretrain current, finetune_qlora@nf4 changed (DVC re-runs it): only pretrain's mark is stale
    status = {"finetune_qlora@nf4": [{"changed deps": {"params.yaml": "modified"}}]}
    assert sync.finished_unrecorded(status, tmp_path) == ["data/pretrain"]
    assert sync.finished_unrecorded(status, tmp_path / "data") == []  # (no marks there)


def test_two_pipelines_started_at_once_in_one_directory_one_runs_and_the_other_stops(tmp_path, mirror):
    """Snakemake's own directory lock is checked, then written: two invocations started together can both
    pass it. The Snakefile's flock lets exactly one run; the other stops with one message before any job,
    and the first one's outputs and dvc.lock entry are whole. A dry run beside a running one still plans."""
    repo = copy_repo(tmp_path)
    ci_params(repo)
    env = stage_env(repo)
    cmd = ["snakemake", "--cores", "1", "prepare_data"]
    procs = [subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    procs.append(subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) != [0, 0] and 0 in codes, f"exactly one runs: {codes}\n{outs[0][-2000:]}\n{outs[1][-2000:]}"
    stopped = outs[codes.index(0) ^ 1]
    assert re.search(r"another pipeline is running in this directory \(pid \d+ on \S+, started ", stopped), stopped
    assert "wait for it to finish or stop it" in stopped and "Job stats" not in stopped, "stopped before any job"
    status = subprocess.run(["dvc", "status", "prepare_data"], cwd=repo, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout + status.stderr
    assert json.loads((repo / "data/prepare_data/metrics.json").read_text())

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pipelines import commit; "
            "commit.hold_pipeline_lock(); print('held', flush=True); time.sleep(60)",
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        plan = subprocess.run(
            ["snakemake", "--cores", "1", "-n", "prepare_data"], cwd=repo, env=env, capture_output=True, text=True
        )
        assert plan.returncode == 0 and "not syncing with DVC" in plan.stderr, plan.stderr[-2000:]
        run = subprocess.run(
            ["snakemake", "--cores", "1", "-F", "prepare_data"], cwd=repo, env=env, capture_output=True, text=True
        )
        assert run.returncode != 0 and f"(pid {holder.pid} on " in run.stderr, run.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait()
    # The lock went with its holder's SIGKILL: no --unlock needed.
    again = subprocess.run(
        ["snakemake", "--cores", "1", "prepare_data"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stderr[-2000:]
