"""memory_study: each technique runs in its own process on real token shards; the rows follow the table."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import yaml

from stages import memory_study
from stages.common import config

TECHNIQUES = {
    "baseline": {},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "ac_full": {"activation_checkpointing": "full"},
    "ac_selective": {"activation_checkpointing": "selective"},
}


def params_with(root, tmp_path, **section) -> str:
    """The ci params with the memory_study section's keys replaced."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["memory_study"].update(section)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return str(path)


def test_every_technique_is_measured_and_the_rows_follow_the_table(tokenized, tmp_path, monkeypatch):
    """One context: each technique is a fresh process (the cost of this test); the rows at several contexts
    follow the longest one (test_the_rows_and_figures_follow_the_longest_context)."""
    monkeypatch.chdir(tokenized)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = params_with(tokenized, tmp_path, techniques=TECHNIQUES, contexts=[256])
    out = memory_study.main(["--params", params, "--input", "data/tokenize", "--output", str(tmp_path / "ms")])
    table = out["table"]
    assert set(table) == {(n, 256) for n in TECHNIQUES}
    for run in table.values():
        assert run["peak_mb"] > 0 and run["activation_mb"] >= 0 and run["tokens_per_s"] > 0
        assert run["tokens_per_cpu_s"] > 0
    base, eight = table["baseline", 256], table["adamw8bit", 256]
    # 2 bytes of moments per parameter instead of 8, plus per-tensor scales and code tables (see test_pretrain)
    assert eight["optimizer_state_mb"] <= 0.35 * base["optimizer_state_mb"]
    # activation checkpointing and the optimizer change memory and speed, not the computed losses
    assert table["ac_full", 256]["final_loss"] == pytest.approx(base["final_loss"], rel=1e-5)
    assert table["ac_selective", 256]["final_loss"] == pytest.approx(base["final_loss"], rel=1e-5)
    assert eight["final_loss"] == pytest.approx(base["final_loss"], rel=0.02)

    # The output holds what is computed: optimizer states, losses and the rows about them.
    folder = tmp_path / "ms"
    rows = list(csv.DictReader(open(folder / "table.csv")))
    assert len(rows) == 4 and {r["technique"] for r in rows} == set(TECHNIQUES)
    assert set(rows[0]) == {"technique", "context", "optimizer_state_mb", "final_loss", "loss_vs_baseline"}
    results = json.loads((folder / "results.json").read_text())
    assert [r["result"].split(":")[0] for r in results] == ["adamw8bit", "adamw8bit"]
    assert results[0]["ours"] == round(eight["optimizer_state_mb"] / base["optimizer_state_mb"], 4)
    metrics = json.loads((folder / "figures.json").read_text())
    assert metrics["context"] == 256 and set(metrics["techniques"]) == set(TECHNIQUES)
    assert not {"peak_mb", "activation_mb", "tokens_per_s"} & set(metrics["techniques"]["baseline"])
    headline = json.loads((folder / "metrics.json").read_text())
    assert headline == {"optimizer_state_mb": {k: v["optimizer_state_mb"] for k, v in metrics["techniques"].items()}}
    # What is measured (memory, speed, the rows about activation checkpointing, the plot) is outside it.
    measured = json.loads((tmp_path / "ms.measured.json").read_text())
    assert measured["output"] == str(folder) and len(measured["table"]) == 4
    assert measured["techniques"]["baseline"]["peak_mb"] == round(base["peak_mb"], 1)
    rows = measured["rows"]
    assert [r["result"] for r in rows] == [
        "full activation checkpointing: peak saved / activation memory at context 256",
        "selective activation checkpointing: peak memory between none (0) and full (1)",
    ]
    peak = [table[n, 256]["peak_mb"] for n in ("baseline", "ac_full", "ac_selective")]
    assert rows[1]["ours"] == round((peak[0] - peak[2]) / (peak[0] - peak[1]), 4)
    # speed is a measured figure, not a row: on a CPU, tokens per second of the process's CPU time
    assert measured["techniques"]["ac_selective"]["tokens_per_cpu_s"] > 0
    assert (tmp_path / "ms.measured.png").stat().st_size > 0 and not (folder / "plots").exists()


def test_the_rows_and_figures_follow_the_longest_context(tokenized, tmp_path):
    """A study at two contexts: table.csv has every (technique, context), and the figures, the headline and
    every row are the longest context's. A table of known figures (those at 64 tokens differ from those at
    256 by a factor), through the stage's own writers."""
    cfg = config.load(memory_study.Config, "memory_study", tokenized / "params.yaml")
    cfg = dataclasses.replace(cfg, techniques=TECHNIQUES, contexts=(64, 256))

    def run(state: float, loss: float, peak: float, cpu: float) -> dict:
        figures = {"optimizer_state_mb": state, "final_loss": loss, "peak_mb": peak, "activation_mb": 50.0}
        return figures | {"tokens_per_s": cpu, "tokens_per_cpu_s": cpu}

    # (state MiB, final loss, peak MiB, tokens per CPU s); at 64 tokens every ratio differs from 256's
    at_256 = {"baseline": (8, 5, 100, 1000), "adamw8bit": (2, 5.05, 90, 900), "ac_full": (8, 5, 60, 700)}
    at_64 = {"baseline": (8, 5, 100, 1000), "adamw8bit": (4, 5.5, 95, 950), "ac_full": (8, 5, 90, 900)}
    at_256["ac_selective"], at_64["ac_selective"] = (8, 5, 80, 850), (8, 5, 99, 990)
    table = {(n, c): run(*(at_256 if c == 256 else at_64)[n]) for c in (64, 256) for n in TECHNIQUES}
    (tmp_path / "out").mkdir()
    metrics = memory_study.write_outputs(tmp_path / "out", cfg, table)
    rows = list(csv.DictReader(open(tmp_path / "out/table.csv")))
    assert sorted((r["technique"], int(r["context"])) for r in rows) == sorted(table)
    assert json.loads((tmp_path / "out/figures.json").read_text())["context"] == 256
    assert metrics["adamw8bit"]["optimizer_state_mb"] == 2.0 and metrics["baseline"]["final_loss"] == 5.0
    results = json.loads((tmp_path / "out/results.json").read_text())
    assert [r["ours"] for r in results] == [0.25, 1.01]
    measured = memory_study.write_measured(tmp_path / "m.json", tmp_path / "out", cfg, table)
    assert measured["context"] == 256 and measured["techniques"]["baseline"]["peak_mb"] == 100.0
    assert len(measured["table"]) == 8
    # full: (100 - 60) / 50 of activations; selective between none and full: (100 - 80) / (100 - 60); speed
    # (selective at 850 tokens per CPU s between 1000 and 700) is a figure only
    assert [r["ours"] for r in measured["rows"]] == [0.8, 0.5]
    assert measured["techniques"]["ac_selective"]["tokens_per_cpu_s"] == 850


@pytest.mark.parametrize(
    "section, message",
    [
        ({"techniques": {"adamw8bit": {"optimizer": "adamw8bit"}}}, "memory_study.techniques: add a 'baseline' entry"),
        (
            {"techniques": {"baseline": {}, "odd": {"optimizer": "sgd"}}},
            "memory_study.techniques.odd.optimizer: unknown optimizer 'sgd'",
        ),
        ({"techniques": {"baseline": {}, "odd": {"lrr": 1}}}, "unknown key memory_study.techniques.odd.lrr; valid"),
        ({"contexts": [64, 4096]}, "contexts must be lengths between 2 and model.max_position_embeddings (256)"),
    ],
)
def test_bad_params_fail_before_any_run(tokenized, tmp_path, section, message):
    params = params_with(tokenized, tmp_path, **section)
    with pytest.raises(config.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        memory_study.main(["--params", params, "--input", str(tokenized / "data/tokenize"), "--output", "x"])
    assert not (tmp_path / "x").exists()
