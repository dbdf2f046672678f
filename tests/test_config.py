"""Config loading: every shipped params/preset file loads; bad params fail naming the key."""

from __future__ import annotations

import importlib
from dataclasses import FrozenInstanceError

import pytest
from conftest import ROOT, run_stage

from pipelines import preset
from pipelines.dag import load_table
from stages.common import config, sweep


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
    # (sweeps: not a stage's section; each declared sweep is checked against the stages that run once)
    table = load_table()
    sweep.load(data, {name for name, st in table.items() if not (st.foreach or st.collect)}, source)
    configs = stage_configs({k: v for k, v in data.items() if k != "sweeps"})
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


def load_pretrain(overrides=()):
    from stages.pretrain import Config

    return config.load(Config, "pretrain", ROOT / "params.yaml", overrides)


def test_sub_sections_are_typed_and_overridden_by_dotted_paths():
    cfg = load_pretrain(["train.lr=3e-4", "pretrain.model.n_layers=2", "train.strategy=fsdp"])
    assert (cfg.train.lr, cfg.model.n_layers, cfg.train.strategy) == (3e-4, 2, "fsdp")
    default = load_pretrain()
    assert cfg.train.steps == default.train.steps and cfg.model.hidden_size == default.model.hidden_size
    assert config.as_dict(cfg)["train"]["lr"] == 3e-4, "as_dict keeps the nesting (MLflow params, checkpoint keys)"


def test_a_mapping_field_is_overridden_key_by_key():
    from stages.extend_context import Config

    cfg = config.load(Config, "extend_context", ROOT / "params.yaml", ["variants.yarn.beta_fast=4"])
    assert cfg.variants["yarn"] == {"rope_type": "yarn", "beta_fast": 4, "beta_slow": 1}
    assert set(cfg.variants) == {"linear", "dynamic", "yarn", "llama3"}
    # a whole mapping given replaces it (so entries can be left out)
    cfg = config.load(
        Config, "extend_context", ROOT / "params.yaml", ["variants={lin: {rope_type: linear}}", "finetune=[]"]
    )
    assert cfg.variants == {"lin": {"rope_type": "linear"}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lr=fast"], "params.yaml: pretrain.train.lr must be a float, got 'fast'"),
        (
            ["train.lrr=1"],
            "unknown key pretrain.train.lrr; valid keys are: activation_checkpointing, activation_checkpointing_every",
        ),
        (["lr=1"], "unknown key pretrain.lr (did you mean pretrain.train.lr?)"),
        (["train=3"], "section 'pretrain.train' must be a mapping of keys (steps, batch_size, "),
        (["context_length.x=1"], "sets a key inside pretrain.context_length, which is a value"),
        (["train.strategy=zero"], "pretrain.train.strategy: unknown strategy 'zero'; valid: ddp, fsdp"),
        (["model.n_heads=3"], "pretrain.model.hidden_size must be a multiple of n_heads"),
        (["train.min_lr=0.1"], "pretrain.train.min_lr must be between 0 and lr (0.001), got 0.1"),
        (["tokenize.vocab_size=1"], "is for section 'tokenize', not 'pretrain'"),
        (["train.optimizer=sgd"], "pretrain.train.optimizer: unknown optimizer 'sgd'; valid: adamw, adamw8bit, "),
        (["train.activation_checkpointing=half"], "pretrain.train.activation_checkpointing: unknown policy 'half'"),
        (["train.strategy=fsdp", "train.optimizer=adamw8bit"], "adamw8bit keeps its states per whole parameter"),
        (["train.offload=true"], "pretrain.train.offload: FSDP2's CPU offload shards parameters to the host; set "),
        (["train.async_checkpoint=maybe"], "pretrain.train.async_checkpoint must be a boolean (true/false), got "),
    ],
)
def test_errors_in_sub_sections_name_the_dotted_key(overrides, message):
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        load_pretrain(overrides)


def test_a_missing_sub_section_key_is_named(tmp_path):
    text = (ROOT / "params.yaml").read_text().replace("    grad_clip: 1.0             # max global gradient norm\n", "")
    with pytest.raises(config.ConfigError, match="missing key pretrain.train.grad_clip; add it"):
        config.load(__import__("stages.pretrain").pretrain.Config, "pretrain", write(tmp_path, text))


def test_offload_is_refused_where_it_cannot_act():
    import torch

    from stages.common import runtime

    train = load_pretrain(["train.strategy=fsdp", "train.offload=true"]).train
    two_cpus = runtime.Runtime(0, 2, 0, 2, torch.device("cpu"))
    with pytest.raises(config.UserError, match="pretrain.train.offload: .* this run is on cpu, where they are there"):
        train.check_layout("pretrain.train", two_cpus)
    with pytest.raises(config.UserError, match="pretrain.train.offload: .* a single process"):
        train.check_layout("pretrain.train", runtime.Runtime(0, 1, 0, 1, torch.device("cuda", 0)))
    train.check_layout("pretrain.train", runtime.Runtime(0, 2, 0, 2, torch.device("cuda", 0)))  # where it acts


def test_every_dag_stage_is_a_known_params_section():
    """An override naming another stage's section is refused (config.STAGE_SECTIONS): it lists them all."""
    assert set(config.STAGE_SECTIONS) == set(load_table())


def test_check_validates_the_command_line_and_params_without_running(workdir):
    ok = run_stage("pretrain", ["--check", "train.lr=3e-4", "--output", "never"], cwd=workdir)
    assert "lr: 0.0003" in ok.stdout and not (workdir / "never").exists()
    bad = run_stage("finetune_qlora", ["--check", "lora.rank=8"], cwd=workdir, check=False)
    assert bad.returncode == 2 and "unknown key finetune_qlora.lora.rank" in bad.stderr


@pytest.mark.parametrize(
    "world, keys",
    [
        (8, {"tensor_parallel": 2, "pipeline_parallel": 2, "strategy": "fsdp"}),
        (8, {"data_parallel_replicate": 2, "strategy": "fsdp"}),
        (12, {"tensor_parallel": 3, "data_parallel_replicate": 2, "strategy": "fsdp"}),
        (4, {}),
    ],
)
def test_a_layout_places_each_rank_where_the_device_mesh_does(world, keys):
    """The data-parallel rank a process reads batches as is its place along the mesh's data dimensions
    when ranks fill the (pipeline, replicate, shard, tensor) mesh row-major, as init_device_mesh fills it."""
    import numpy as np
    import torch

    from stages.common import runtime, train_config
    from stages.common.mesh import Layout

    cfg = train_config.build(**keys)
    grid = np.arange(world).reshape(Layout.of(cfg, runtime.Runtime(0, world, 0, world, torch.device("cpu"))).shape)
    for rank in range(world):
        layout = Layout.of(cfg, runtime.Runtime(rank, world, 0, world, torch.device("cpu")))
        pp, replicate, shard, tp = (int(i[0]) for i in np.nonzero(grid == rank))
        assert layout.processes == world and layout.data_size == grid.shape[1] * grid.shape[2]
        assert layout.data_rank == replicate * grid.shape[2] + shard
        assert layout.pipeline_rank == pp and layout.stage_size == world // grid.shape[0]
        assert layout.leads_stage == (replicate == shard == tp == 0)
        assert layout.splits_model == (grid.shape[0] * grid.shape[3] > 1) and layout.data_parallel
        assert Layout.over(cfg, world, rank) == layout  # (before any process starts: the launcher's)


def test_every_reduce_dtype_has_its_torch_dtype():
    from stages.common import parallel, train_config

    assert tuple(parallel.REDUCE_TORCH_DTYPES) == train_config.REDUCE_DTYPES


def test_a_layout_the_processes_cannot_form_is_refused_with_the_key():
    import torch

    from stages.common import runtime, train_config
    from stages.common.mesh import Layout

    cfg = train_config.build(tensor_parallel=2, strategy="fsdp")
    with pytest.raises(ValueError, match="tensor_parallel: 2 does not divide the 3 processes"):
        Layout.of(cfg, runtime.Runtime(0, 3, 0, 3, torch.device("cpu")))


def test_a_batch_is_shared_by_any_process_count_that_divides_it():
    """The params fix the global batch and the largest micro-batch; the processes and the accumulation
    follow: every process count that divides batch_size runs the same step (each micro-batch as large as
    its share allows, at most micro_batch_size), and one that does not is refused naming those that do."""
    from stages.common import train_config

    cfg = train_config.build(batch_size=16, micro_batch_size=8)
    layouts = {p: (train_config.micro_batch(cfg, p), train_config.grad_accum_steps(cfg, p)) for p in (1, 2, 4, 8, 16)}
    assert layouts == {1: (8, 2), 2: (8, 1), 4: (4, 1), 8: (2, 1), 16: (1, 1)}
    assert all(p * micro * accum == 16 for p, (micro, accum) in layouts.items())
    odd = train_config.build(batch_size=12, micro_batch_size=5)
    assert (train_config.micro_batch(odd, 1), train_config.grad_accum_steps(odd, 1)) == (4, 3)
    with pytest.raises(
        ValueError,
        match=r"batch_size \(16 sequences per step\) cannot be shared evenly by 3 data-parallel "
        r"processes; it can by 1, 2, 4, 8, 16: run on one of those, or set batch_size to a multiple of 3",
    ):
        train_config.micro_batch(cfg, 3)


# The process counts each training stage's shipped params run on: one GPU, 2 CPU processes, 4, a node of 8.
# extend_context's tiny default fine-tunes on 4 sequences per step, which 8 processes cannot share.
PROCESS_COUNTS = {"pretrain": (1, 2, 4, 8), "extend_context": (1, 2, 4), "finetune_qlora": (1, 2, 4, 8)}


@pytest.mark.parametrize("source", sorted(shipped_params()))
def test_every_shipped_train_section_runs_on_the_process_counts_it_targets(source):
    """Each training stage's params, in params.yaml and every preset, pass the checks a run makes once its
    processes are known (layout and batch) on the process counts it targets, and 8 processes either run
    it or are refused in one line naming the counts that do."""
    import torch

    from stages.common import runtime
    from stages.common.train_config import TrainConfig

    data = shipped_params()[source]
    for section, counts in PROCESS_COUNTS.items():  # (memory_study measures one process at a time)
        train = config.build(stage_configs([section])[section], section, data[section], source).train
        assert isinstance(train, TrainConfig)
        degree = train.tensor_parallel * train.pipeline_parallel * train.data_parallel_replicate
        device = torch.device("cuda" if train.offload else "cpu")  # (offload is a GPU preset's)
        for processes in (p for p in (1, 2, 4, 8) if p % degree == 0 and (p > 1 or not train.offload)):
            rt = runtime.Runtime(0, processes, 0, processes, device)
            if processes in counts or train.batch_size % (processes // degree) == 0:
                train.check_layout(f"{section}.train", rt)
            else:
                with pytest.raises(config.UserError, match=rf"{section}.train.batch_size .* it can by 1, 2, 4"):
                    train.check_layout(f"{section}.train", rt)
