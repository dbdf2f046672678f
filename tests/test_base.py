"""A base model other than the pipeline's own pretrain: a hub model at a pinned revision, read offline from a
local Hugging Face cache (HF_HOME, HF_HUB_OFFLINE=1) laid out as the hub lays out a download, resolved and
refused as stages/common/hub.py says; the DAG that runs it (the base stage in, pretrain out, tokenize with its
tokenizer); and on a copy of the shared ci run, the whole DAG on it with no pretrain run: QLoRA under 2
processes, its context extended, its evaluations and the report, which names it and compares no perplexity
with the own pretrain's record; and a revision change re-running exactly the stages that read it."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from shared_run import copy_of_run, sh, shared_run

from pipelines import dag
from stages.common import config, hub

ROOT = Path(__file__).resolve().parent.parent
REPO = "tiny-org/tiny-llama"


def hub_snapshot(home: Path, repo: str, model: Path, refs: tuple[str, ...] = ("main",), salt: str = "") -> str:
    """`model`'s files as huggingface_hub keeps a download in HF_HOME: blobs by hash, snapshots/<commit>/
    linking to them, refs/<branch> naming the commit. `salt` gives another commit of the same files (its
    config.json names it). The commit."""
    cache = home / "hub" / f"models--{repo.replace('/', '--')}"
    files = {p.name: p.read_bytes() for p in sorted(model.iterdir()) if p.is_file()}
    if salt:
        files["config.json"] = json.dumps({**json.loads(files["config.json"]), "_revision_note": salt}).encode()
    commit = hashlib.sha1(b"".join(files.values())).hexdigest()
    (cache / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = cache / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = cache / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    (cache / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (cache / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    """An offline hub cache in tmp_path/hf for this process (huggingface_hub reads its settings at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf"


def tiny_model(folder: Path) -> Path:
    """A 2-layer Llama with a byte-level tokenizer, saved as a hub repository holds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    LlamaForCausalLM(
        LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(folder)
    vocab = {chr(i): i for i in range(256)} | {"<|endoftext|>": 256, "<|pad|>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(
        folder
    )
    return folder


def test_a_hub_model_resolves_offline_to_its_commit_and_each_refusal_is_one_line(offline_hub, tmp_path):
    model = tiny_model(tmp_path / "model")
    commit = hub_snapshot(offline_hub, REPO, model)
    base = hub.resolve(REPO, commit, "base.model")
    assert (base.commit, base.folder.name) == (commit, commit) and (base.folder / "model.safetensors").is_file()
    assert base.record() == {"base_model": REPO, "base_revision": commit, "base_commit": commit}
    # a branch is resolved to the commit it names now, and that commit is what is recorded
    assert hub.resolve(REPO, "main", "base.model").record()["base_commit"] == commit

    def refused(name: str, revision: str) -> str:
        with pytest.raises(config.UserError) as e:
            hub.resolve(name, revision, "base.model")
        assert "\n" not in str(e.value)
        return str(e.value)

    assert re.search(
        r"without a revision; pin one \(a commit hash from https://huggingface.co/.*/commits", refused(REPO, "")
    )
    assert "not in the hub cache" in refused("tiny-org/absent", commit) and "hf download tiny-org/absent" in refused(
        "tiny-org/absent", commit
    )
    assert "is neither a folder here nor a hub id" in refused("no/such/folder", "")
    assert "has no config.json; give a Hugging Face model folder" in refused(str(tmp_path), "")


@pytest.mark.parametrize(
    ("status", "code", "says"),
    [
        (401, "GatedRepo", "the model is gated; accept its license at https://huggingface.co/tiny-org/tiny-llama"),
        (404, "RepoNotFound", "no such model on the hub (or a private one: log in with hf auth login)"),
        (404, "RevisionNotFound", "the model has no revision 'v9'; give a commit hash, branch or tag it has"),
    ],
)
def test_gated_missing_and_unknown_revisions_are_one_line_naming_the_fix(monkeypatch, tmp_path, status, code, says):
    """The hub's answers, from a local server speaking as the hub does (status and X-Error-Code), before
    anything is written."""
    import http.server
    import threading

    from huggingface_hub import constants

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    try:
        with pytest.raises(config.UserError, match=re.escape(f"base.model: {REPO}@v9: {says}")):
            hub.resolve(REPO, "v9", "base.model")
    finally:
        server.shutdown()
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").rglob("*.safetensors"))


def test_the_dag_runs_the_base_stage_and_no_pretrain_while_base_model_is_set(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text().replace('  model: ""', f"  model: {REPO}", 1))
    own, other = dag.load_table(), dag.load_table(params=params)
    assert "pretrain" in own and "base" not in own
    assert "pretrain" not in other and "base" in other
    assert "--tokenizer data/base/model" in other["tokenize"].args and "data/base" in other["tokenize"].deps
    for name in ("extend_context", "finetune_qlora"):
        assert "--base data/base/model" in other[name].args and "data/base" in other[name].deps
        assert "--base data/pretrain/model" in own[name].args and "data/pretrain" in own[name].deps
    assert other["eval_perplexity"].foreach == other["eval_harness"].foreach == ("base", "extend_context")
    # the report's regression record is keyed by the base model's params: pretrain's, or base's
    assert "pretrain" in own["report"].params and "base.model" in own["report"].params
    assert "base" in other["report"].params and "pretrain" not in other["report"].params
    assert not [d for st in other.values() for d in st.deps if d.startswith("data/pretrain")]
    # every preset that names a hub base pins it to a commit (a reproduction never follows a moving branch)
    for preset in sorted((ROOT / "pipelines/presets").glob("*.yaml")):
        base = (dag.parse_yaml(preset.read_text()) or {}).get("base") or {}
        if hub.is_hub_id(str(base.get("model", ""))):
            assert hub.COMMIT.fullmatch(str(base.get("revision", ""))), f"{preset.name}: base.revision is not a commit"


@pytest.mark.e2e
def test_qlora_extension_and_evaluation_of_a_hub_model_run_without_pretrain(tmp_path, mirror):
    """The ci run's copy with base.model a hub repository in a local cache, read offline, and every stage
    that runs several processes at 4 (PIPELINE_NPROC_PER_NODE, as on a node of 4 GPUs): snakemake -n plans
    no pretrain; the whole DAG runs: the base, tokenize (with the base's tokenizer), QLoRA, the extension and
    the evaluations record the commit, the report names the base model and finds no record for it, and every
    link of pipelines.verify holds; the hub model is the ci run's pretrained one, so its losses and
    perplexities at 4 processes are the ci run's at 2; a new revision re-runs exactly the stages that read it."""
    clone = copy_of_run(tmp_path / "clone")
    home = tmp_path / "hf"
    commit = hub_snapshot(home, REPO, clone / "data/pretrain/model")
    offline = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PIPELINE_NPROC_PER_NODE": "4"}
    params = clone / "params.yaml"
    text = params.read_text()
    params.write_text(
        text.replace('  model: ""', f"  model: {REPO}", 1).replace('  revision: ""', f"  revision: {commit}", 1)
    )

    # dvc repro with the dvc.yaml made for the own pretrain: its stages that follow base.model run (their
    # params changed), and the launcher refuses their stale commands before they start
    before = (clone / "data/tokenize/meta.json").read_bytes()
    out = sh("dvc repro -s tokenize", clone, check=False, **offline)
    assert "dvc.yaml was made for another base model than params.yaml's base.model names now" in out, out[-3000:]
    sh("dvc checkout data/tokenize", clone)  # (what dvc repro removed before the refused command, as recorded)
    assert (clone / "data/tokenize/meta.json").read_bytes() == before
    sh("python -m pipelines.dag write", clone)
    targets = "data/finetune_qlora/nf4 data/extend_context data/eval_perplexity/base"
    plan = sh("snakemake -n --quiet rules", clone, **offline)
    assert not re.search(r"\bpretrain\b", plan), plan
    for rule in ("base", "tokenize", "finetune_qlora", "extend_context", "eval_perplexity", "eval_harness", "report"):
        assert re.search(rf"^\s*{rule}\s+\d", plan, re.M), (rule, plan)
    assert not re.search(r"^\s*(prepare_data|train_gnn)\s+\d", plan, re.M), plan

    sh("snakemake --profile pipelines/profiles/local --cores 2", clone, timeout=1500, **offline)
    meta = json.loads((clone / "data/base/meta.json").read_text())
    assert (meta["base_model"], meta["base_revision"], meta["base_commit"]) == (REPO, commit, commit)
    # the base's tokenizer is the ci run's own: its shards are the ci run's, byte for byte
    tokenized = json.loads((clone / "data/tokenize/meta.json").read_text())
    assert tokenized["tokenizer"] == "data/base/model" and tokenized["base_commit"] == commit
    for split in ("train", "val", "test"):
        for shard in tokenized["splits"][split]["shards"]:
            assert (clone / "data/tokenize" / shard).read_bytes() == (
                shared_run() / "data/tokenize" / shard
            ).read_bytes()
    ft = json.loads((clone / "data/finetune_qlora/nf4/meta.json").read_text())
    assert ft["base"] == "data/base/model" and ft["base_commit"] == commit and ft["world_size"] == 4
    figures = json.loads((clone / "data/finetune_qlora/nf4/figures.json").read_text())
    ppl = json.loads((clone / "data/eval_perplexity/base/metrics.json").read_text())
    losses = (clone / "data/finetune_qlora/nf4/plots/loss.csv").read_text().split()
    print(
        f"QLoRA on {REPO}@{commit[:12]} under 4 processes: train loss by step {losses}, eval loss "
        f"{figures['eval_loss']:.4f} (perplexity {math.exp(figures['eval_loss']):.1f}); the base's perplexity: {ppl}"
    )
    # 4 processes train and evaluate as the ci run's 2 did (the layouts tests' tolerance)
    ci = shared_run()
    curves = [f"finetune_qlora/{item}/plots/{name}.csv" for item in ("nf4", "none") for name in ("loss", "eval_loss")]
    curves += [f"extend_context/plots/finetune_loss/{v}-ft.csv" for v in ("unscaled", "linear")]
    for curve in curves:
        ours, theirs = (np.loadtxt(run / "data" / curve, delimiter=",", skiprows=1, ndmin=2) for run in (clone, ci))
        print(f"{curve}: at 4 processes {ours[:, 1].tolist()}, at 2 {theirs[:, 1].tolist()}")
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, err_msg=curve)
    assert ppl["perplexity"]["base"] == pytest.approx(
        json.loads((ci / "data/eval_perplexity/pretrain/metrics.json").read_text())["perplexity"]["pretrain"], rel=1e-5
    )
    extended = [
        json.loads((run / "data/eval_perplexity/extend_context/metrics.json").read_text()) for run in (clone, ci)
    ]
    assert extended[0]["perplexity"] == pytest.approx(extended[1]["perplexity"], rel=1e-5)
    assert "Data and pipelines are up to date" in sh("dvc status", clone, **offline)
    results = json.loads((clone / "reports/results.json").read_text())
    assert results["base"] == {"model": REPO, "revision": commit, "commit": commit}
    assert f"Base model: `{REPO}` at commit `{commit}`" in (clone / "reports/results.md").read_text()
    labels = [*results["stage_metrics"], *(row["stage"] for row in results["rows"])]
    assert {"eval_perplexity/base", "eval_harness/base"} <= set(labels) and not [x for x in labels if "pretrain" in x]
    # the ci record is the own pretrain's: nothing to compare with, and the nearest record says why
    regression = results["regression"]
    assert regression["rows"] == [] and regression["nearest"]["preset"] == "ci", regression
    assert regression["nearest"]["differences"][0] == "base: 2 setting(s) (recorded: (absent))"
    assert regression["nearest"]["differences"][1].startswith("pretrain: (absent) (recorded: ")
    verified = sh("python -m pipelines.verify", clone, **offline)
    assert verified.rstrip().endswith("every link holds"), verified
    assert "note    causes      stage pretrain: in dvc.lock but not in the DAG of this params.yaml" in verified
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    (version,) = client.search_model_versions("name = 'finetune_qlora-nf4'", order_by=["version_number DESC"])[:1]
    assert version.tags["base_commit"] == commit and version.tags["base_model"] == REPO

    # another revision: exactly the stages that read the base run again
    other = hub_snapshot(home, REPO, clone / "data/pretrain/model", refs=("v2",), salt="v2")
    params.write_text(params.read_text().replace(f"  revision: {commit}", "  revision: v2", 1))
    plan = sh(f"snakemake -n {targets} --quiet rules", clone, **offline)
    ran = set(re.findall(r"^\s*(\w+)\s+\d", plan, re.M)) - {"total"}
    assert ran == {"base", "tokenize", "finetune_qlora", "extend_context", "eval_perplexity"}, plan
    status = sh("dvc status", clone, **offline)
    assert re.search(r"^base:\n\s+changed deps:\n\s+params\.yaml:\n\s+modified:\s+base$", status, re.M), status
    assert not re.search(r"^pretrain", status, re.M), status
    assert other != commit
    shutil.rmtree(clone, ignore_errors=True)
