"""eval_harness: lm-evaluation-harness tasks on the models the pipeline published, computed by the harness.

Runs the harness (`lm_eval.simple_evaluate`, its `hf` model loading each model folder) on the tasks of
`eval_harness.tasks`:
    wikitext         the harness's own `wikitext` task definition, unchanged but for its dataset: the
                     WikiText-2 test split prepare_data copied and verified (--data, its
                     benchmarks/wikitext-2-raw/wiki.test.raw), read as the hub's document-level WikiText
                     (stages/common/wikitext.py). No network. Word perplexity, byte perplexity, bits per byte.
    any other name   a task of the installed harness as it ships, its dataset from the Hugging Face hub
                     (a machine that reaches it; `lm_eval --tasks list` names them)
Every task and its dataset is loaded before any model, so a bad name or a missing dataset stops the
stage in one line. A folder holding models in subfolders (extend_context's variants) stands for each.
Under torchrun the models are dealt to the ranks, each evaluated whole by one process (the harness's
own data parallelism is for `accelerate launch` on GPUs); rank 0 gathers and writes. A rank with fewer
models waits for the others in that gather, within the collective timeout (1800 s): a model whose tasks
take longer runs with one process per model, or alone (`--nproc-per-node 1`). Figures equal the harness's
own run in fp32 (precision fp32, the default on CPUs); in bf16 the harness sums in bf16 too.

Writes to --output:
    harness.json     per model and task: the harness's figures, task version, few-shot count and samples
                     (its timings and dates go to --measured, its configs are left out)
    figures.json     {model: {task: {metric: value}}} (the harness's metric names)
    metrics.json     per task its headline figure per model (wikitext: word perplexity; DVC metrics)
    meta.json        the lm_eval version, dtype, max_length, limit, the code's hash and the package versions
Measured (--measured): seconds per model and task.

Run:
    python -m stages.eval_harness --models data/pretrain/model --data data/prepare_data \\
        --output data/eval_harness/pretrain
    torchrun --nproc-per-node 2 -m stages.eval_harness --models data/extend_context/model --data data/prepare_data \\
        --output data/eval_harness/extend_context tasks=[wikitext] limit=4
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stages.common import atomic, config, hf_folder, runtime, stage, timing, wikitext

STAGE = "eval_harness"
WIKITEXT_FILE = Path("benchmarks") / "wikitext-2-raw" / "wiki.test.raw"
LOCAL_TASK = "wikitext_prepared"  # the harness's wikitext task on prepare_data's copy, reported as `wikitext`


@dataclass(frozen=True)
class Config:
    tasks: tuple[str, ...]
    limit: int  # documents (samples) per task, the harness's --limit (0 = all)
    batch_size: int
    max_length: int  # tokens per window (0 = the harness's default: the model's max_position_embeddings)
    precision: str  # auto (bf16 on GPUs, fp32 on CPUs) | fp32 | bf16 | fp16

    def __post_init__(self):
        runtime.check_precision(self.precision)
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks must be a non-empty list of distinct harness task names, got {list(self.tasks)}")
        if self.limit < 0 or self.batch_size < 1 or self.max_length < 0:
            raise ValueError("limit and max_length must be >= 0 (0: all, the model's) and batch_size >= 1")


def model_folders(items: list[str]) -> dict[str, Path]:
    """{label: folder}: `label=path` or a path (labelled by its folder); a folder of models stands for each."""
    out = {}
    for item in items:
        label, _, where = item.rpartition("=")
        folder = Path(where)
        family = sorted(d for d in folder.glob("*/") if (d / "config.json").is_file())
        if not (folder / "config.json").is_file() and family:
            out |= {d.name: d for d in family}
            continue
        hf_folder.check(folder, f"eval_harness: --models {item}: {folder}", "pass a model folder or a folder of them")
        out[label or folder.name] = folder
    if not out:
        raise config.UserError("eval_harness: pass --models FOLDER ... (Hugging Face model folders)")
    return out


def task_yaml(folder: Path, pages: Path) -> None:
    """The harness's wikitext.yaml, included unchanged, with its dataset pointed at `pages`."""
    import lm_eval

    definition = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "wikitext.yaml"
    (folder / f"{LOCAL_TASK}.yaml").write_text(
        f"include: {definition}\n"
        f"task: {LOCAL_TASK}\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {pages}\n"
        "training_split: null\n"
        "validation_split: null\n"
    )


def load_tasks(cfg: Config, data: Path, workdir: Path):
    """(the harness's TaskManager, {task name as asked: its name there}), every task's dataset loaded once
    to check it (no model yet)."""
    from lm_eval.tasks import TaskManager

    wanted = {}
    if "wikitext" in cfg.tasks:
        raw = data / WIKITEXT_FILE
        if not raw.is_file():
            raise config.UserError(
                f"eval_harness: task wikitext reads {raw}, which is not there; add wikitext2 to "
                f"prepare_data.benchmarks and re-run prepare_data (or pass --data FOLDER holding {WIKITEXT_FILE})"
            )
        pages = workdir / "pages.jsonl"
        try:
            docs = wikitext.documents(raw.read_text(encoding="utf-8"))
        except ValueError as e:
            raise config.UserError(f"eval_harness: {raw}: {e}; it is not a raw WikiText split") from None
        pages.write_text("".join(json.dumps({"page": d}) + "\n" for d in docs), encoding="utf-8")
        task_yaml(workdir, pages)
        wanted["wikitext"] = LOCAL_TASK
    # The harness's own task index (thousands of YAML files, seconds per process) only when a task of
    # its own is asked: wikitext's definition is read through the include above.
    manager = TaskManager(include_path=str(workdir), include_defaults=set(cfg.tasks) != {"wikitext"})
    for name in cfg.tasks:
        if name == "wikitext":
            continue
        if name not in manager.all_subtasks:
            what = "a group or tag of several tasks; name its tasks one by one" if name in manager.all_tasks else ""
            raise config.UserError(
                f"eval_harness: {name!r} is not a task of lm-evaluation-harness"
                + (f" ({what})" if what else " (`lm_eval --tasks list` names them)")
            )
        wanted[name] = name
    for name, task in wanted.items():
        try:
            manager.load([task])
        except Exception as e:  # the harness raises whatever `datasets` does for a dataset it cannot read
            hint = "" if name == "wikitext" else "; hub tasks need a machine that reaches huggingface.co"
            raise config.UserError(
                f"eval_harness: task {name}: its dataset did not load ({type(e).__name__}: {str(e)[:300]}){hint}"
            ) from None
    return manager, wanted


def figures_of(results: dict) -> dict:
    """{metric: value} from the harness's `metric,filter` keys (its stderr and labels left out)."""
    out = {}
    for key, value in results.items():
        metric, _, _ = key.partition(",")
        if "," in key and not metric.endswith("_stderr") and isinstance(value, (int, float)):
            out[metric] = value
    return out


@contextlib.contextmanager
def as_one_process():
    """LOCAL_RANK 0 while the harness runs: it keeps the results of a torchrun process of another local rank
    to itself (for tensor-parallel launches, where every rank computes the same)."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = before


@timing.phase("evaluation")
def evaluate(folder: Path, tasks, cfg: Config, rt: runtime.Runtime) -> tuple[dict, dict]:
    """({task: harness record}, {task: seconds}) of one model, on this rank alone: the weights are loaded
    here, as the harness's `hf` model loads them, and handed to it as a model of one process (given a
    folder under torchrun it would take the ranks for its own data parallelism, which is for GPUs)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = runtime.compute_dtype(rt.device, cfg.precision)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True).to(rt.device).eval()
    lm = HFLM(
        pretrained=model,
        tokenizer=AutoTokenizer.from_pretrained(folder),
        batch_size=cfg.batch_size,
        max_length=cfg.max_length or None,
    )
    manager, names = tasks
    records, seconds = {}, {}
    for name, task in names.items():
        started = time.perf_counter()
        with as_one_process():
            run = lm_eval.simple_evaluate(
                model=lm, tasks=[task], task_manager=manager, limit=cfg.limit or None, log_samples=False
            )
        seconds[name] = round(time.perf_counter() - started, 2)
        task = next(iter(run["results"]))
        records[name] = {
            "figures": figures_of(run["results"][task]),
            "version": run["versions"].get(task),
            "n-shot": run.get("n-shot", {}).get(task),
            "samples": run["n-samples"][task],
        }
    del lm, model  # before the next model loads
    gc.collect()
    return records, seconds


def headline(figures: dict) -> dict:
    """metrics.json: per task its first figure (wikitext: word perplexity, the figure papers quote), per model."""
    out = {}
    for label, per_task in figures.items():
        for task, metrics in per_task.items():
            name = next(iter(sorted(metrics, key=lambda m: (m != "word_perplexity", m))), None)
            if name is not None:
                out.setdefault(task, {}).setdefault(name, {})[label] = metrics[name]
    return out


def run(models: dict, tasks: dict, cfg: Config, output: Path, measured: Path, rt, tracker) -> dict:
    from importlib.metadata import version

    labels = sorted(models)
    runtime.share_cores(rt, len(labels))  # (one model on two processes: the one evaluating gets both cores)
    mine = {label: evaluate(models[label], tasks, cfg, rt) for label in labels[rt.rank :: rt.world_size]}
    everything = {}
    for part in runtime.gather_objects(mine):
        everything |= part
    records = {label: everything[label][0] for label in labels}
    figures = {label: {task: r["figures"] for task, r in per.items()} for label, per in records.items()}
    if rt.is_main:
        with atomic.folder(output) as tmp:
            atomic.write_json(tmp / "harness.json", {"lm_eval": version("lm_eval"), "models": records})
            stage.write_metrics(tmp, figures, headline(figures))
            dtype = str(runtime.compute_dtype(rt.device, cfg.precision))
            atomic.write_json(
                tmp / "meta.json",
                {
                    "lm_eval": version("lm_eval"),
                    "compute_dtype": dtype,
                    "max_length": cfg.max_length,
                    "limit": cfg.limit,
                    **stage.code_record(STAGE),
                },
            )
        stage.write_measured(measured, output, {"seconds": {label: everything[label][1] for label in labels}})
        for label, per in figures.items():
            tracker.log_metrics({f"{label}.{task}.{m}": v for task, f in per.items() for m, v in f.items()})
        tracker.log_artifact(output / "harness.json")
        tracker.log_artifact(measured)
        for label, per in figures.items():
            shown = ", ".join(f"{task} {m} {v:.4g}" for task, f in per.items() for m, v in f.items())
            runtime.print0(f"eval_harness: {label}: {shown}", rt=rt)
    return figures


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = stage.parse_cli(__doc__, {"models": [], "data": "data/prepare_data", "output": ""}, argv)
    # `label=path` models look like overrides to the shared parser; params keys tell them apart.
    keys = {f.name for f in dataclasses.fields(Config)}

    def is_key(item: str) -> bool:
        return item.partition("=")[0].removeprefix(f"{STAGE}.") in keys

    cfg = config.load(Config, STAGE, args.params, [o for o in overrides if is_key(o)])
    models = model_folders(sorted([m for m in args.models + overrides if not is_key(m)], key=argv.index))
    output = Path(args.output or f"data/{STAGE}/{next(iter(models))}")
    measured = Path(args.measured or f"{output}.measured.json")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="eval_harness-") as work:
        tasks = load_tasks(cfg, Path(args.data), Path(work))  # every task and dataset, before any model
        stage.exit_if_checking(args, STAGE, cfg)
        inputs = [*models.values(), *([Path(args.data) / WIKITEXT_FILE] if "wikitext" in cfg.tasks else [])]

        def body(rt, stop):
            with stage.tracked(STAGE, cfg, inputs, rt, tags={"models": " ".join(args.models)}) as (tracker, _):
                return run(models, tasks, cfg, output, measured, rt, tracker)

        return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
