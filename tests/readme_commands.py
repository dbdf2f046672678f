"""The shell commands of README.md and of every page in docs/, each with how the tests try it.

Every command line of every ```bash block of those pages is in `HOW` (one entry for a command that
several pages show), with one of:
    run      run as written in a copy of the shared ci pipeline run (tests/shared_run.py)
    check    a stage command: run there with `--check` (command line and params checked, no compute)
    make     a make target: `make -n` (the recipe resolves; nothing runs)
    marked   not run, with the reason (GPU, cluster, network, long, or run by another test)
A command missing from `HOW` fails tests/test_readme.py, so a new one gets tried or a reason.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LONG_DAG = "long: the whole DAG (tests/test_e2e.py runs it on the ci preset; CI runs make test)"
SLURM = "cluster: SLURM (tests/system/test_two_nodes.py runs the pipeline on a SLURM cluster it starts)"
EXP = "long: re-runs the stages after the changed param (tests/test_e2e.py runs a dvc exp run)"

HOW: dict[str, tuple[str, str]] = {
    "make run": ("marked", LONG_DAG),
    "snakemake --profile pipelines/profiles/local -n": ("run", "a dry run: after the pipeline, nothing to do"),
    "python -m pipelines.preset ci": ("marked", "every clone the tests make runs it (tests/shared_run.py: make_clone)"),
    "git clone <repository URL> pipelines && cd pipelines": (
        "marked",
        "network: a clone (tests/shared_run.py makes each test's repository from the working tree)",
    ),
    "git checkout params.yaml dvc.lock measured": ("marked", "undoes a preset's run in the user's repository"),
    "make test": ("marked", "CI's own command"),
    "make mirror DIR=$HOME/pipeline-data": ("make", ""),
    "PIPELINE_DATA_MIRROR=$HOME/pipeline-data make test": ("marked", "CI's own command, on a mirror"),
    "source .venv/bin/activate": ("marked", "shell set-up"),
    "snakemake --profile pipelines/profiles/local": ("marked", LONG_DAG),
    "snakemake --cores all tokenize": ("run", "current after the pipeline: runs nothing"),
    "dvc repro": ("run", "current after the pipeline: runs nothing"),
    "dvc status": ("run", ""),
    "dvc metrics show": ("run", ""),
    "dvc exp run -S tokenize.vocab_size=8192": ("marked", EXP),
    "python -m stages.tokenize --input data/prepare_data --output data/tokenize vocab_size=8192": ("check", ""),
    "torchrun --nproc-per-node 2 -m stages.tokenize --input data/prepare_data --output data/tokenize": ("check", ""),
    "snakemake --profile pipelines/profiles/slurm": ("marked", SLURM),
    "snakemake --profile pipelines/profiles/slurm --config mlflow_tracking_uri=http://mlflow-host:5000": (
        "marked",
        SLURM + " and an MLflow server",
    ),
    "mlflow server --backend-store-uri sqlite:///$HOME/mlflow/mlflow.db --artifacts-destination $HOME/mlflow/artifacts "
    "--host 0.0.0.0 --port 5000 --workers 2": (
        "marked",
        "a server for the cluster's nodes (tests/system/test_two_nodes.py starts one on its bridge address)",
    ),
    "apptainer build containers/lm.sif containers/lm/apptainer.def": ("marked", "needs apptainer and root"),
    "apptainer build containers/gnn.sif containers/gnn/apptainer.def": ("marked", "needs apptainer and root"),
    'snakemake --profile pipelines/profiles/slurm --software-deployment-method apptainer --apptainer-args "--nv"': (
        "marked",
        SLURM + " with apptainer and GPUs",
    ),
    "podman build -f containers/lm/Dockerfile -t pipeline-lm .": (
        "marked",
        "needs podman and root (tests/system/test_containers.py builds and runs the image)",
    ),
    'podman run --rm -v "$PWD:/work" pipeline-lm python -m pipelines.launch tokenize --input data/prepare_data '
    "--output data/tokenize": ("marked", "needs podman and root (tests/system/test_containers.py)"),
    "cat reports/results.md": ("run", ""),
    "python -m pipelines.verify": ("run", "every link holds after the pipeline"),
    "python -m pipelines.verify --rehash": ("run", "every out's bytes are those dvc.lock records"),
    "python -m pipelines.verify --against published.lock": (
        "marked",
        "needs another run's dvc.lock (tests/test_e2e_records.py compares with one)",
    ),
    "python -m pipelines.crate --out run.crate.zip": ("run", ""),
    "python -m pipelines.crate check run.crate.zip": (
        "marked",
        "installs the validator's venv from PyPI on first use; tests/test_crate.py validates the shared run's crate",
    ),
    "python -m pipelines.verify --against run.crate.zip": (
        "marked",
        "tests/test_crate.py runs it against the shared run's crate, and in a copy with a params value changed",
    ),
    "make plots": ("make", ""),
    "make html-report": ("make", ""),
    "snakemake --report snakemake-report.html": ("run", ""),
    "make exp-show": ("run", "at most ~40 columns"),
    "make exp-show KEEP='pretrain\\.train\\.lr$'": ("run", ""),
    "dvc exp show --only-changed": ("run", ""),
    "dvc metrics diff": ("run", ""),
    "dvc plots diff": ("run", ""),
    "dvc exp run -S pretrain.train.steps=600": ("marked", EXP),
    "dvc exp run --queue -S pretrain.train.lr=3e-4,1e-3": ("marked", EXP),
    "dvc exp run --run-all && dvc exp show": ("marked", EXP),
    "dvc exp run --temp -S pretrain.train.lr=1e-3": ("marked", EXP),
    "git checkout params.yaml && dvc checkout": ("marked", "undoes an experiment run in the workspace"),
    "dvc exp apply <experiment>": ("marked", "needs an experiment (tests/test_e2e.py makes one)"),
    "dvc exp branch <experiment> <branch>": ("marked", "needs an experiment"),
    "dvc exp remove <experiment>": ("marked", "needs an experiment"),
    "dvc remote add -d store /shared/project/dvc-store": ("run", "writes .dvc/config only"),
    "dvc remote modify --local store keyfile ~/.ssh/id_ed25519": (
        "marked",
        "an SSH remote's setting (tests/system/test_two_nodes.py sets it for the SSH remote on its second node)",
    ),
    'git add .dvc/config && git commit -m "the team remote"': ("marked", "commits in the user's repository"),
    "MLFLOW_AUTH_CONFIG_PATH=/srv/mlflow/auth.ini MLFLOW_FLASK_SERVER_SECRET_KEY=another-random-string mlflow "
    "server --app-name basic-auth --backend-store-uri sqlite:////srv/mlflow/mlflow.db --artifacts-destination "
    "/srv/mlflow/artifacts --host 0.0.0.0 --port 5000": (
        "marked",
        "a server (tests/system/test_two_nodes.py starts one with users on its cluster's bridge)",
    ),
    'curl -u admin:$ADMIN_PASSWORD -H \'Content-Type: application/json\' -d \'{"username": "alice", '
    '"password": "12-or-more-characters"}\' http://mlflow-host:5000/api/2.0/mlflow/users/create': (
        "marked",
        "a server with users (tests/system/test_two_nodes.py creates its users through this API)",
    ),
    "export MLFLOW_TRACKING_USERNAME=alice MLFLOW_TRACKING_PASSWORD=...": ("marked", "shell set-up"),
    "make push": ("make", "tests/test_e2e_remote.py pushes to a folder remote and pulls in fresh clones"),
    'git add dvc.lock measured && git commit -m "results" && git push': (
        "marked",
        "commits and pushes in the user's repository",
    ),
    "python -m stages.eval_perplexity --models models:/pretrain@reproduced --input data/tokenize "
    "--output data/eval_perplexity/registered": (
        "marked",
        "run by tests/test_e2e.py (check_registry) right after its pipeline: later params changes leave the "
        "alias on a model of an earlier tokenizer, which the command then refuses",
    ),
    "make mlflow-ui": ("marked", "a server (tests/system/test_browser.py serves it and browses it)"),
    "make mlflow-ui MLFLOW_PORT=5001": ("marked", "a server (tests/system/test_browser.py)"),
    "hf auth login": ("marked", "network: interactive hub login"),
    "python -m pipelines.plan": ("run", "the clone's params on its CPUs"),
    "python -m pipelines.plan --json": (
        "marked",
        "the same figures as the command above (tests/test_plan.py reads them)",
    ),
    "python -m pipelines.plan --preset llama3-8b-qlora --gpus 8 --gpu-mem 80": (
        "marked",
        "tests/test_plan.py plans every preset at the GPUs it targets",
    ),
    "python -m pipelines.plan --gpus 1 --gpu-mem 24 --stage finetune_qlora@nf4 finetune_qlora.train.micro_batch_size=1": (  # noqa: E501
        "marked",
        "tests/test_plan.py: a 24 GB GPU trains and merges the 8B QLoRA",
    ),
    "python -m pipelines.dag write": ("run", "with the clone's params: writes dvc.yaml as it is"),
    "snakemake -n data/finetune_qlora/nf4": ("run", "a dry run (tests/test_base.py plans and runs a hub base)"),
    "python -m pipelines.preset llama3-8b-qlora": ("run", "in a copy of the clone's params.yaml"),
    "snakemake --profile pipelines/profiles/slurm data/finetune_qlora/nf4 data/finetune_qlora/none": (
        "marked",
        SLURM,
    ),
    "torchrun --nproc-per-node 2 -m stages.pretrain --input data/tokenize --output data/pretrain train.strategy=fsdp": (
        "check",
        "",
    ),
    'python -m stages.generate data/pretrain/model "ROMEO:" --temperature 0.8 --top-k 50': ("run", ""),
    "torchrun --nproc-per-node 2 -m stages.pretrain train.tensor_parallel=2": ("check", ""),
    "torchrun --nproc-per-node 4 -m stages.pretrain train.strategy=fsdp train.tensor_parallel=2": ("check", ""),
    "torchrun --nproc-per-node 4 -m stages.pretrain train.strategy=fsdp train.data_parallel_replicate=2": ("check", ""),
    "torchrun --nproc-per-node 8 -m stages.pretrain train.pipeline_parallel=2 train.tensor_parallel=2 "
    "train.strategy=fsdp": ("check", ""),
    "torchrun --nproc-per-node 2 -m stages.pretrain train.pipeline_parallel=2 train.pipeline_schedule=gpipe": (
        "check",
        "",
    ),
    "torchrun --nproc-per-node 2 -m stages.extend_context --base data/pretrain/model --input data/tokenize "
    "--output data/extend_context factor=4 train.steps=100": ("check", ""),
    "torchrun --nproc-per-node 2 -m stages.finetune_qlora --input data/prepare_data --output data/finetune_qlora/nf4": (
        "check",
        "",
    ),
    "torchrun --nproc-per-node 2 -m stages.finetune_qlora --input data/prepare_data --output "
    "data/finetune_qlora/none quantization=none": ("check", ""),
    "snakemake --cores all data/finetune_qlora/nf4 data/finetune_qlora/none": (
        "run",
        "current after the pipeline: runs nothing",
    ),
    "python -m stages.eval_perplexity --models pretrain=data/pretrain/model "
    "lora=data/pretrain/model+data/finetune_qlora/nf4/adapter --input data/tokenize --output "
    "data/eval_perplexity/compare contexts=[256,512,1024] extrapolate=true": ("run", ""),
    "torchrun --nproc-per-node 2 -m stages.eval_perplexity --models pretrain=data/pretrain/model --text notes.txt "
    "--output data/eval_perplexity/notes": ("check", "with a notes.txt"),
    "python -m stages.eval_perplexity --models pretrain=data/pretrain/model --text "
    "$PIPELINE_DATA_MIRROR/wikitext-2-raw/wiki.test.raw --output data/eval_perplexity/wikitext protocol=wikitext "
    "contexts=[256] max_tokens=0": ("check", "the mirror's WikiText-2 test split"),
    "python -m stages.eval_harness --models pretrain=data/pretrain/model --data data/prepare_data "
    "--output data/eval_harness/pretrain tasks=[wikitext]": ("check", ""),
    "lm_eval --model hf --model_args pretrained=data/pretrain/model,dtype=float32 --tasks wikitext --device cpu": (
        "marked",
        "network: the task's dataset is on the hub (tests/test_harness_parity.py runs the task on the mirror's copy)",
    ),
    "make test-system": ("marked", "root: CI runs it after make test"),
    'python -m pytest tests --ignore=tests/system -m "not e2e and not long"': ("marked", "the test suite itself"),
    "make bench": ("marked", "long: the benchmarks (minutes each)"),
    "bench/gpu_check.sh OUTDIR": ("marked", "GPU"),
    "python bench/data_scale.py --mb 4096": ("marked", "long: a 4 GB corpus (test_data_scale runs it small)"),
    "bench/gpu_check.sh --pack": ("marked", "network: downloads wheels"),
    "bench/gpu_check.sh out/": ("marked", "GPU"),
    "bench/gpu_check.sh --dry out/": ("marked", "run by tests/test_bench.py"),
    # docs/adding-a-stage.md
    "make dag": ("make", ""),
    "python -m pipelines.dag check": ("run", ""),
    "make lint": ("make", ""),
    "dvc dag --mermaid": ("run", ""),
    # docs/sweeps.md
    "python -m pipelines.preset sweep-lr": ("marked", "rewrites params.yaml (tests/test_sweeps.py declares a sweep)"),
    "python -m pipelines.preset sweep-context": ("marked", "rewrites params.yaml (tests/test_config.py loads it)"),
    "snakemake --cores all sweep_lr_compare": ("marked", "a sweep declared first (tests/test_sweeps.py runs one)"),
    "dvc repro sweep_lr_compare": ("marked", "a sweep declared first (tests/test_sweeps.py runs one)"),
    "dvc repro --keep-going sweep_lr_compare": ("marked", "a sweep declared first (tests/test_sweeps.py runs one)"),
    "python -m pipelines.sweep lr": ("marked", "a sweep declared first (tests/test_sweeps.py runs it)"),
    "snakemake --profile pipelines/profiles/slurm sweep_lr_compare": ("marked", SLURM + ", a sweep declared"),
    # docs/troubleshooting.md
    "apt-get install python3.11-venv": ("marked", "a system package: root and network"),
    "rm -rf .venv": ("marked", "removes the environment the tests run in"),
    "make venv": ("make", ""),
    "PIPELINE_DATA_MIRROR=/path/to/mirror make run": ("marked", LONG_DAG),
    "tail -n 20 logs/pretrain.log": ("run", ""),
    "ls .snakemake/log/": ("run", "Snakemake's logs of the shared run"),
    "PIPELINE_RESUME=fresh make run": ("marked", LONG_DAG),
    "python -m stages.pretrain --check train.micro_batch_size=4 train.activation_checkpointing=full": ("check", ""),
    "snakemake -n": ("run", "a dry run: after the pipeline, nothing to do"),
    "python -m pipelines.sync": ("run", "aligns file times with dvc status; nothing to change after the pipeline"),
    'echo "$MLFLOW_TRACKING_URI"': ("run", ""),
    "python -m stages.common.tracking.journal resend": ("run", "nothing unsent after the pipeline"),
}


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_commands(page: Path) -> list[str]:
    """Every command line of the page's bash blocks: comments dropped, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            command = strip_comment(line).strip()
            if command:
                out.append(command)
    return out


def commands() -> list[str]:
    """Every command of every page, once, in the order the pages first show them."""
    return list(dict.fromkeys(c for page in PAGES for c in page_commands(page)))


def strip_comment(line: str) -> str:
    """The line without its trailing `# ...` comment (a # outside quotes, after a space or at the start)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line
