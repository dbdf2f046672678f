"""The ci preset's pretrain and its evaluation on this machine's device, against the perplexities recorded
from a CPU run (pipelines/recorded.yaml), in fp32 and in bf16.

    python bench/ci_record_check.py [--precisions fp32 bf16] [--tokenized .gpu/ci] [--work DIR] [--json FILE]
    python bench/ci_record_check.py --pack .gpu/ci     the ci params, tokenize output and instruction records

The params are params.yaml with the ci preset applied (as the tests and the record make them); the record
is the one of their fingerprint (stages.report.params_fingerprint), and each perplexity is compared by
stages.report.regression, the code behind the report's regression rows, within report.regression_tolerance
(relative). The tokenize output comes from `--tokenized` when it was made under the same prepare_data and
tokenize params (`--pack` makes it where the pinned packages are, so only pretrain and eval differ from the
recorded run), else prepare_data and tokenize run here first (one process each, PIPELINE_DATA_MIRROR).

Then one process under `torchrun --standalone --nproc-per-node 1` runs, per precision, `stages.pretrain`
(train.precision=P) and `stages.eval_perplexity` on its model (precision=P), in process, with
torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and TF32 off (float32 matmul
precision "highest", cuDNN TF32 off; in fp32 on a GPU attention runs on SDPA's math backend, since the fused
fp32 attention kernels need not honour the TF32 switch). PIPELINE_TRACKING=off. Should an op have no
deterministic implementation there, the run is repeated with warn_only=True and the figures say so.

Figures (--json, rewritten after each precision): per precision, one row per recorded context (recorded,
ours, tolerance, pass, relative difference), the largest relative difference, and whether all pass; for
bf16 also its drift from the fp32 run of the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages import report  # noqa: E402
from stages.common import config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LABEL = "eval_perplexity/pretrain"  # the record's label of the pretrain model's perplexities
INPUT_SECTIONS = ("prepare_data", "tokenize")  # what the tokenize output follows from
DETERMINISM_ERROR = "does not have a deterministic implementation"


def stage_env(**extra) -> dict:
    env = {**os.environ, "PIPELINE_TRACKING": "off", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if env.get("PIPELINE_DATA_MIRROR"):
        env["PIPELINE_DATA_MIRROR"] = str(Path(env["PIPELINE_DATA_MIRROR"]).resolve())
    for key in ("DVC_ROOT", "PIPELINE_RUN_ID", "PIPELINE_WORLD_SIZE"):
        env.pop(key, None)
    return env


def ci_params(dest: Path) -> Path:
    """params.yaml with the ci preset applied, at dest/params.yaml."""
    from pipelines import preset

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "params.yaml", dest / "params.yaml")
    preset.apply("ci", dest / "params.yaml")
    return dest / "params.yaml"


def run_stage(module: str, args: list[str], cwd: Path) -> None:
    print(f"$ python -m stages.{module} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", f"stages.{module}", *args], cwd=cwd, env=stage_env(), check=True)


def make_tokenized(dest: Path, params: Path) -> Path:
    """prepare_data and tokenize (one process each) on `params`, into dest/tokenize; dest/params.yaml, and
    prepare_data's instruction records, dest/instructions.jsonl (bench/plan_gpu_check.py fine-tunes on them)."""
    dest.mkdir(parents=True, exist_ok=True)
    if params != dest / "params.yaml":
        shutil.copy(params, dest / "params.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        run_stage("prepare_data", ["--params", str(params), "--output", "prepare_data"], Path(tmp))
        shutil.copy(Path(tmp) / "prepare_data/instructions.jsonl", dest / "instructions.jsonl")
        shutil.rmtree(dest / "tokenize", ignore_errors=True)
        tokenize = ["--params", str(params), "--input", "prepare_data", "--output", str(dest / "tokenize")]
        run_stage("tokenize", [*tokenize, "--measured", "tokenize.measured.json"], Path(tmp))
    return dest / "tokenize"


def tokenized_for(params: Path, packed: Path | None, work: Path) -> Path:
    """The packed tokenize output when it was made under these prepare_data and tokenize params, else a new one."""
    ours = config.read_yaml(params)
    if packed is not None and (packed / "tokenize/meta.json").is_file() and (packed / "params.yaml").is_file():
        theirs = config.read_yaml(packed / "params.yaml")
        if all(ours.get(s) == theirs.get(s) for s in INPUT_SECTIONS):
            print(f"tokenize output: {packed / 'tokenize'} (packed, same {' and '.join(INPUT_SECTIONS)} params)")
            return packed / "tokenize"
        print(f"tokenize output: {packed} was made under other {' or '.join(INPUT_SECTIONS)} params; making it anew")
    return make_tokenized(work / "inputs", params)


def compare(figures: dict, params: Path) -> dict:
    """This run's perplexities against the record of these params, by the report's regression code."""
    cfg = config.load(report.Config, "report", params)
    cfg = dataclasses.replace(cfg, recorded=str(ROOT / cfg.recorded))
    found = report.regression({LABEL: figures}, config.read_yaml(params), cfg)
    if found["recorded"] is None:
        nearest = found["nearest"] or {}
        raise SystemExit(
            f"ci_record_check: no record of the ci params ({found['params']}) in {cfg.recorded}; the nearest "
            f"({nearest.get('params')}) differs in: {'; '.join(nearest.get('differences', [])[:5])}"
        )
    rows = []
    for row in found["rows"]:
        if row["stage"] != LABEL:
            continue  # (the record's extend_context rows are not this check's)
        ours, recorded = row["ours"], row["published"]
        rows.append(
            {
                "result": row["result"],
                "recorded": recorded,
                "ours": ours,
                "tolerance": row["tolerance"],
                "pass": row["pass"],
                "relative_difference": None if ours is None else abs(ours - recorded) / recorded,
            }
        )
    differences = [r["relative_difference"] for r in rows if r["relative_difference"] is not None]
    return {
        "record": f"{found['params']} ({found['recorded']})",
        "relative_tolerance": cfg.regression_tolerance,
        "rows": rows,
        "max_relative_difference": max(differences) if differences else None,
        "pass": bool(rows) and all(r["pass"] for r in rows),
    }


def numerics(precision: str, warn_only: bool):
    """Deterministic algorithms and TF32 off for the whole process; the attention backend for `precision`."""
    import contextlib

    import torch

    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    if precision == "fp32" and torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH]), "math"
    return contextlib.nullcontext(), "default"


def worker(precisions: list[str], params: Path, tokenized: Path, work: Path, out: Path, warn_only: bool) -> None:
    """One process (under torchrun): pretrain and evaluate per precision, compare, write `out`."""
    import torch

    from stages import eval_perplexity, pretrain

    figures = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "params": report.params_fingerprint(config.read_yaml(params)),
        "deterministic": "warn_only" if warn_only else "strict",
    }
    for precision in precisions:
        attention, backend = numerics(precision, warn_only)
        folder = work / precision
        # (a fresh start: no output or checkpoint of an earlier attempt is resumed)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        common = ["--params", str(params), "--input", str(tokenized)]
        with attention:
            meta = pretrain.main([*common, "--output", str(folder / "pretrain"), f"train.precision={precision}"])
            models = ["--models", f"pretrain={folder / 'pretrain/model'}"]
            eval_perplexity.main([*common, *models, "--output", str(folder / "eval"), f"precision={precision}"])
        result = compare(json.loads((folder / "eval/figures.json").read_text()), params)
        result |= {
            "compute_dtype": meta["compute_dtype"],
            "final_train_loss": meta["final_train_loss"],
            "attention": backend,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        figures[precision] = result
        if precision != "fp32" and "fp32" in figures:
            pairs = zip(figures["fp32"]["rows"], result["rows"], strict=True)
            drifts = [abs(b["ours"] - a["ours"]) / a["ours"] for a, b in pairs if None not in (a["ours"], b["ours"])]
            result["max_relative_difference_from_fp32"] = max(drifts, default=None)
        out.write_text(json.dumps(figures, indent=1))
        drift = result.get("max_relative_difference_from_fp32")
        print(
            f"ci_record_check: {precision}: largest relative difference from the CPU record "
            f"{result['max_relative_difference']} (tolerance {result['relative_tolerance']:g}): "
            f"{'pass' if result['pass'] else 'FAIL'}" + ("" if drift is None else f"; from this device's fp32 {drift}"),
            flush=True,
        )


def launch(args, params: Path, tokenized: Path, work: Path, out: Path, warn_only: bool) -> tuple[int, str]:
    """The worker under torchrun (one process); (exit code, its output), the output also passed through."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__]
    cmd += ["--worker", "--precisions", *args.precisions, "--params", str(params), "--tokenized", str(tokenized)]
    cmd += ["--work", str(work), "--json", str(out)] + (["--warn-only"] if warn_only else [])
    print("$ " + " ".join(cmd), flush=True)
    env = stage_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--tokenized", type=Path, default=ROOT / ".gpu/ci", help="a folder --pack made")
    parser.add_argument("--work", type=Path, help="where the stages write (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--pack", type=Path, metavar="DIR", help="make the ci params and tokenize output in DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--warn-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.precisions, args.params, args.tokenized, args.work, args.json, args.warn_only)
        return
    if args.pack:
        with tempfile.TemporaryDirectory() as tmp:
            make_tokenized(args.pack.resolve(), ci_params(Path(tmp)))
        print(f"ci_record_check: packed {args.pack.resolve()}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)).resolve()
        params = ci_params(work)
        tokenized = tokenized_for(params, args.tokenized.resolve(), work)
        out = (args.json or work / "figures.json").resolve()
        code, output = launch(args, params, tokenized, work, out, warn_only=False)
        if code != 0 and DETERMINISM_ERROR in output:
            print(f"ci_record_check: an op {DETERMINISM_ERROR} here; again with warn_only=True", flush=True)
            code, _ = launch(args, params, tokenized, work, out, warn_only=True)
        if code != 0:
            raise SystemExit(code)


if __name__ == "__main__":
    main()
