"""On a copy of the shared ci run (tests/shared_run.py), what a finished pipeline leaves and what a user
may do to it next: the model registry it filled (lineage from dvc.lock, the alias `reproduced` by the
report's rows, models read back by alias); a dvc.lock emptied by a kill during a commit, restored;
the environment's snakemake started by its path; an invocation whose stage fails before it opens its
MLflow run, recorded FAILED under either tool; outputs checked out after a run with other params,
current for both tools; an edit to a module the training stages import, and an output changed in
place, seen alike by both tools; `pipelines.verify` on the run, and on each link
broken once. tests/test_e2e.py checks that both tools agree on
what is current."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shared_run import copy_of_run, env_for, sh, shared_run
from test_e2e import DOWNSTREAM, UP_TO_DATE, set_growth, snakemake_ran

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def clone(tmp_path_factory, mirror) -> Path:
    return copy_of_run(tmp_path_factory.mktemp("records") / "clone")


def test_models_are_registered_with_their_lineage_and_read_by_alias(clone):
    """After a whole pipeline: every published model is a registered version whose lineage is dvc.lock's,
    the report set the alias `reproduced` on the models whose rows pass, and eval_perplexity reads a
    registered model by alias with the numbers of its folder."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    variants = [
        f"extend_context-{v}" for v in json.loads((clone / "data/extend_context/meta.json").read_text())["variants"]
    ]
    models = {m.name: m for m in client.search_registered_models()}
    assert set(models) == {"pretrain", "finetune_qlora-nf4", "finetune_qlora-none", *variants}
    lock = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    for stage, name, deps in (
        ("pretrain", "pretrain", ["data/tokenize"]),
        ("extend_context", variants[0], ["data/tokenize"]),
        ("finetune_qlora@nf4", "finetune_qlora-nf4", []),
    ):
        (version,) = client.search_model_versions(f"name = '{name}'")
        assert version.tags["output_dvc_md5"] == lock[stage]["outs"][0]["md5"], name
        for dep in lock[stage]["deps"]:
            if dep["path"] in deps:
                assert version.tags[f"input.{dep['path']}"] == dep["md5"], (name, dep["path"])
    results = json.loads((clone / "reports/results.json").read_text())
    nf4 = [r["pass"] for r in results["rows"] if r["stage"] == "finetune_qlora/nf4"]
    expected = {"pretrain", *variants} | ({"finetune_qlora-nf4"} if nf4 and all(nf4) else set())
    assert {name for name, m in models.items() if "reproduced" in m.aliases} == expected
    sh(
        "python -m stages.eval_perplexity --models folder=data/pretrain/model models:/pretrain@reproduced "
        "--input data/tokenize --output ../registered_eval contexts=[64] max_tokens=4000",
        clone,
    )
    figures = json.loads((clone.parent / "registered_eval/figures.json").read_text())["models"]
    assert figures["pretrain"]["ctx64"]["nll"] == figures["folder"]["ctx64"]["nll"]


def test_stage_runs_name_their_inputs_dvc_md5s_and_each_version_comes_from_a_logged_model(tmp_path):
    """On the shared run (read only; its MLflow store copied): every stage run's datasets are its data deps
    with the md5s dvc.lock records for them; every registered version comes from a READY logged model of
    its run, with metrics; search_logged_models ranks the finetune_qlora models by eval_loss."""
    import mlflow

    run = shared_run()
    shutil.copy(run / "mlflow.db", tmp_path / "mlflow.db")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipeline").experiment_id
    lock = yaml.safe_load((run / "dvc.lock").read_text())["stages"]
    stage_runs = [r for r in client.search_runs([exp], max_results=1000) if r.data.tags.get("stage")]
    reading = {name for name, st in lock.items() if any(d["path"].startswith("data/") for d in st.get("deps", []))}
    assert reading <= {r.info.run_name for r in stage_runs} <= set(lock), "a run (or more) per stage of dvc.lock"
    for r in stage_runs:
        recorded = {d.dataset.name: d.dataset for d in r.inputs.dataset_inputs}
        deps = {d["path"]: d["md5"] for d in lock[r.info.run_name]["deps"] if d["path"].startswith("data/")}
        assert {name: d.digest for name, d in recorded.items()} == deps, r.info.run_name
        assert {d.source_type for d in recorded.values()} <= {"dvc"}
    versions = client.search_model_versions(max_results=1000)
    assert len(versions) >= 4, [v.name for v in versions]
    for version in versions:
        model = client.get_logged_model(version.source.removeprefix("models:/"))
        assert (model.name, model.source_run_id, model.status) == (version.name, version.run_id, "READY")
        assert model.metrics and model.tags["output_dvc_md5"] == version.tags["output_dvc_md5"], version.name
    ranked = client.search_logged_models(
        [exp],
        filter_string="name LIKE 'finetune_qlora-%'",
        order_by=[{"field_name": "metrics.eval_loss", "ascending": True}],
    )
    losses = [(m.name, {x.key: x.value for x in m.metrics}["eval_loss"]) for m in ranked]
    published = {
        f"finetune_qlora-{q}": json.loads((run / f"data/finetune_qlora/{q}/metrics.json").read_text())["eval_loss"]
        for q in ("nf4", "none")
    }
    assert sorted(losses, key=lambda x: x[1]) == losses and dict(losses) == published
    # each checkpoint a training stage published: a logged model of its step, marked removed once the stage's
    # output was (pretrain's at step 5 of 10; each fine-tuned context variant's at step 1 of 2)
    checkpoints = client.search_logged_models([exp], filter_string="model_type = 'checkpoint'", max_results=1000)
    by_name = {m.name: m for m in checkpoints}
    assert "pretrain-step-5" in by_name and any(n.startswith("extend_context-") for n in by_name), sorted(by_name)
    for model in checkpoints:  # (their files are gone: the stages published their outputs)
        assert model.tags["checkpoint.kept"] == "false" and "published" in model.tags["checkpoint.removed"], model.name
    model = by_name["pretrain-step-5"]
    (pretrain_run,) = [r for r in stage_runs if r.info.run_name == "pretrain"]
    at_5 = {m.key: m.value for m in model.metrics if m.step == 5}
    assert at_5["loss"] == next(
        m.value for m in client.get_metric_history(pretrain_run.info.run_id, "loss") if m.step == 5
    )
    assert len([m for m in client.get_metric_history(pretrain_run.info.run_id, "loss") if m.step == 5]) == 1


def test_a_dvc_lock_emptied_mid_commit_is_restored_when_snakemake_loads(clone):
    # dvc.lock emptied by a kill in the middle of a `dvc commit`: Snakemake restores its last good copy
    # when it loads (every load refreshes that copy), and both tools see everything current again.
    sh("snakemake --cores 2 -n", clone)
    (clone / "dvc.lock").write_text("")
    out = sh("snakemake --cores 2 -n", clone)
    assert "dvc.lock was damaged (it holds no stages)" in out and "Nothing to be done" in out, out[-3000:]
    assert UP_TO_DATE in sh("dvc status", clone)


def test_the_environments_snakemake_started_by_its_path_runs_its_own_tools(clone):
    # The environment's snakemake started by its path, without the environment on PATH: the rules run its
    # python and dvc, not the system's.
    bare = {**env_for(clone), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "snakemake"),
            "context_study",
            "--cores",
            "2",
            "--forcerun",
            "context_study",
        ],
        cwd=clone,
        env=bare,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and snakemake_ran(proc.stdout + proc.stderr) == {"context_study"}, proc.stderr[-3000:]
    assert "context_study:" not in sh("dvc status", clone), "the rule's dvc commit ran too"


def test_a_stage_failing_before_its_run_opens_marks_the_invocation_failed_under_both_tools(clone):
    import mlflow

    # A stage that stops before it opens its MLflow run still marks its invocation's run FAILED. Under
    # DVC: bad params. Under Snakemake (its load checks params before any job): a damaged input, with
    # PIPELINE_NO_SYNC so that it does not first re-run the stage that wrote it.
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline").experiment_id

    def failed_parents() -> list:
        return client.search_runs([experiment], "tags.pipeline_role = 'parent' and attributes.status = 'FAILED'")

    params = (clone / "params.yaml").read_text()
    try:
        set_growth(clone, 0.5)
        proc = subprocess.run(
            "dvc repro context_study", shell=True, cwd=clone, env=env_for(clone), capture_output=True, text=True
        )
        assert proc.returncode != 0 and "unscaled_growth must be >= 1" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    finally:
        (clone / "params.yaml").write_text(params)
    (failed,) = failed_parents()
    assert failed.data.tags["pipeline_run"].startswith("dvc-")
    assert failed.data.tags["unfinished_stages"] == "context_study:FAILED"

    figures = clone / "data/eval_perplexity/extend_context/figures.json"
    saved = figures.read_bytes()
    figures.unlink()
    try:
        proc = subprocess.run(
            "snakemake --cores 2 --forcerun context_study context_study",
            shell=True,
            cwd=clone,
            env={**env_for(clone), "PIPELINE_NO_SYNC": "1"},
            capture_output=True,
            text=True,
        )
        assert proc.returncode != 0 and "figures.json not found" in (clone / "logs/context_study.log").read_text()
    finally:
        figures.write_bytes(saved)
        sh("dvc checkout context_study", clone)  # Snakemake removed the failed job's output
    smk = [r for r in failed_parents() if r.data.tags["pipeline_run"].startswith("smk-")]
    assert len(smk) == 1 and smk[0].data.tags["unfinished_stages"] == "context_study:FAILED"
    assert UP_TO_DATE in sh("dvc status", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)


def planned(clone: Path) -> set[str]:
    return snakemake_ran(sh("snakemake --cores 2 -n", clone))


def test_an_edit_to_an_imported_module_reruns_what_imports_it_and_what_follows(clone):
    """stages/common/mesh.py is no stage's own file: the training stages import it through the loop.
    Both tools name those stages, Snakemake with everything downstream of them, and nothing else."""
    mesh = clone / "stages/common/mesh.py"
    source = mesh.read_text()
    try:
        mesh.write_text(source + "\n# an edit\n")
        training = {"pretrain", "extend_context", "finetune_qlora@nf4", "finetune_qlora@none", "memory_study"}
        assert set(json.loads(sh("dvc status --json", clone))) == training
        downstream = {"eval_perplexity", "eval_harness", "context_study", "report"}
        assert planned(clone) == {"pretrain", "extend_context", "finetune_qlora", "memory_study", *downstream}
    finally:
        mesh.write_text(source)
    assert UP_TO_DATE in sh("dvc status", clone)
    # A new version of a package the language-model stages import (as after `make lock`): each of them,
    # not train_gnn, whose family pins its own list.
    packages = clone / "pipelines/packages/lm.txt"
    pinned = packages.read_text()
    try:
        packages.write_text(re.sub(r"\ntransformers==\S+", "\ntransformers==99.0.0", pinned))
        assert pinned != packages.read_text()
        lm = {"prepare_data", "tokenize", "pretrain", "extend_context", "context_study", "memory_study", "report"}
        lm |= {f"finetune_qlora@{q}" for q in ("nf4", "none")}
        lm |= {f"{s}@{m}" for s in ("eval_perplexity", "eval_harness") for m in ("pretrain", "extend_context")}
        assert set(json.loads(sh("dvc status --json", clone))) == lm
    finally:
        packages.write_text(pinned)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)


def test_outputs_checked_out_after_a_run_with_other_params_are_current_for_both_tools(tmp_path, mirror):
    """context_study run by Snakemake with another unscaled_growth, then `git checkout params.yaml dvc.lock
    && dvc checkout`: DVC finds every stage current, while Snakemake's records of data/context_study still
    hold the other params, for which it would re-run it and the report (pipelines.sync's comparison of the
    two plans names that). The Snakefile forgets those records when it loads: then neither tool plans
    anything, and `python -m pipelines.sync` finds them aligned."""
    clone = copy_of_run(tmp_path / "clone")
    sh("git add dvc.lock params.yaml measured && git -c user.name=ci -c user.email=ci@localhost commit -qm run", clone)
    set_growth(clone, 1.3)
    assert snakemake_ran(sh("snakemake --cores 2 data/context_study", clone)) == {"context_study"}
    sh("git checkout params.yaml dvc.lock && dvc checkout", clone)
    assert UP_TO_DATE in sh("dvc status", clone)
    compare = "from pathlib import Path; from pipelines import sync; print(sync.plans_differ(sync.dvc_status(Path())))"
    differ = sh(f'python -c "{compare}"', clone)
    assert "snakemake -n would run ['context_study', 'report'], dvc repro nothing" in differ

    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert UP_TO_DATE in sh("dvc status", clone)
    assert sh("python -m pipelines.sync", clone).startswith("aligned: nothing to do")


def test_an_output_changed_in_place_is_remade_by_both_tools(clone):
    """An output edited by hand: DVC flags its stage, and Snakemake re-makes it and what follows, for a
    stage that reads only code (prepare_data; a plan: its re-run is the whole pipeline) and for one that
    reads folders (context_study: re-run, then both tools find everything current)."""
    corpus = clone / "data/prepare_data/corpus/train.txt"
    text = corpus.read_bytes()
    try:
        corpus.write_bytes(text + b"x\n")
        status = json.loads(sh("dvc status --json", clone))
        assert status["prepare_data"] == [{"changed outs": {"data/prepare_data": "modified"}}]
        everything = {"prepare_data", *DOWNSTREAM, "finetune_qlora", "eval_perplexity", "eval_harness", "train_gnn"}
        assert planned(clone) == everything
    finally:
        corpus.write_bytes(text)
    assert UP_TO_DATE in sh("dvc status", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone), "Snakemake's records come back whole"

    study = clone / "data/context_study/study.md"
    study.write_text(study.read_text() + "\nan edit\n")
    assert set(json.loads(sh("dvc status --json", clone))) == {"context_study", "report"}
    assert snakemake_ran(sh("snakemake --cores 2", clone)) == {"context_study", "report"}
    assert "an edit" not in study.read_text()
    assert UP_TO_DATE in sh("dvc status", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)


def test_verify_holds_after_a_run_and_names_each_broken_link(clone):
    """`python -m pipelines.verify` on the run: every link holds. Then links broken (a reproduced figure, a
    model file, dvc.lock, a registry tag at once; then the code): it exits 1 naming each."""
    import mlflow

    out = sh("python -m pipelines.verify", clone)
    assert "every link holds" in out and "BROKEN" not in out, out
    for link in ("report", "outs", "causes", "registry", "checkpoints"):
        assert re.search(rf"^ok +{link} ", out, re.M), link

    def broken() -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "pipelines.verify"], cwd=clone, env=env_for(clone), capture_output=True, text=True
        )
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    def edited(path: Path, change) -> str:
        saved = path.read_bytes()
        try:
            change(path)
            return broken()
        finally:
            path.write_bytes(saved)

    def one_more(path: Path) -> None:
        rows = json.loads(path.read_text())
        rows[0]["ours"] += 1
        path.write_text(json.dumps(rows))

    # Four links broken at once (verify reports every link): a reproduced figure, a model file, the record
    # of an out in dvc.lock, a registry tag.
    results = clone / "data/train_gnn/results.json"
    row = json.loads(results.read_text())[0]["result"]
    lock = yaml.safe_load((clone / "dvc.lock").read_text())
    md5 = next(o["md5"] for o in lock["stages"]["tokenize"]["outs"])
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    (version,) = client.search_model_versions("name = 'pretrain'")
    recorded = version.tags["output_dvc_md5"]
    config_json = clone / "data/pretrain/model/config.json"
    saved = {p: p.read_bytes() for p in (results, config_json, clone / "dvc.lock")}
    try:
        one_more(results)
        config_json.write_text(config_json.read_text() + " ")
        (clone / "dvc.lock").write_text((clone / "dvc.lock").read_text().replace(md5, "0" * 32 + ".dir"))
        client.set_model_version_tag("pretrain", version.version, "output_dvc_md5", "0" * 32 + ".dir")
        out = broken()
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
        client.set_model_version_tag("pretrain", version.version, "output_dvc_md5", recorded)
    assert re.search(rf"^BROKEN +report +row '{re.escape(row)}' shows", out, re.M), out
    assert re.search(r"^BROKEN +outs +data/train_gnn is modified against dvc.lock", out, re.M), out
    assert re.search(r"^BROKEN +outs +data/pretrain is modified .*mend: dvc checkout --force data/pretrain", out, re.M)
    assert re.search(r"^BROKEN +outs +data/tokenize is [\w ]+ against dvc.lock", out, re.M), out  # (not in cache)
    assert re.search(r"^BROKEN +registry +models:/pretrain \(data/pretrain, stage pretrain\): no version", out, re.M)

    # An edit that breaks the module's import: each stage importing it is named, and the run goes on.
    out = edited(clone / "stages/common/mesh.py", lambda p: p.write_text(p.read_text() + "\nan_edit\n"))
    assert re.search(r"^BROKEN +causes +stage pretrain: changed since dvc.lock: .*stages/common/mesh.py", out, re.M)
    assert not re.search(r"^BROKEN +causes +stage prepare_data", out, re.M), out
    assert re.search(
        r"^BROKEN +registry +models:/pretrain .* stages.pretrain does not import now \(NameError", out, re.M
    )
    assert re.search(r"^ok +checkpoints ", out, re.M), out

    # Against a published dvc.lock: each out identical, or (an out made again elsewhere) differing.
    published = clone.parent / "published.lock"
    published.write_text((clone / "dvc.lock").read_text().replace(md5, "1" * 32 + ".dir"))
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.verify", "--against", str(published)],
        cwd=clone,
        env=env_for(clone),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and re.search(r"^differs +data/tokenize$", proc.stdout, re.M), proc.stdout
    paths = {o["path"] for s in lock["stages"].values() for o in s["outs"]}
    measured = {p for p in paths if p.startswith("measured/")}  # timings: listed, never compared
    assert len(measured) == 13 and all(re.search(rf"^measured +{re.escape(m)}$", proc.stdout, re.M) for m in measured)
    outs = len(paths - measured)
    assert f"{outs - 1} identical, 0 within the recorded tolerance, 1 differs, 13 measured" in proc.stdout
    assert "every link holds" in sh("python -m pipelines.verify", clone)
