"""eval_harness: lm-evaluation-harness's tasks on the models the ci pipeline published (the shared run), and
its refusals. The figures themselves are compared with the harness run on its own in
tests/test_harness_parity.py."""

from __future__ import annotations

import json

import mlflow
import pytest
from conftest import ci_params
from shared_run import shared_run

from stages import eval_harness
from stages.common import config

FIGURES = {"word_perplexity", "byte_perplexity", "bits_per_byte"}


def test_every_published_model_gets_the_harness_s_wikitext_figures_logged_to_mlflow():
    run = shared_run()
    variants = sorted(p.parent.name for p in (run / "data/extend_context/model").glob("*/config.json"))
    for item, labels in (("pretrain", ["pretrain"]), ("extend_context", variants)):
        out = run / "data/eval_harness" / item
        figures = json.loads((out / "figures.json").read_text())
        assert sorted(figures) == labels and all(set(f["wikitext"]) == FIGURES for f in figures.values())
        headline = {"wikitext": {"word_perplexity": {k: f["wikitext"]["word_perplexity"] for k, f in figures.items()}}}
        assert json.loads((out / "metrics.json").read_text()) == headline
        harness = json.loads((out / "harness.json").read_text())
        assert harness["lm_eval"] == json.loads((out / "meta.json").read_text())["lm_eval"]
        record = harness["models"][labels[0]]["wikitext"]
        assert (
            record["samples"] == {"effective": 2, "original": 62}
            and record["figures"] == figures[labels[0]]["wikitext"]
        )
        seconds = json.loads((run / f"measured/eval_harness/{item}.json").read_text())["seconds"]
        assert sorted(seconds) == labels and all(s["wikitext"] > 0 for s in seconds.values())
        assert "seconds" not in json.dumps(harness), "timings stay out of the hashed output"
    # windows of each model's own context: the extended variants (twice the context) score differently
    pretrain = json.loads((run / "data/eval_harness/pretrain/figures.json").read_text())["pretrain"]["wikitext"]
    extended = json.loads((run / "data/eval_harness/extend_context/figures.json").read_text())
    assert any(abs(f["wikitext"]["bits_per_byte"] - pretrain["bits_per_byte"]) > 1e-3 for f in extended.values())
    client = mlflow.MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("pipeline").experiment_id], "tags.mlflow.runName = 'eval_harness@pretrain'"
    )
    assert runs and runs[0].data.metrics["pretrain.wikitext.bits_per_byte"] == pytest.approx(pretrain["bits_per_byte"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["tasks=[wikitext,no_such_task]"], "eval_harness: 'no_such_task' is not a task of lm-evaluation-harness"),
        (["--data", "elsewhere"], "task wikitext reads elsewhere/benchmarks/wikitext-2-raw/wiki.test.raw, which is"),
        (["tasks=[]"], "eval_harness.tasks must be a non-empty list of distinct harness task names"),
        (["tasks=[mmlu]"], "'mmlu' is not a task of lm-evaluation-harness (a group or tag of several tasks"),
    ],
)
def test_bad_tasks_and_missing_data_stop_before_any_model_loads(tmp_path, monkeypatch, args, message):
    run = shared_run()
    ci_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")

    def no_model(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_model)
    base = ["--models", f"pretrain={run / 'data/pretrain/model'}", "--data", str(run / "data/prepare_data")]
    with pytest.raises(config.UserError) as err:
        eval_harness.main([*base, "--output", "out", *args])
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()
