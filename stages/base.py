"""base: the model the later stages start from when it is not the pipeline's own pretrain, copied into the
pipeline so that DVC versions it and every stage reading it records where it came from.

`base.model` is a hub id (org/name) with `base.revision` pinned (a commit hash; a branch or tag is resolved
to the commit it points at now), or a local Hugging Face folder. With it set, the DAG (pipelines/dag.py)
leaves pretrain out: extend_context and finetune_qlora start from data/base/model, the evaluations score it
as `base`, and tokenize encodes the corpus with its tokenizer, so the shards speak its vocabulary.
A gated, missing or unreachable model is one error line before anything is written (stages/common/hub.py).

Writes data/base/:
    model/      the model's config, tokenizer and safetensors weights, as on the hub at that commit
                (AutoModelForCausalLM.from_pretrained("data/base/model"))
    meta.json   the model, the revision asked for and the commit resolved, each file's bytes and sha256,
                and the code record every output carries

Run:
    python -m stages.base --output data/base model=meta-llama/Meta-Llama-3-8B revision=<commit>
    snakemake --cores all base              # or: dvc repro base
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from stages.common import atomic, config, environment, hub, runtime, stage
from stages.common.tracking import runs

STAGE = "base"


@dataclass(frozen=True)
class Config:
    model: str  # a hub id (org/name) or a Hugging Face model folder; "" = the pipeline's own pretrain
    revision: str  # hub: a commit hash, or a branch or tag resolved to one


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def copy_model(source: hub.Base, dest: Path) -> dict:
    """The files a stage loads, copied from the snapshot or folder into dest; {name: {bytes, sha256}}."""
    import fnmatch

    dest.mkdir(parents=True)
    files = {}
    for path in sorted(source.folder.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in hub.FILES):
            shutil.copyfile(path, dest / path.name)  # (the hub cache holds symlinks to its blobs: the bytes)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256(dest / path.name)}
    return files


def fetch(cfg: Config, output: Path) -> dict:
    if not cfg.model:
        raise config.UserError(
            "params.yaml: base.model is empty, so the pipeline's own pretrain is the base (data/pretrain/model) "
            "and this stage has nothing to do; set base.model to a hub id or a model folder"
        )
    source = hub.resolve(cfg.model, cfg.revision, "params.yaml: base.model")
    with atomic.folder(output) as tmp:
        files = copy_model(source, tmp / "model")
        meta = {**source.record(), "files": files, **stage.code_record(STAGE)}
        atomic.write_json(tmp / "meta.json", meta)
    return meta


def main(argv=None) -> dict:
    args, cfg = stage.setup(__doc__, STAGE, Config, {"output": "data/base"}, argv)
    output = Path(args.output)

    def body(rt, stop):
        meta = None
        if rt.is_main:
            with runs.start_run(STAGE, config.as_dict(cfg), "", rt, tags=environment.run_tags(STAGE)) as tracker:
                meta = fetch(cfg, output)
                tracker.set_tags({k: v for k, v in meta.items() if k.startswith("base_")})
                tracker.log_metrics({"bytes": sum(f["bytes"] for f in meta["files"].values())})
                tracker.log_artifact(output / "meta.json")
            at = f"@{meta['base_commit']}" if meta.get("base_commit") else ""
            print(f"base: {meta['base_model']}{at}, {len(meta['files'])} files -> {output}/model")
        return runtime.broadcast_object(meta)

    return stage.launch(STAGE, body)


if __name__ == "__main__":
    stage.entry(main)
