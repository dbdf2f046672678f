"""memory_study: each technique runs in its own process on real token shards; the rows follow the table."""

from __future__ import annotations

import csv
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
    monkeypatch.chdir(tokenized)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = params_with(tokenized, tmp_path, techniques=TECHNIQUES, contexts=[64, 256])
    out = memory_study.main(["--params", params, "--input", "data/tokenize", "--output", str(tmp_path / "ms")])
    table = out["table"]
    assert set(table) == {(n, c) for n in TECHNIQUES for c in (64, 256)}
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
    assert len(rows) == 8 and {r["technique"] for r in rows} == set(TECHNIQUES)
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
    assert measured["output"] == str(folder) and len(measured["table"]) == 8
    assert measured["techniques"]["baseline"]["peak_mb"] == round(base["peak_mb"], 1)
    rows = measured["rows"]
    assert [r["result"].split(":")[0] for r in rows] == [
        "full activation checkpointing",
        "selective activation checkpointing",
        "selective activation checkpointing",
    ]
    # speed on a CPU: tokens per second of the process's CPU time, which other jobs on the machine hardly move
    assert "tokens per CPU second" in rows[2]["result"]
    cpu = [table[n, 256]["tokens_per_cpu_s"] for n in ("baseline", "ac_full", "ac_selective")]
    assert rows[2]["ours"] == round((cpu[0] - cpu[2]) / (cpu[0] - cpu[1]), 4)
    assert (tmp_path / "ms.measured.png").stat().st_size > 0 and not (folder / "plots").exists()


@pytest.mark.parametrize(
    "section, message",
    [
        ({"techniques": {"adamw8bit": {"optimizer": "adamw8bit"}}}, "memory_study.techniques: add a 'baseline' entry"),
        (
            {"techniques": {"baseline": {}, "odd": {"optimizer": "sgd"}}},
            "memory_study.techniques.odd.optimizer: unknown optimizer 'sgd'",
        ),
        ({"techniques": {"baseline": {}, "odd": {"lrr": 1}}}, "unknown key memory_study.techniques.odd.lrr; valid"),
        (
            {"techniques": {"baseline": {}, "odd": {"micro_batch_size": 3}}},
            "memory_study.techniques.odd.batch_size (2) must be a multiple of micro_batch_size x processes (3 x 1)",
        ),
        ({"contexts": [64, 4096]}, "contexts must be lengths between 2 and model.max_position_embeddings (256)"),
    ],
)
def test_bad_params_fail_before_any_run(tokenized, tmp_path, section, message):
    params = params_with(tokenized, tmp_path, **section)
    with pytest.raises(config.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        memory_study.main(["--params", params, "--input", str(tokenized / "data/tokenize"), "--output", "x"])
    assert not (tmp_path / "x").exists()
