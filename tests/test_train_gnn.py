"""train_gnn on Cora: the same per-seed results for 1 and 2 processes, outputs that load into stock PyG
layers, DDP gradient synchronization, the mini-batch path, sparse-input equivalence, clear errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import MIRROR, ROOT, TRACKED, RunsCode, run_probe, run_stage

from stages import train_gnn
from stages.common import config
from stages.models import gnn

ARGS = ["--input", "data/prepare_data", "--output", "data/train_gnn"]
TINY = ["seeds=3", "gcn.epochs=12", "gat.epochs=6"]  # 3 seeds: ranks get unequal shares


def scratch(prepared, root):
    shutil.copy(prepared / "params.yaml", root / "params.yaml")
    shutil.copytree(prepared / "data/prepare_data", root / "data/prepare_data")
    return root


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """The ci preset trained by 1 process and by 2 (torchrun, gloo), each with its own MLflow store."""
    runs = {}
    for nproc in (1, 2):
        root = scratch(prepared, tmp_path_factory.mktemp(f"gnn{nproc}"))
        run_stage("train_gnn", [*ARGS, *TINY], cwd=root, nproc=nproc, **TRACKED)
        runs[nproc] = root
    return runs


def seeds_of(root):
    return json.loads((root / "data/train_gnn/seeds.json").read_text())


def test_per_seed_results_do_not_depend_on_world_size(trained):
    one = seeds_of(trained[1])
    assert [(r["model"], r["seed"]) for r in one] == [(m, s) for m in ("gcn", "gat") for s in range(3)]
    # The whole output, byte for byte (seeds, figures, models, plot): nothing in it depends on the run's
    # processes or its timings, which are measured beside it.
    files = {n: sorted((trained[n] / "data/train_gnn").rglob("*")) for n in (1, 2)}
    assert [p.relative_to(trained[1]) for p in files[1]] == [p.relative_to(trained[2]) for p in files[2]]
    differ = [
        str(a.relative_to(trained[1]))
        for a, b in zip(files[1], files[2], strict=True)
        if a.is_file() and a.read_bytes() != b.read_bytes()
    ]
    assert not differ, f"outputs differ between 1 and 2 processes: {differ}"
    assert "train_s" not in one[0] and "world_size" not in json.loads(
        (trained[2] / "data/train_gnn/figures.json").read_text()
    )
    measured = json.loads((trained[2] / "data/train_gnn.measured.json").read_text())
    assert (
        measured["world_size"] == 2 and measured["wall_s"] > 0 and set(measured["train_s_per_seed"]) == {"gcn", "gat"}
    )
    assert set(measured["train_s"]) == {f"{m}-seed{s}" for m in ("gcn", "gat") for s in range(3)}


def test_outputs_load_into_stock_pyg_layers_and_reproduce_test_accuracy(trained):
    from torch_geometric.nn import GATConv, GCNConv

    root = trained[2]
    out = root / "data/train_gnn"
    data = train_gnn.load_planetoid(root / "data/prepare_data", "Cora")
    test = data.test_mask.nonzero().view(-1)
    for row in seeds_of(root):
        saved = torch.load(out / "models" / f"{row['model']}-seed{row['seed']}.pt", weights_only=True)
        model = gnn.build_model(saved["model"], **saved["kwargs"])
        model.load_state_dict(saved["state_dict"])
        model.eval()
        logits = model(data.x.to_sparse_csr(), data.edge_index)
        assert 100.0 * (logits[test].argmax(-1) == data.y[test]).float().mean().item() == row["test_acc"]

        # The layers of PyG's examples/gcn.py and gat.py, with dense features, give the same logits.
        kw, stock = saved["kwargs"], torch.nn.Module()
        if row["model"] == "gcn":
            stock.conv1, stock.conv2 = GCNConv(1433, kw["hidden"]), GCNConv(kw["hidden"], 7)
            act = F.relu
        else:
            stock.conv1 = GATConv(1433, kw["hidden"] // kw["heads"], heads=kw["heads"])
            stock.conv2 = GATConv(kw["hidden"], 7, heads=kw["output_heads"], concat=False)
            act = F.elu
        stock.load_state_dict(saved["state_dict"])
        stock.eval()
        dense = stock.conv2(act(stock.conv1(data.x, data.edge_index)), data.edge_index)
        torch.testing.assert_close(dense, logits, rtol=1e-5, atol=1e-5)


def test_metrics_report_rows_plot_and_mlflow_curves(trained, prepared):
    import mlflow

    root = trained[2]
    out = root / "data/train_gnn"
    metrics = json.loads((out / "figures.json").read_text())
    assert json.loads((out / "metrics.json").read_text()) == {
        "test_acc": {m: metrics[m]["test_acc_mean"] for m in ("gcn", "gat")}
    }
    assert metrics["seeds"] == 3 and 0 <= metrics["gat"]["test_acc_std"]
    rows = json.loads((out / "results.json").read_text())
    files = json.loads((prepared / "data/prepare_data/meta.json").read_text())["files"]
    assert [(r["published"], r["tolerance"]) for r in rows] == [(81.5, 1.0), (83.0, 1.0)]
    spreads = [(r["spread"]["n"], r["spread"]["sd"], r["spread"]["published_sd"]) for r in rows]
    assert spreads == [(3, round(metrics[m]["test_acc_std"], 4), sd) for m, sd in (("gcn", None), ("gat", 0.7))]
    assert all(r["ours"] == round(metrics[m]["test_acc_mean"], 2) for r, m in zip(rows, ("gcn", "gat"), strict=True))
    assert all(set(r["data"]) <= set(files) and len(r["data"]) == 8 for r in rows)
    assert (out / "plots/accuracy.png").read_bytes()[:4] == b"\x89PNG"

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])
    assert [r.data.tags["stage"] for r in runs] == ["train_gnn"], "one run, logged by rank 0 only"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert (
        run.data.params["dataset"] == "Cora"
        and run.data.params["gat.heads"] == "8"
        and run.data.params["minibatch.enabled"] == "False"
        and run.data.metrics["gcn_test_acc_mean"] == metrics["gcn"]["test_acc_mean"]
    )
    history = client.get_metric_history(run.info.run_id, "gcn_val_acc")
    assert [m.step for m in history] == list(range(12))
    assert {"models", "plots", "figures.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_ddp_step_synchronizes_gradients_across_ranks(tmp_path, mirror):
    out = tmp_path / "probe.json"
    run_probe("gnn_ddp_probe.py", [MIRROR, out], tmp_path, nproc=2)
    ranks = [
        {k: torch.tensor(v) if isinstance(v, list) else v for k, v in r.items()} for r in json.loads(out.read_text())
    ]
    assert all(r["train_nodes"] > 0 for r in ranks)
    assert torch.equal(ranks[0]["ddp"], ranks[1]["ddp"]), "parameters equal across ranks after a DDP step"
    assert (ranks[0]["alone"] - ranks[1]["alone"]).abs().max() > 1e-3, "the ranks' batches differ"
    for r in ranks:
        assert (r["ddp"] - r["alone"]).abs().max() > 1e-3, "a DDP step differs from an unsynchronized one"
        torch.testing.assert_close(r["ddp"], r["averaged"], rtol=0, atol=1e-6)


def test_minibatch_ddp_trains_on_cora(prepared, tmp_path):
    root = scratch(prepared, tmp_path)
    run_stage(
        "train_gnn", [*ARGS, "minibatch.enabled=true", "models=[gcn]", "seeds=1", "gcn.epochs=40"], cwd=root, nproc=2
    )
    metrics = json.loads((root / "data/train_gnn/figures.json").read_text())
    assert metrics["minibatch"] and metrics["gcn"]["test_acc_mean"] > 60.0  # chance is ~30% (7 classes)
    assert not (root / "data/train_gnn/results.json").exists(), "no paper rows for the mini-batch setup"


def test_sparse_input_matches_dense_in_both_passes():
    torch.manual_seed(0)
    dense = torch.rand(50, 30) * (torch.rand(50, 30) < 0.1)
    lin = gnn.SparseInputLinear(torch.nn.Linear(30, 4, bias=True))
    sparse = dense.to_sparse_csr()
    for _ in range(2):  # the second call reuses the cached transposed layout
        lin.weight.grad = None
        lin(sparse).square().sum().backward()
        grad = lin.weight.grad.clone()
        lin.weight.grad = None
        F.linear(dense, lin.weight, lin.bias).square().sum().backward()
        torch.testing.assert_close(grad, lin.weight.grad)
    dropped = gnn.dropout(sparse, 0.5, training=True).to_dense()
    kept = dropped != 0
    assert (kept <= (dense != 0)).all() and 0 < kept.sum() < (dense != 0).sum()
    torch.testing.assert_close(dropped[kept], 2 * dense[kept])
    assert gnn.dropout(sparse, 0.5, training=False) is sparse


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dataset=Karate"], "train_gnn.dataset: unknown dataset 'Karate'; valid: Cora, CiteSeer, PubMed"),
        (["models=[gcn,sage]"], "train_gnn.models: unknown model 'sage'; valid: gcn, gat"),
        (["gcn.hidden=0"], "train_gnn.gcn.hidden must be >= 1, got 0"),
        (["gcn.dropout=1"], r"train_gnn.gcn.dropout must be in [0, 1), got 1.0"),
        (["gat.hidden=60"], "train_gnn.gat.hidden (60) must be divisible by heads (8)"),
        (["train_gnn.gat.heads=3"], "train_gnn.gat.hidden (64) must be divisible by heads (3)"),
        (["gat.heads=many"], "train_gnn.gat.heads must be an int, got 'many'"),
        (["gat.output_heads=-1"], "train_gnn.gat.output_heads must be >= 0, got -1"),
        (
            ["minibatch.loader=cluster"],
            "train_gnn.minibatch.loader: unknown loader 'cluster'; valid: auto, neighbor, random_node",
        ),
        (["minibatch.neighbors=[]"], "train_gnn.minibatch.neighbors must be a non-empty list of counts >= 1"),
        (["gcn_hidden=16"], "unknown key train_gnn.gcn_hidden"),
        (["loader=auto"], "unknown key train_gnn.loader (did you mean train_gnn.minibatch.loader?)"),
    ],
)
def test_bad_params_fail_naming_the_key(workdir, overrides, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        train_gnn.main(["--input", "nowhere", *overrides])
    assert not (workdir / "data").exists() and not (workdir / "mlflow.db").exists()


def test_missing_raw_files_say_where_they_must_be(workdir):
    (workdir / "in/planetoid/CiteSeer/raw").mkdir(parents=True)
    with pytest.raises(config.UserError, match=r"in/planetoid/CiteSeer/raw lacks ind\.citeseer\.x, .*run prepare_data"):
        train_gnn.main(["--input", "in", "dataset=CiteSeer"])
    if not train_gnn.neighbor_loader_available():
        shutil.copytree(MIRROR / "planetoid/Cora", workdir / "in/planetoid/Cora")
        with pytest.raises(config.UserError, match="NeighborLoader needs pyg-lib or torch-sparse"):
            train_gnn.main(["--input", "in", "minibatch.enabled=true", "minibatch.loader=neighbor"])
    assert not (workdir / "data").exists() and not (workdir / "mlflow.db").exists()


def test_a_raw_file_that_is_not_the_published_one_is_never_unpickled(workdir):
    """PyG's Planetoid unpickles ind.* files: one replaced by a pickle that runs code is refused, naming it,
    both at the input check and in the private copy PyG reads; the code never runs and nothing is written."""
    import pickle

    shutil.copytree(MIRROR / "planetoid/Cora", workdir / "in/planetoid/Cora")
    marker = workdir / "code-ran"
    crafted = workdir / "in/planetoid/Cora/raw/ind.cora.x"
    crafted.write_bytes(pickle.dumps(RunsCode(marker)))
    refused = r"ind\.cora\.x is not the published Planetoid file .*run prepare_data"
    for call in (lambda: train_gnn.main(["--input", "in"]), lambda: train_gnn.load_planetoid(workdir / "in", "Cora")):
        with pytest.raises(config.UserError, match=refused):
            call()
    assert not marker.exists(), "a raw file ran code"
    assert not (workdir / "data").exists() and not (workdir / "mlflow.db").exists()


def test_sub_sections_load_from_params_and_dotted_overrides_merge_deeply(workdir):
    cfg = config.load(train_gnn.Config, "train_gnn", "params.yaml", ["gat.lr=0.01", "train_gnn.minibatch.parts=2"])
    assert (cfg.gat.lr, cfg.gat.heads, cfg.gat.epochs, cfg.gcn.epochs) == (0.01, 8, 20, 30), "ci preset + override"
    assert (cfg.minibatch.parts, cfg.minibatch.enabled, cfg.minibatch.neighbors) == (2, False, (10, 10))
    assert config.as_dict(cfg)["gcn"] == {
        "hidden": 16,
        "dropout": 0.5,
        "lr": 0.01,
        "weight_decay": 0.0005,
        "epochs": 30,
    }


def test_stop_signal_stops_training_before_the_next_epoch(mirror):
    from stages.common import runtime

    cfg = config.load(train_gnn.Config, "train_gnn", ROOT / "params.yaml")
    data = train_gnn.load_planetoid(mirror, "Cora")
    stop = runtime.StopFlag()
    stop.requested = True
    with pytest.raises(runtime.Stopped):
        train_gnn.train_seed("gcn", data, cfg, 0, runtime.Runtime(0, 1, 0, 1, torch.device("cpu")), stop)
