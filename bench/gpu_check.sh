#!/usr/bin/env bash
# The GPU check: the GPU-marked tests and the GPU benchmarks in one command, figures and logs in OUTDIR.
#
#   bench/gpu_check.sh --pack          here, with network access: the wheels a bare GPU machine lacks
#                                      (bitsandbytes, ruamel.yaml, grimp, at requirements.lock's versions, for
#                                      Python 3.12), the raw data the tests read, and the ci preset's
#                                      tokenize output and instruction records made with this machine's
#                                      pinned packages, into .gpu/
#   bench/gpu_check.sh OUTDIR          on the GPU machine, from the repository root, with .gpu/ in it
#   bench/gpu_check.sh --dry OUTDIR    the same code at tiny sizes on this machine's CPU (a minute or two)
#
# Steps, each under a time limit of its own (a hang loses that step only; 540 s in all), each one's log
# in OUTDIR; figures.json is rewritten after every step, so a run cut short keeps what it measured:
#   tests.log     pytest tests/test_gpu.py: bf16 compute, a nccl group of one with FSDP2's bf16 policy,
#                 YaRN fine-tuning, QLoRA with bf16 storage, paged 8-bit AdamW (2-GPU tests skip on one)
#   pretrain.log  bench/pretrain_mfu.py: ~950M-parameter Llama, context 2048, bf16, compile: tokens/s, MFU
#   profile.txt   one profiled training step: the kernels that took the time, and time by kind
#   eval.log      bench/eval_throughput.py: batched vs batch 1, in bf16 and in fp32 (exact perplexities)
#   qlora.log     bench/qlora_memory.py: NF4 + LoRA vs bf16 LoRA on a ~1B Llama, peak CUDA memory
#   ci_record.log bench/ci_record_check.py: the ci preset's pretrain and its evaluation, deterministic, in
#                 fp32 (TF32 off) and bf16, each perplexity against the CPU-recorded one (pipelines/recorded.yaml)
#   plan.log      bench/plan_gpu_check.py: pretrain and finetune_qlora (nf4, none) on a 95M-parameter Llama, the
#                 planner's peak (less its runtime reserve) against the CUDA peak, its tokens/s at MFU 0.4 beside
#   env.txt       the machine, driver and versions
#   figures.json  every figure, each step's exit code and seconds, and the goals met or missed
# The benchmarks' stages run with PIPELINE_TRACKING=off, without MLflow (tests/conftest.py's `tokenized`
# fixture turns tracking on, so the tests that use it need mlflow installed). The exit code is 0 when every
# step ran to the end (goals missed are reported, not failures).
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=.gpu

if [ "${1:-}" = "--pack" ]; then
  dest=$PACK
  mirror=${PIPELINE_DATA_MIRROR:-../shared/data}
  rm -rf "$dest"
  mkdir -p "$dest/wheels" "$dest/data/planetoid"
  for name in bitsandbytes ruamel.yaml grimp; do
    version=$(grep -i "^$name==" requirements.lock | cut -d= -f3)
    [ -n "$version" ] || { echo "gpu_check: $name is not pinned in requirements.lock" >&2; exit 2; }
    "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dest/wheels" "$name==$version" || exit 2
  done
  for part in tinyshakespeare alpaca-5k planetoid/Cora; do
    [ -d "$mirror/$part" ] || { echo "gpu_check: no $mirror/$part: set PIPELINE_DATA_MIRROR" >&2; exit 2; }
    cp -r "$mirror/$part" "$dest/data/$part"
  done
  PIPELINE_DATA_MIRROR=$mirror "${PYTHON:-python3}" bench/ci_record_check.py --pack "$dest/ci" || exit 2
  chmod -R u+w "$dest"
  du -sh "$dest"
  exit 0
fi

DRY=0
if [ "${1:-}" = "--dry" ]; then
  DRY=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: bench/gpu_check.sh [--dry] OUTDIR | bench/gpu_check.sh --pack [DIR]" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
PARTS=$(mktemp -d)
trap 'rm -rf "$PARTS"' EXIT

if [ $DRY -eq 0 ]; then
  if ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: no CUDA GPU here; run bench/gpu_check.sh --dry OUTDIR for the check at tiny size on the CPU" >&2
    exit 2
  fi
  if [ -d "$PACK/wheels" ]; then  # the packed wheels, installed beside the machine's own packages
    $PY -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/gpu-check-site "$PACK"/wheels/*.whl \
      || exit 2
    export PYTHONPATH=/tmp/gpu-check-site
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${PIPELINE_DATA_MIRROR:-}" ]; then
  if [ -d "$PACK/data" ]; then
    export PIPELINE_DATA_MIRROR="$PWD/$PACK/data"
  elif [ -d ../shared/data ]; then
    export PIPELINE_DATA_MIRROR="$(cd ../shared/data && pwd)"
  fi
fi
export PIPELINE_TRACKING=off

{
  date -u
  git rev-parse HEAD 2>/dev/null
  nvidia-smi 2>/dev/null || echo "nvidia-smi: none"
  $PY - <<'EOF'
import platform, torch
from stages.common import runtime
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for mod in ("transformers", "peft", "bitsandbytes", "torch_geometric", "mlflow"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, "not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs", "bf16", torch.cuda.is_bf16_supported())
print("cpu", runtime.cpu_info())
EOF
  echo "PIPELINE_DATA_MIRROR=${PIPELINE_DATA_MIRROR:-} PIPELINE_TRACKING=${PIPELINE_TRACKING:-on} dry=$DRY"
} >"$OUT/env.txt" 2>&1

cat >"$PARTS/summarize.py" <<'EOF'
import json, re, sys
from pathlib import Path

parts, out, tests_log, dry = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
final = sys.argv[5:] == ["final"]
figures = {}
for p in sorted(parts.glob("*.json")):
    try:
        figures[p.stem] = json.loads(p.read_text())
    except json.JSONDecodeError:  # cut off while writing
        pass
steps = {}
for line in (parts / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    steps[name] = {"exit": int(rc), "seconds": int(seconds)}
summary = re.findall(r"^=+ (.*) =+$|^(\d+ (?:passed|failed|skipped).*)$", tests_log.read_text(), re.M)
figures["tests"] = {"summary": next((a or b for a, b in reversed(summary)), "no summary")}
goals = {}
if "pretrain" in figures:
    goals["pretrain MFU >= 0.40 of peak"] = [round(figures["pretrain"]["mfu_vs_peak"], 3), figures["pretrain"]["mfu_vs_peak"] >= 0.40]
if "eval" in figures:
    ratio = figures["eval"]["ratio"]
    goals[f"eval batched / batch 1 >= 10 ({figures['eval']['dtype']})"] = [round(ratio, 1), ratio >= 10]
if "eval_fp32" in figures:
    rel = figures["eval_fp32"]["relative_difference"]
    goals["eval perplexities equal to 1e-6 (fp32)"] = [rel, rel <= 1e-6]
for precision in ("fp32", "bf16"):
    found = figures.get("ci_record", {}).get(precision)
    if found:
        rel = found["max_relative_difference"]
        goals[f"ci pretrain {precision}: perplexities within the CPU record's tolerance (largest relative difference)"] = [rel, found["pass"]]
reported = {}  # figures without a goal
plan = figures.get("plan", {})
for row in plan.get("rows", []):
    if dry:  # (a CPU's peak RSS against a GPU plan: the code path, not a comparison)
        reported[f"planner's peak / measured peak RSS, dry ({row['config']})"] = round(row["ratio"], 3)
    else:
        goals[f"planner's peak within 15% of the measured CUDA peak ({row['config']})"] = [round(row["ratio"], 3), abs(row["ratio"] - 1) <= 0.15]
    label = f"planner's tokens/s at MFU {plan['mfu']:g} / measured ({row['config']}; equal at MFU {row['mfu_at_measured']:.3g})"
    reported[label] = round(row["time_ratio"], 3)
if "qlora" in figures and "peak_cuda_mb" in figures["qlora"]["nf4"]:
    ratio = figures["qlora"]["nf4"]["peak_cuda_mb"] / figures["qlora"]["none"]["peak_cuda_mb"]
    goals["QLoRA peak CUDA memory <= 0.45x bf16 LoRA"] = [round(ratio, 3), ratio <= 0.45]
text = figures["tests"]["summary"]
ran = steps.get("tests", {}).get("exit") == 0 and "failed" not in text and "error" not in text
# On a GPU some must have run; dry, on a CPU, they all skip (naming the reason in tests.log).
figures["tests"]["passed"] = ran and (dry or "passed" in text)
label = "every GPU-marked test passes" + (" (dry: they skip without a GPU)" if dry else "")
goals[label] = [text, figures["tests"]["passed"]]
figures["steps"], figures["goals"], figures["reported"] = steps, goals, reported
out.write_text(json.dumps(figures, indent=1))
if not final:
    sys.exit(0)
for name, step in steps.items():
    print(f"{name:<10} exit {step['exit']:>3}  {step['seconds']:>4} s")
for goal, (value, met) in goals.items():
    print(f"{'met   ' if met else 'MISSED'} {goal}: {value}")
for label, value in reported.items():
    print(f"info   {label}: {value}")
sys.exit(1 if any(s["exit"] != 0 for s in steps.values()) else 0)
EOF
summarize() { $PY "$PARTS/summarize.py" "$PARTS" "$OUT/figures.json" "$OUT/tests.log" $DRY "$@"; }

: >"$PARTS/steps.tsv"
step() {  # step NAME LOG SECONDS COMMAND...: run it under its limit, appending to LOG; record exit code and time
  local name=$1 log=$2 limit=$3 t0 rc
  shift 3
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$PARTS/steps.tsv"
  echo "   exit $rc after $(($(date +%s) - t0)) s" | tee -a "$OUT/$log"
  summarize
}

: >"$OUT/tests.log" >"$OUT/pretrain.log" >"$OUT/eval.log" >"$OUT/qlora.log" >"$OUT/ci_record.log" >"$OUT/plan.log"
step tests tests.log 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py
if [ $DRY -eq 1 ]; then
  step pretrain pretrain.log 300 $PY bench/pretrain_mfu.py --dry --profile "$OUT/profile.txt" --json "$PARTS/pretrain.json"
  tiny=(--tokens 2048 --repeats 1 --hidden 64 --layers 2 --heads 4 --ffn 160 --no-bf16)
  step eval eval.log 150 $PY bench/eval_throughput.py "${tiny[@]}" --json "$PARTS/eval.json"
  step eval_fp32 eval.log 150 $PY bench/eval_throughput.py "${tiny[@]}" --precision fp32 --json "$PARTS/eval_fp32.json"
  step qlora qlora.log 240 $PY bench/qlora_memory.py --hidden 64 --layers 2 --json "$PARTS/qlora.json"
  step ci_record ci_record.log 180 $PY bench/ci_record_check.py --json "$PARTS/ci_record.json"
  step plan plan.log 240 $PY bench/plan_gpu_check.py --dry --json "$PARTS/plan.json"
else
  step pretrain pretrain.log 130 $PY bench/pretrain_mfu.py --profile "$OUT/profile.txt" --json "$PARTS/pretrain.json"
  step eval eval.log 35 $PY bench/eval_throughput.py --tokens 65536 --json "$PARTS/eval.json"
  step eval_fp32 eval.log 35 $PY bench/eval_throughput.py --tokens 65536 --precision fp32 --json "$PARTS/eval_fp32.json"
  step qlora qlora.log 105 $PY bench/qlora_memory.py --hidden 2048 --layers 16 --batch 4 --seq 512 --steps 3 \
    --json "$PARTS/qlora.json"
  step ci_record ci_record.log 55 $PY bench/ci_record_check.py --json "$PARTS/ci_record.json"
  step plan plan.log 60 $PY bench/plan_gpu_check.py --json "$PARTS/plan.json"
fi
summarize final
