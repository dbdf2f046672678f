"""The report: one row schema for every reproduced result, stage metrics, plots, clear errors."""

from __future__ import annotations

import json

import pytest

from stages import report
from stages.common import config


def stage_folder(root, name, metrics=None, rows=None, plot=False, figures=None):
    folder = root / "data" / name
    folder.mkdir(parents=True)
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))
    if figures is not None:
        (folder / "figures.json").write_text(json.dumps(figures))
    if rows is not None:
        (folder / "results.json").write_text(json.dumps(rows))
    if plot:
        (folder / "plots").mkdir()
        (folder / "plots/accuracy.png").write_bytes(b"\x89PNG")
    return folder


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("PIPELINE_RUN_ID", raising=False)
    (tmp_path / "params.yaml").write_text('report:\n  strict: false\n  recorded: ""\n  regression_tolerance: 0.02\n')
    prep = stage_folder(tmp_path, "prepare_data", metrics={"train_bytes": 10})
    (prep / "meta.json").write_text(json.dumps({"files": {"planetoid/Cora/raw/ind.cora.x": "ab" * 32}}))
    stage_folder(
        tmp_path,
        "train_gnn",
        metrics={"gcn": {"test_acc": 0.81}},
        plot=True,
        rows=[
            {
                "result": "GCN Cora test accuracy",
                "paper": "Kipf & Welling 2017",
                "published": 81.5,
                "ours": 81.0,
                "tolerance": 1.0,
                "data": ["planetoid/Cora/raw/ind.cora.x"],
            },
            {
                "result": "GAT Cora test accuracy",
                "paper": "Velickovic et al. 2018",
                "published": 83.0,
                "ours": 80.0,
                "tolerance": 1.0,
            },
        ],
    )
    return tmp_path


def test_rows_share_one_schema_and_pass_is_computed(tree):
    doc = report.main(["--output", "reports", "--inputs", "data/prepare_data", "data/train_gnn"])
    assert [tuple(r) for r in doc["rows"]] == [report.ROW_FIELDS] * 2
    gcn, gat = doc["rows"]
    assert (gcn["pass"], gat["pass"]) == (True, False)
    assert gcn["data_hashes"] == {"planetoid/Cora/raw/ind.cora.x": "ab" * 32} and gat["data_hashes"] == {}
    assert gcn["stage"] == "train_gnn" and "git_commit" not in doc and "git_commit" not in report.ROW_FIELDS
    md = (tree / "reports/results.md").read_text()
    assert "| GCN Cora test accuracy | Kipf & Welling 2017 | = | 81.5 | 81 | 1 | pass | train_gnn |" in md
    assert "| GAT Cora test accuracy |" in md and "| FAIL |" in md
    assert "![data/train_gnn/plots/accuracy.png](../data/train_gnn/plots/accuracy.png)" in md
    assert "| gcn.test_acc | 0.81 |" in md
    assert json.loads((tree / "reports/results.json").read_text())["rows"] == doc["rows"]


def test_bound_rows_pass_on_their_side_of_the_bound(tree):
    stage_folder(
        tree,
        "context_study",
        rows=[
            {"result": "growth", "paper": "p", "relation": ">=", "published": 1.2, "ours": 1.5, "tolerance": 0.0},
            {"result": "recovery", "paper": "p", "relation": "<=", "published": 1.0, "ours": 1.04, "tolerance": 0.05},
            {"result": "worse", "paper": "p", "relation": "<=", "published": 1.0, "ours": 1.2, "tolerance": 0.05},
            {"result": "short", "paper": "p", "relation": ">=", "published": 1.2, "ours": 1.1, "tolerance": 0.0},
        ],
    )
    doc = report.main(["--output", "reports", "--inputs", "data/context_study"])
    assert [r["pass"] for r in doc["rows"]] == [True, True, False, False]
    assert "| growth | p | >= | 1.2 | 1.5 | 0 | pass |" in (tree / "reports/results.md").read_text()
    stage_folder(
        tree, "odd", rows=[{"result": "x", "paper": "p", "relation": "~", "published": 1, "ours": 1, "tolerance": 0}]
    )
    with pytest.raises(config.UserError, match="relation '~'; use one of =, >=, <="):
        report.main(["--output", "reports", "--inputs", "data/odd"])


def test_strict_fails_on_a_row_outside_tolerance_but_still_writes(tree):
    with pytest.raises(config.UserError, match="outside tolerance: GAT Cora test accuracy"):
        report.main(["--output", "reports", "--inputs", "data/train_gnn", "strict=true"])
    assert (tree / "reports/results.md").is_file()


def spread_row(result, published, ours, n, sd, published_sd, published_n=100, tolerance=1.0):
    spread = {"n": n, "sd": sd, "published_n": published_n, "published_sd": published_sd}
    return {
        "result": result,
        "paper": "p",
        "published": published,
        "ours": ours,
        "tolerance": tolerance,
        "spread": spread,
    }


def test_means_over_runs_pass_by_welch_s_test_on_both_spreads(tree):
    """Equal runs and deviations (5 runs, sd 1 on both sides): a + b = 0.4, Welch-Satterthwaite gives 8
    degrees of freedom, t(0.995, 8) = 3.3554 (tables), so the tolerance is 3.3554 * sqrt(0.4) = 2.1221."""
    rows = [
        spread_row("equal spreads, inside", 80.0, 82.1, 5, 1.0, 1.0, published_n=5),
        spread_row("equal spreads, outside", 80.0, 82.2, 5, 1.0, 1.0, published_n=5),
        spread_row("paper without sd", 81.5, 81.84, 10, 0.5816, None),
        spread_row("two runs", 83.0, 90.0, 2, 0.5, 0.7),
        spread_row("identical runs", 81.5, 82.4, 5, 0.0, None, tolerance=1.0),
    ]
    stage_folder(tree, "gnn_spread", rows=rows)
    doc = report.main(["--output", "reports", "--inputs", "data/gnn_spread"])
    got = {r["result"]: r for r in doc["rows"]}
    assert got["equal spreads, inside"]["tolerance"] == pytest.approx(3.3554 * 0.4**0.5, abs=2e-4)
    assert [got[k]["pass"] for k in ("equal spreads, inside", "equal spreads, outside")] == [True, False]
    assumed = got["paper without sd"]["spread"]
    assert assumed["assumed"].startswith("published sd taken as ours") and assumed["rule"] == report.SPREAD_RULE
    # one estimate of the spread (ours, 10 runs): 9 degrees of freedom, t(0.995, 9) = 3.2498 (tables)
    assert got["paper without sd"]["tolerance"] == pytest.approx(3.2498 * (0.5816**2 * 0.11) ** 0.5, abs=2e-4)
    # two runs would give t(0.995, ~1) = 60 and pass anything: the fixed tolerance judges them
    two = got["two runs"]
    assert (two["tolerance"], two["spread"]["rule"], two["pass"]) == (1.0, "fixed tolerance", False)
    assert two["spread"]["assumed"] == f"fewer than {report.MIN_RUNS} runs of ours"
    same = got["identical runs"]
    assert (same["tolerance"], same["spread"]["assumed"], same["pass"]) == (1.0, "no spread to estimate", True)
    md = (tree / "reports/results.md").read_text()
    assert "| 81.5 ± 0.5816* (n=100) | 81.84 ± 0.5816 (n=10) |" in md and "Welch" in md
    assert "| 83 ± 0.7 (n=100) | 90 ± 0.5 (n=2) | 1 (fixed tolerance) | FAIL |" in md
    stage_folder(tree, "bad_spread", rows=[{**rows[0], "spread": {"n": 5, "sd": 1.0}}])
    with pytest.raises(config.UserError, match="row 0: spread must hold exactly n, sd, published_n, published_sd"):
        report.main(["--output", "reports", "--inputs", "data/bad_spread"])


def test_schema_is_there_without_any_result(tree):
    doc = report.main(["--output", "reports", "--inputs", "data/prepare_data"])
    md = (tree / "reports/results.md").read_text()
    assert doc["rows"] == [] and "| " + " | ".join(report.TABLE_FIELDS) + " |" in md
    assert "No stage of this pipeline reproduces a published result yet" in md


def test_bad_rows_and_missing_inputs_are_clear_errors(tree):
    stage_folder(tree, "broken", rows=[{"result": "x", "ours": 1}])
    with pytest.raises(config.UserError, match="results.json: row 0 lacks paper, published, tolerance"):
        report.main(["--output", "reports", "--inputs", "data/broken"])
    with pytest.raises(config.UserError, match="data/missing not found"):
        report.main(["--output", "reports", "--inputs", "data/missing"])
    assert not (tree / "reports").exists()


def test_items_of_one_stage_are_compared_side_by_side(tree):
    stage_folder(tree, "finetune_qlora/nf4", metrics={"eval_loss": 2.01, "peak_memory_mb": 700, "bits": 4.1})
    stage_folder(tree, "finetune_qlora/none", metrics={"eval_loss": 2.0, "peak_memory_mb": 900})
    stage_folder(tree, "eval_perplexity/pretrain", metrics={"nll": 3.0})
    # items that score different models share no metric: no table (an empty one said nothing)
    stage_folder(tree, "eval_harness/pretrain", metrics={"wikitext": {"word_perplexity": {"pretrain": 9.0}}})
    stage_folder(tree, "eval_harness/extend_context", metrics={"wikitext": {"word_perplexity": {"yarn": 8.0}}})
    doc = report.main(
        [
            "--output",
            "reports",
            "--inputs",
            "data/finetune_qlora/nf4",
            "data/finetune_qlora/none",
            "data/eval_perplexity/pretrain",
            "data/eval_harness/pretrain",
            "data/eval_harness/extend_context",
        ]
    )
    assert list(doc["comparisons"]) == ["finetune_qlora", "eval_harness"], "one item alone is no comparison"
    md = (tree / "reports/results.md").read_text()
    assert "## Comparison: eval_harness" not in md
    assert "## Comparison: finetune_qlora\n\n| metric | nf4 | none |\n|---|---|---|\n" in md
    assert "| eval_loss | 2.01 | 2 |\n| peak_memory_mb | 700 | 900 |\n" in md
    assert "| bits |" not in md.split("## Comparison")[1], "only the metrics every item has"


def eval_metrics(root, label, ppl):
    stage_folder(
        root,
        f"eval_perplexity/{label}",
        metrics={"perplexity": {model: by_ctx[max(by_ctx)] for model, by_ctx in ppl.items()}},
        figures={
            "models": {
                model: {f"ctx{ctx}": {"context": ctx, "perplexity": v} for ctx, v in by_ctx.items()}
                for model, by_ctx in ppl.items()
            }
        },
    )


def test_measured_figures_and_their_rows_go_to_the_measured_file_not_the_report(tree):
    measured = tree / "measured"
    measured.mkdir()
    row = {"result": "full activation checkpointing: peak saved", "paper": "Chen et al. 2016", "relation": ">="}
    doc = {"output": "data/memory_study", "techniques": {"baseline": {"peak_mb": 512.0}}}
    (measured / "memory_study.json").write_text(
        json.dumps({**doc, "rows": [{**row, "published": 0.4, "ours": 0.3, "tolerance": 0.0}]})
    )
    (measured / "memory_study.png").write_bytes(b"\x89PNG")
    (measured / "train_gnn.json").write_text(json.dumps({"output": "data/train_gnn", "wall_s": 12.5}))
    args = ["--output", "reports", "--inputs", "data/prepare_data", "data/train_gnn", "--measured-inputs"]
    args += ["measured/memory_study.json", "measured/train_gnn.json", "--measured", "measured/report.json"]
    first = (
        report.main(args),
        (tree / "reports/results.json").read_bytes(),
        (tree / "reports/results.md").read_bytes(),
    )
    got = json.loads((measured / "report.json").read_text())
    assert [r["result"] for r in got["rows"]] == [row["result"]] and got["rows"][0]["pass"] is False
    assert got["rows"][0]["stage"] == "memory_study" and set(got["rows"][0]) == set(report.ROW_FIELDS)
    assert got["stages"] == {
        "memory_study": {"techniques": {"baseline": {"peak_mb": 512.0}}},
        "train_gnn": {"wall_s": 12.5},
    }
    assert got["plots"] == ["measured/memory_study.png"] and got["output"] == "reports"
    md = first[2].decode()
    assert "12.5" not in md and "peak_mb" not in md and "`measured/report.json`" in md and "1 row(s)" in md
    # Other measurements, the same report: reports/ is a function of the outputs, byte for byte.
    (measured / "train_gnn.json").write_text(json.dumps({"output": "data/train_gnn", "wall_s": 99.0}))
    report.main(args)
    assert (tree / "reports/results.json").read_bytes() == first[1] and (
        tree / "reports/results.md"
    ).read_bytes() == first[2]
    assert json.loads((measured / "report.json").read_text())["stages"]["train_gnn"] == {"wall_s": 99.0}
    # report.strict counts the measured rows too
    (tree / "params.yaml").write_text('report:\n  strict: true\n  recorded: ""\n  regression_tolerance: 0.02\n')
    with pytest.raises(config.UserError, match="full activation checkpointing"):
        report.main(args)


def test_perplexities_regress_against_the_record_of_the_same_params(tree, monkeypatch):
    from pipelines import record

    (tree / "params.yaml").write_text(
        "report:\n  strict: false\n  recorded: recorded.yaml\n  regression_tolerance: 0.02\npretrain:\n  steps: 10\n"
    )
    eval_metrics(tree, "pretrain", {"pretrain": {64: 100.0, 128: 120.0}})
    monkeypatch.setattr(record.provenance, "git_commit", lambda: "c0ffee" * 7)
    entry = record.record(tree / "params.yaml", tree / "data", tree / "recorded.yaml", preset="test")
    assert entry["perplexity"] == {"eval_perplexity/pretrain": {"pretrain": {64: 100.0, 128: 120.0}}}
    # A later run: one perplexity moved 1% (passes), one 5% (fails), one recorded context is missing.
    stage_folder(tree, "eval_perplexity/pretrain2")  # a folder without perplexities changes nothing
    (tree / "data/eval_perplexity/pretrain/figures.json").write_text(
        json.dumps(
            {
                "models": {
                    "pretrain": {
                        "ctx64": {"context": 64, "perplexity": 101.0},
                        "ctx256": {"context": 256, "perplexity": 150.0},
                    }
                }
            }
        )
    )
    inputs = ["data/eval_perplexity/pretrain", "data/eval_perplexity/pretrain2"]
    doc = report.main(["--output", "reports", "--inputs", *inputs])
    rows = doc["regression"]["rows"]
    assert [tuple(r) for r in rows] == [report.ROW_FIELDS] * 2
    assert [(r["result"], r["published"], r["ours"], r["pass"]) for r in rows] == [
        ("token perplexity, pretrain at 64 tokens", 100.0, 101.0, True),
        ("token perplexity, pretrain at 128 tokens", 120.0, None, False),
    ]
    assert rows[0]["tolerance"] == 2.0 and rows[0]["stage"] == "eval_perplexity/pretrain"
    md = (tree / "reports/results.md").read_text()
    assert "## Regression against a recorded run" in md and "| token perplexity, pretrain at 128 tokens |" in md
    # Other params: no record applies, and the report says how to make one.
    (tree / "params.yaml").write_text((tree / "params.yaml").read_text().replace("steps: 10", "steps: 11"))
    doc = report.main(["--output", "reports", "--inputs", *inputs])
    assert doc["regression"]["rows"] == [] and doc["regression"]["recorded"] is None
    md = (tree / "reports/results.md").read_text()
    assert "python -m pipelines.record" in md
    # ... and names the nearest record and the one setting that differs from it.
    assert doc["regression"]["nearest"] == {
        "params": entry["params"],
        "preset": "test",
        "differences": ["pretrain.steps: 11 (recorded: 10)"],
    }
    assert "differs in 1 setting(s)" in md and "- `pretrain.steps: 11 (recorded: 10)`" in md
    # Under the recorded params again, strict: the failed regression row fails the stage.
    (tree / "params.yaml").write_text((tree / "params.yaml").read_text().replace("steps: 11", "steps: 10"))
    with pytest.raises(config.UserError, match="pretrain at 128 tokens"):
        report.main(["--output", "reports", "--inputs", *inputs, "strict=true"])


def test_with_a_hub_base_the_record_follows_the_base_model_not_pretrain(tree, monkeypatch):
    """base.model set: the fingerprint hashes the base section in pretrain's place (an own pretrain's record
    keeps its fingerprint), the record holds the base DAG's perplexities only (not those an own run left in
    data/eval_perplexity/pretrain), and the report names the base model."""
    from pipelines import record

    own = "report:\n  strict: false\n  recorded: recorded.yaml\n  regression_tolerance: 0.02\npretrain:\n  steps: 10\n"
    (tree / "params.yaml").write_text(own)
    own_print = report.params_fingerprint(config.read_yaml(tree / "params.yaml"))
    assert report.params_fingerprint({**config.read_yaml(tree / "params.yaml"), "base": {"model": ""}}) == own_print
    hub = own + "base:\n  model: tiny-org/tiny-llama\n  revision: " + "a" * 40 + "\n"
    (tree / "params.yaml").write_text(hub)
    params = config.read_yaml(tree / "params.yaml")
    hub_print = report.params_fingerprint(params)
    assert hub_print != own_print
    assert report.params_fingerprint({**params, "pretrain": {"steps": 11}}) == hub_print
    assert report.params_fingerprint({**params, "base": {**params["base"], "revision": "b" * 40}}) != hub_print

    eval_metrics(tree, "pretrain", {"pretrain": {64: 100.0}})  # an own run's, left behind
    eval_metrics(tree, "base", {"base": {64: 90.0}})
    base = stage_folder(tree, "base")
    (base / "meta.json").write_text(
        json.dumps({"base_model": "tiny-org/tiny-llama", "base_revision": "main", "base_commit": "c" * 40})
    )
    monkeypatch.setattr(record.provenance, "git_commit", lambda: "c0ffee" * 7)
    entry = record.record(tree / "params.yaml", tree / "data", tree / "recorded.yaml")
    assert entry["params"] == hub_print and entry["perplexity"] == {"eval_perplexity/base": {"base": {64: 90.0}}}
    doc = report.main(["--output", "reports", "--inputs", "data/base", "data/eval_perplexity/base"])
    rows = [(r["result"], r["pass"]) for r in doc["regression"]["rows"]]
    assert rows == [("token perplexity, base at 64 tokens", True)]
    md = (tree / "reports/results.md").read_text()
    assert f"Base model: `tiny-org/tiny-llama` at commit `{'c' * 40}` (revision `main`)" in md

    # against the own pretrain's record only: one line for each section that one side lacks
    (tree / "recorded.yaml").unlink()
    (tree / "params.yaml").write_text(own)
    record.record(tree / "params.yaml", tree / "data", tree / "recorded.yaml")
    (tree / "params.yaml").write_text(hub)
    doc = report.main(["--output", "reports", "--inputs", "data/base", "data/eval_perplexity/base"])
    assert doc["regression"]["rows"] == [] and doc["regression"]["nearest"]["differences"] == [
        "base: 2 setting(s) (recorded: (absent))",
        "pretrain: (absent) (recorded: 1 setting(s))",
    ]


def test_the_html_page_names_a_base_model_and_only_then(tmp_path):
    from pipelines import html_report

    results = {"row_fields": ["claim"], "rows": [], "stage_metrics": {}, "plots": []}
    assert "Base model" not in html_report.render(results, tmp_path)
    base = {"model": "tiny-org/tiny-llama", "revision": "main", "commit": "f3f3099717aa"}
    page = html_report.render({**results, "base": base}, tmp_path)
    assert "Base model: <code>tiny-org/tiny-llama</code> at commit <code>f3f3099717aa</code>" in page
