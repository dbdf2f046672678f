"""Config loading: every shipped params/preset file loads; bad params fail naming the key."""

from __future__ import annotations

import importlib
from dataclasses import FrozenInstanceError

import pytest
from conftest import ROOT

from pipelines import preset
from pipelines.dag import load_table
from stages.common import config


def stage_configs(sections) -> dict:
    """The Config class of each params section (module = stage = params section)."""
    return {name: importlib.import_module(f"stages.{name}").Config for name in sections}


def shipped_params() -> dict[str, dict]:
    base = config.read_yaml(ROOT / "params.yaml")
    files = {"params.yaml": base}
    for name in preset.available():
        files[f"presets/{name}.yaml"] = config.merge(base, config.read_yaml(preset.preset_path(name)))
    return files


@pytest.mark.parametrize("source", sorted(shipped_params()))
def test_every_section_of_every_shipped_file_loads(source):
    data = shipped_params()[source]
    missing = set(load_table()) - set(data)
    assert not missing, f"{source}: no section for the DAG stage(s) {sorted(missing)}"
    configs = stage_configs(data)
    for section, cls in configs.items():
        cfg = config.build(cls, section, data[section], source)
        with pytest.raises(FrozenInstanceError):
            setattr(cfg, next(iter(config.as_dict(cfg))), None)


def test_preset_only_changes_existing_keys(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    preset.apply("ci", params)
    merged = config.read_yaml(params)
    overlay = config.read_yaml(preset.preset_path("ci"))
    assert merged["tokenize"]["vocab_size"] == overlay["tokenize"]["vocab_size"]
    assert "# byte-level BPE" in params.read_text(), "comments of params.yaml are kept"


def write(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def load_tokenize(path, overrides=()):
    from stages.tokenize import Config

    return config.load(Config, "tokenize", path, overrides)


GOOD = "tokenize:\n  vocab_size: 512\n  min_frequency: 2\n  train_max_bytes: 0\n  batch_lines: 8\n  shard_tokens: 100\n"


def test_overrides_are_typed(tmp_path):
    cfg = load_tokenize(write(tmp_path, GOOD), ["vocab_size=1024", "tokenize.batch_lines=16"])
    assert (cfg.vocab_size, cfg.batch_lines) == (1024, 16)


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("tokenize: [unclosed\n", (), "malformed YAML at line"),
        (GOOD + "  vocab: 3\n", (), "unknown key tokenize.vocab; valid keys are"),
        (GOOD.replace("  min_frequency: 2\n", ""), (), "missing key tokenize.min_frequency"),
        (GOOD, ("vocab_size=big",), "tokenize.vocab_size must be an int, got 'big'"),
        (GOOD.replace("vocab_size: 512", "vocab_size: 5.5"), (), "tokenize.vocab_size must be an int, got 5.5"),
        (GOOD, ("vocab_size=100",), "vocab_size must be at least 258"),
        ("prepare_data: {}\n", (), "missing section 'tokenize'"),
        (GOOD, ("nonsense",), "must look like key=value"),
        (GOOD, ("pretrain.lr=1",), "is for section 'pretrain'"),
    ],
)
def test_bad_params_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_tokenize(write(tmp_path, text), overrides)


def test_float_accepts_int_and_lists_become_tuples(tmp_path):
    from stages.prepare_data import Config

    path = write(
        tmp_path,
        "prepare_data:\n  corpus: x\n  text_field: text\n  val_fraction: 0.1\n  test_fraction: 0.1\n"
        "  max_bytes: 0\n  instructions: none\n  instructions_max_records: 0\n  graphs: [Cora]\n",
    )
    cfg = config.load(Config, "prepare_data", path)
    assert cfg.graphs == ("Cora",)
    with pytest.raises(config.ConfigError, match="graphs: unknown graph 'Karate'; valid: Cora, CiteSeer, PubMed"):
        config.load(Config, "prepare_data", path, ["graphs=[Karate]"])
    with pytest.raises(config.ConfigError, match="prepare_data.val_fraction must be a float, got 'x'"):
        config.load(Config, "prepare_data", path, ["val_fraction=x"])
