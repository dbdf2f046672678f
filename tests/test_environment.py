"""The packages a stage runs on against those its family records (stages/common/environment.py): the
check every stage makes before any compute, the opt-out and what its records then say, and what
`python -m pipelines.verify` reports. In-process, with the installed versions faked."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from shared_run import shared_run

from pipelines import verify
from stages import prepare_data
from stages.common import atomic, config, environment, stage
from stages.common.tracking import runs

ROOT = Path(__file__).resolve().parent.parent
MEASURED_IMAGE = environment.current_image  # (the tests run outside any container but where one is asked for)
GNN = "pipelines/packages/gnn.txt"
LM = "pipelines/packages/lm.txt"


@pytest.fixture(autouse=True)
def installed_found_afresh():
    """What a test found installed (with fake distributions on sys.path) is forgotten after its sys.path is
    restored: the tests after it in this process find the environment's own packages."""
    found = environment.installed  # (the cached function, whatever a test puts in its place)
    yield
    found.cache_clear()


def install(monkeypatch, **versions) -> None:
    """Fake the installed packages: every version the family files record, but for `versions`
    (name with underscores for dashes: a version, or None for not installed)."""
    have = {}
    for name in (GNN, LM):
        have |= {environment.normalized(n): v for n, v in environment.recorded(ROOT / name).items()}
    for name, version in versions.items():
        have[environment.normalized(name)] = version
    monkeypatch.setattr(environment, "installed", lambda: {k: v for k, v in have.items() if v is not None})


@pytest.fixture(autouse=True)
def by_hand(monkeypatch):
    """A stage started by hand, with the default choice, outside any container (whatever runs the tests)."""
    for key in ("PIPELINE_ENVIRONMENT", "DVC_ROOT", "PIPELINE_SNAKEMAKE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(environment, "current_image", lambda: None)


def checkout(folder: Path) -> Path:
    """A checkout's files that a run's environment record reads: the stage table, the family files and
    requirements.lock, copied into `folder`."""
    for name in (environment.TABLE, GNN, LM, environment.LOCK):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes((ROOT / name).read_bytes())
    return folder


def fake_distribution(site: Path, name: str, version: str) -> None:
    """An installed distribution as importlib.metadata finds it on sys.path: its .dist-info folder."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_a_runs_record_is_measured_from_the_installed_metadata_and_the_lock_found_then(tmp_path, monkeypatch):
    root = checkout(tmp_path / "repo")
    environment.installed.cache_clear()
    try:
        fake_distribution(tmp_path / "site-a", "xxhash", "9.0.0")
        monkeypatch.syspath_prepend(str(tmp_path / "site-a"))  # (found first, as an import would find it)
        before = environment.run_record("prepare_data", root)
        environment.installed.cache_clear()
        monkeypatch.syspath_prepend(str(tmp_path / "site-b"))
        fake_distribution(tmp_path / "site-b", "xxhash", "9.0.1")
        after = environment.run_record("prepare_data", root)
    finally:
        environment.installed.cache_clear()
    assert before["packages"]["xxhash"] == "9.0.0" and after["packages"]["xxhash"] == "9.0.1"
    assert before["container_family"] == "lm" and "image" not in before  # (no container: no image key)
    assert before["lock_sha256"] == hashlib.sha256((root / environment.LOCK).read_bytes()).hexdigest()
    assert before["packages_sha256"] != after["packages_sha256"]
    assert environment.record_changes(before, after) == [("xxhash", "9.0.0", "9.0.1")]
    with open(root / environment.LOCK, "a") as fh:
        fh.write("# edited\n")
    edited = environment.run_record("prepare_data", root)
    (change,) = environment.record_changes(after, edited)
    assert change == (environment.LOCK, after["lock_sha256"][:12], edited["lock_sha256"][:12])
    tags = environment.tags_of(edited)
    assert tags["lock_sha256"] == edited["lock_sha256"] and tags["container_family"] == "lm"
    assert "xxhash==9.0.1" in tags["packages_installed"].split("\n")
    assert not any(k.startswith("image.") for k in tags)
    assert environment.tags_of(json.loads(json.dumps(edited, sort_keys=True))) == tags  # (as meta.json has it)


def test_outputs_of_two_runs_on_the_same_environment_record_it_byte_for_byte(tmp_path, monkeypatch):
    install(monkeypatch)
    first = tmp_path / "one.json"
    atomic.write_json(first, stage.code_record("pretrain"))
    have = environment.installed()
    monkeypatch.setattr(environment, "installed", lambda: dict(reversed(have.items())))  # (found in another order)
    atomic.write_json(tmp_path / "two.json", stage.code_record("pretrain"))
    assert first.read_bytes() == (tmp_path / "two.json").read_bytes()
    install(monkeypatch, torch="2.12.0")
    atomic.write_json(tmp_path / "three.json", stage.code_record("pretrain"))
    assert first.read_bytes() != (tmp_path / "three.json").read_bytes()


def test_an_apptainer_image_is_hashed_once_and_its_sidecar_trusted_while_size_and_mtime_hold(tmp_path):
    image = tmp_path / "lm.sif"
    image.write_bytes(b"an image")
    sidecar = tmp_path / "lm.sif.sha256"
    real = hashlib.sha256(b"an image").hexdigest()
    none = tmp_path / "no-containerenv"
    env = {"APPTAINER_CONTAINER": str(image)}
    assert environment.image_record(env, none) == {"runtime": "apptainer", "name": "lm.sif", "sha256": real}
    kept = json.loads(sidecar.read_text())
    assert kept == {"sha256": real, "size": 8, "mtime_ns": image.stat().st_mtime_ns}
    # While the image's size and mtime are the sidecar's, its sha256 is taken without reading the image.
    sidecar.write_text(json.dumps({**kept, "sha256": "f" * 64}))
    assert environment.image_sha256(image) == "f" * 64
    # Rebuilt (another mtime, or size): hashed again, the sidecar written again.
    os.utime(image, ns=(kept["mtime_ns"] + 10**9, kept["mtime_ns"] + 10**9))
    assert environment.image_sha256(image) == real
    assert json.loads(sidecar.read_text())["mtime_ns"] == kept["mtime_ns"] + 10**9
    image.write_bytes(b"another image")
    assert environment.image_sha256(image) == hashlib.sha256(b"another image").hexdigest()
    sidecar.write_text("not json")
    assert environment.image_sha256(image) == hashlib.sha256(b"another image").hexdigest()
    # Singularity's variable; an image this process cannot read is named without a digest.
    gone = {"SINGULARITY_CONTAINER": str(tmp_path / "gnn.sif")}
    assert environment.image_record(gone, none) == {"runtime": "singularity", "name": "gnn.sif"}


def test_a_podman_container_names_its_image_from_containerenv(tmp_path):
    file = tmp_path / ".containerenv"
    file.write_text(
        'engine="podman-4.9.3"\nname="tokenize"\nid="0123abcd"\nimage="localhost/pipeline-lm:latest"\n'
        'imageid="5f2e8c1d9a7b6e4f3c2d1a0b9e8f7d6c5b4a3928172635445362718190a1b2c3"\nrootless=1\n'
    )
    record = environment.image_record({}, file)
    assert record == {
        "runtime": "podman",
        "name": "localhost/pipeline-lm:latest",
        "id": "5f2e8c1d9a7b6e4f3c2d1a0b9e8f7d6c5b4a3928172635445362718190a1b2c3",
    }
    assert environment.image_label(record) == "podman localhost/pipeline-lm:latest 5f2e8c1d9a7b"
    file.write_text("")  # (a container run without --privileged: podman leaves the file empty)
    assert environment.image_record({"container": "podman"}, file) == {"runtime": "podman"}
    assert environment.image_record({"container": "docker"}, tmp_path / "none") == {"runtime": "docker"}
    assert environment.image_record({}, tmp_path / "none") is None


def test_a_stage_on_other_versions_than_its_family_records_stops_before_any_compute(monkeypatch):
    install(monkeypatch, torch_geometric="2.8.0.post1", xxhash=None)
    ran = []
    with pytest.raises(config.UserError) as refused:
        stage.launch("train_gnn", lambda rt, stop: ran.append(rt))
    line = str(refused.value)
    assert not ran
    assert "\n" not in line
    assert "torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; xxhash 4.1.0 recorded, not installed" in line
    assert GNN in line and "`make venv`" in line and "PIPELINE_ENVIRONMENT=any" in line
    # Another family's packages are not this stage's; a local label (torch's +cpu) is the pinned version.
    install(monkeypatch, torch_geometric="2.8.0.post1")
    environment.check("tokenize")
    install(monkeypatch, torch="2.13.0+cpu")
    environment.check("train_gnn")
    install(monkeypatch, torch="2.12.0")
    with pytest.raises(config.UserError, match="torch 2.13.0 recorded, 2.12.0 installed"):
        environment.check("pretrain")
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "anything")
    with pytest.raises(config.UserError, match="PIPELINE_ENVIRONMENT=anything: unknown; valid: pinned, any"):
        environment.check("pretrain")


def test_a_run_that_opted_out_records_the_versions_it_ran_on(monkeypatch, capsys):
    # Without the opt-out, no record of it.
    install(monkeypatch)
    assert "environment" not in stage.record_tags("train_gnn")
    pinned = stage.code_record("pretrain")
    assert "opted_out" not in pinned["environment"]
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    install(monkeypatch, torch_geometric="2.8.0.post1")
    environment.check("train_gnn")
    assert "running on them, as PIPELINE_ENVIRONMENT=any asks" in capsys.readouterr().out
    tag = stage.record_tags("train_gnn")["environment"]
    assert tag == "PIPELINE_ENVIRONMENT=any: torch-geometric 2.8.1 recorded, 2.8.0.post1 installed"
    install(monkeypatch, torch="2.12.0")
    record = stage.code_record("pretrain")["environment"]
    assert {k: record[k] for k in ("opted_out", "file", "differences")} == {
        "opted_out": "PIPELINE_ENVIRONMENT=any",
        "file": LM,
        "differences": {"torch": {"recorded": "2.13.0", "installed": "2.12.0"}},
    }
    assert record["packages"]["torch"] == "2.12.0"
    # Opted out on the recorded versions: the run says so; the output is a pinned run's (its hash too).
    install(monkeypatch)
    assert (
        stage.record_tags("train_gnn")["environment"]
        == f"PIPELINE_ENVIRONMENT=any: the installed packages are those {GNN} records"
    )
    assert stage.code_record("pretrain") == pinned


def test_a_stage_that_opens_its_run_itself_tags_it_too(workdir, monkeypatch):
    """prepare_data, context_study and report open their MLflow runs without stage.tracked; the opt-out
    reaches them all the same (prepare_data, the cheapest, run here)."""
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    install(monkeypatch, xxhash="4.0.0")
    opened, start_run = [], runs.start_run

    def recording(section, params, inputs_hash, rt, tags=None):
        opened.append(tags)
        return start_run(section, params, inputs_hash, rt, tags=tags)

    monkeypatch.setattr(runs, "start_run", recording)
    prepare_data.main(["--output", "out", "instructions=none", "graphs=[]"])
    assert [tags["environment"] for tags in opened] == [
        "PIPELINE_ENVIRONMENT=any: xxhash 4.1.0 recorded, 4.0.0 installed"
    ]
    assert opened[0]["container_family"] == "lm" and "xxhash==4.0.0" in opened[0]["packages_installed"].split()
    meta = json.loads(Path("out/meta.json").read_text())
    assert meta["environment"]["packages"]["xxhash"] == "4.0.0"
    assert meta["environment"]["packages_sha256"] == opened[0]["packages_sha256"]


@pytest.mark.parametrize("tool", ["DVC_ROOT", "PIPELINE_SNAKEMAKE"])
def test_under_dvc_or_snakemake_the_opt_out_is_refused_as_dvc_lock_would_record_the_pinned_versions(monkeypatch, tool):
    monkeypatch.setenv("PIPELINE_ENVIRONMENT", "any")
    monkeypatch.setenv(tool, "/repo" if tool == "DVC_ROOT" else "1")
    install(monkeypatch, torch_geometric="2.8.0.post1")
    with pytest.raises(config.UserError) as refused:
        stage.launch("train_gnn", lambda rt, stop: pytest.fail("the stage ran"))
    line = str(refused.value)
    assert "torch-geometric 2.8.1 recorded, 2.8.0.post1 installed" in line
    assert f"dvc.lock records {GNN}" in line and "`make venv`" in line and "requirements.lock" in line
    install(monkeypatch)
    environment.check("train_gnn")  # the recorded versions: the opt-out changes nothing


def test_verify_notes_installed_packages_that_differ_from_the_family_files_of_dvc_lock(monkeypatch, capsys):
    lock = {
        "stages": {
            "train_gnn": {"deps": [{"path": GNN, "md5": "0" * 32}, {"path": "stages/train_gnn.py"}]},
            "pretrain": {"deps": [{"path": LM, "md5": "1" * 32}]},
            "tokenize": {"deps": [{"path": LM, "md5": "1" * 32}]},
        }
    }
    install(monkeypatch, torch_geometric="2.8.0.post1")
    r = verify.Report()
    verify.check_environment(ROOT, lock, r)
    lines = capsys.readouterr().out.splitlines()
    assert r.broken == 0
    assert lines == [
        f"note    environment the packages installed here differ from {GNN} (recorded for 1 stage(s) of dvc.lock: "
        f"train_gnn): torch-geometric 2.8.1 recorded, 2.8.0.post1 installed; a re-run of those stages here is "
        f"refused: `make venv` installs the recorded versions (in containers/gnn.sif the stages run on the "
        f"image's own)",
        f"ok      environment the packages installed here are those of {LM} (recorded for 2 stage(s) of dvc.lock: "
        f"pretrain, tokenize)",
    ]


def test_verify_notes_an_out_made_in_another_environment_naming_the_packages_and_the_image(
    tmp_path, monkeypatch, capsys
):
    root = checkout(tmp_path)
    install(monkeypatch)
    here = environment.run_record("pretrain", root)
    elsewhere = {**here, "packages": {**here["packages"], "torch": "2.12.0+cu128", "triton": "3.5.0"}}
    elsewhere["packages_sha256"] = environment.packages_sha256(elsewhere["packages"])
    elsewhere["image"] = {"runtime": "apptainer", "name": "lm.sif", "sha256": "ab" * 32}
    outs = {"data/pretrain": elsewhere, "data/tokenize": here, "data/base": None, "data/train_gnn": "no meta.json"}
    for out, record in outs.items():
        (root / out).mkdir(parents=True)
        if record != "no meta.json":
            meta = {"code_sha256": "0" * 64, **({"environment": record} if record else {})}
            (root / out / "meta.json").write_text(json.dumps(meta))
    lock = {"stages": {Path(out).name: {"outs": [{"path": out, "md5": "1" * 32 + ".dir"}]} for out in outs}}
    r = verify.Report()
    verify.check_recorded_environments(root, lock, r)
    lines = capsys.readouterr().out.splitlines()
    assert r.broken == 0
    lm = len(here["packages"])
    assert lines == [
        "note    environment stage base: data/base/meta.json records no environment (made before outputs recorded "
        "theirs): not compared",
        "note    environment stage pretrain: data/pretrain was made in another environment than this one: torch "
        "2.12.0+cu128 recorded, 2.13.0 now; triton 3.5.0 recorded, not installed now; image apptainer lm.sif "
        "sha256:abababababab recorded, none now",
        f"ok      environment stage tokenize: data/tokenize was made in this environment (requirements.lock "
        f"{here['lock_sha256'][:12]}, {lm} lm packages, image none)",
    ]


def test_each_out_of_the_ci_run_and_its_mlflow_run_record_the_environment_it_ran_in(monkeypatch, capsys, mirror):
    """The shared ci run: every out with a meta.json records this environment, which verify finds here, and
    the stages' MLflow runs are tagged with the same record."""
    import mlflow

    run = shared_run()
    monkeypatch.setattr(environment, "current_image", MEASURED_IMAGE)  # (where the run ran: here)
    lock = verify.parse_yaml((run / "dvc.lock").read_text())
    r = verify.Report()
    verify.check_recorded_environments(run, lock, r)
    lines = capsys.readouterr().out.splitlines()
    made_here = {line.split()[3].rstrip(":") for line in lines if line.startswith("ok      environment stage ")}
    assert len(made_here) == len(lines), lines
    assert {"prepare_data", "tokenize", "pretrain", "finetune_qlora@nf4", "eval_harness@pretrain"} <= made_here, lines
    record = json.loads((run / "data/pretrain/meta.json").read_text())["environment"]
    assert record["lock_sha256"] == hashlib.sha256((run / environment.LOCK).read_bytes()).hexdigest()
    client = mlflow.MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    (tracked,) = client.search_runs(experiments, "tags.stage = 'pretrain'")
    assert {k: tracked.data.tags.get(k) for k in environment.tags_of(record)} == environment.tags_of(record)
