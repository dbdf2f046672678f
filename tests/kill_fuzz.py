"""Kill the ci pipeline anywhere: SIGKILL every process of a run at seeded random moments, re-run, and
require the end to be the uninterrupted run's.

A fresh clone of the working tree (tests/shared_run.py: make_clone) runs the ci pipeline, alternately
through `snakemake --profile pipelines/profiles/local` and `dvc repro`. Each attempt is killed after a
delay drawn from the seed (every process working in the clone, as a lost machine would: no handler
runs), and the point it hit is recorded from what was running and what was half-written then (a stage
and its phase, a checkpoint or an output being written, a `dvc commit`, the tools between jobs). After
the last kill the pipeline runs to completion. Then:
  - every file of data/ and reports/ is byte for byte the shared uninterrupted run's (measured/, the
    timings, aside), and no hidden temporary of a killed write is left in data/ or checkpoints/,
  - `dvc status` is clean, `snakemake -n` has nothing to do, `dvc repro` runs nothing,
  - no MLflow run is left RUNNING.

    python tests/kill_fuzz.py --kills 50 --seed 1 [--dest DIR]   # prints each kill point, then the checks

tests/test_kill_fuzz.py runs a few kills in `make test-system`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_run import env_for, make_clone, output_hashes, sh, shared_run  # noqa: E402

TOOLS = {
    "snakemake": "snakemake --profile pipelines/profiles/local --cores 2",
    "dvc": "dvc repro",
}
UP_TO_DATE = "Data and pipelines are up to date."


def working_in(folder: Path) -> dict[int, list[str]]:
    """pid -> argv of every process whose working directory is in folder."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                found[int(proc.name)] = [a.decode(errors="replace") for a in argv if a]
        except (OSError, ValueError):
            pass
    return found


def program(argv: list[str]) -> str:
    """A process's program: the module of `python -m <module>`, the script of `python <script>`, else argv[0]."""
    if not Path(argv[0]).name.startswith("python"):
        return Path(argv[0]).name
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[1:]  # (interpreter options: torchrun starts its workers with `python -u -m ...`)
    if len(rest) > 1 and rest[0] == "-m":
        return rest[1]
    return Path(rest[0]).name if rest and rest[0] != "-c" else Path(argv[0]).name


def temporaries(clone: Path) -> dict[str, list[Path]]:
    """The hidden folders and files of writes not yet renamed into place, by kind."""
    return {
        "a checkpoint being written": list(clone.glob("checkpoints/*/*/.step-*.tmp-*")),
        "a tokenize chunk being written": list(clone.glob("checkpoints/tokenize/*/.*.tmp")),
        "an output being published": list(clone.glob("data/**/.*.tmp-*")),
        "a stage's work folder": list(clone.glob("data/**/.*.work-*")),
        "the tracking store being made": list(clone.glob(".mlflow.db.work-*")),
    }


def kill_point(clone: Path, procs: dict[int, list[str]], since: float) -> str:
    """What the run was doing: read from its processes and from what it was writing at the kill (hidden
    temporaries made since `since`, the attempt's start; older ones are left over from earlier kills)."""
    # (by each process's own program: a rule's shell holds the whole `launch ... && commit ...` line)
    programs = [(program(argv), argv) for argv in procs.values() if argv]
    stages = sorted({name.removeprefix("stages.") for name, _ in programs if name.startswith("stages.")})
    commits = sorted({argv[3] for name, argv in programs if name == "pipelines.commit" and len(argv) > 3})
    half = [kind for kind, paths in temporaries(clone).items() if any(newer(p, since) for p in paths)]
    detail = f" ({'; '.join(half)})" if half else ""
    if commits:
        return f"dvc commit of {', '.join(commits)}{detail}"
    if stages:
        return f"stage {', '.join(stages)}{detail}"
    launching = sorted({argv[3] for name, argv in programs if name == "pipelines.launch" and len(argv) > 3})
    if launching:  # (its torchrun or stage processes starting, or gone and the launcher ending)
        return f"the launcher of {', '.join(launching)}, its stage not running{detail}"
    if programs:
        return "between stages: " + ", ".join(sorted({name for name, _ in programs})) + detail
    return "nothing running (the run had ended)"


def newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def kill_all(clone: Path) -> dict[int, list[str]]:
    """SIGKILL every process working in clone, until none is left (a lost machine)."""
    seen: dict[int, list[str]] = {}
    for _ in range(50):
        procs = working_in(clone)
        if not procs:
            return seen
        seen.update(procs)
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes survive SIGKILL in {clone}: {working_in(clone)}")


def fuzz(dest: Path, kills: int, seed: int, max_delay_s: float = 60.0, log=print) -> list[str]:
    """Run the ci pipeline in a fresh clone at dest, killed `kills` times, then to completion; check the
    end against the shared uninterrupted run. Returns the kill points, in order."""
    reference = shared_run()
    clone = make_clone(dest)
    rng = random.Random(seed)
    points = []
    attempt = 0
    while len(points) < kills:
        tool = list(TOOLS)[attempt % len(TOOLS)]
        attempt += 1
        delay = rng.uniform(0.5, max_delay_s)
        output = dest.parent / f"attempt-{attempt}-{tool}.log"
        started = time.time() - 1  # (file times have a coarse clock on some filesystems)
        with open(output, "w") as fh:
            proc = subprocess.Popen(
                TOOLS[tool],
                shell=True,
                cwd=clone,
                env=env_for(clone),
                start_new_session=True,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        try:
            proc.wait(delay)
        except subprocess.TimeoutExpired:
            pass
        else:  # it ended before the kill: it must have finished what it ran, after the kills before
            failed = f"{TOOLS[tool]} failed after {len(points)} kill(s): {output.read_text()[-4000:]}"
            assert proc.returncode == 0, failed
            log(f"attempt {attempt} ({tool}): finished before {delay:.1f} s")
            if "Nothing to be done" in sh("snakemake --cores 2 -n", clone):
                break  # the whole pipeline is done: no later moment to kill
            continue
        procs = working_in(clone)
        point = kill_point(clone, procs, started)
        kill_all(clone)
        proc.wait(30)
        points.append(point)
        log(f"kill {len(points)} ({tool}, after {delay:.1f} s): {point}")
    out = sh(TOOLS["snakemake"], clone, timeout=2400)
    log("final run (snakemake) to completion: " + (out.strip().splitlines() or [""])[-1])
    check(clone, reference, log)
    return points


def check(clone: Path, reference: Path, log=print) -> None:
    """The end of a killed and resumed run is the uninterrupted run's, and both tools and MLflow agree.
    No hidden temporary of a killed write is left: the re-run of the output (or checkpoint) it was for
    removed it (stages/common/atomic.py: sweep), and finished stages removed their checkpoints."""
    left = {kind: sorted(str(p.relative_to(clone)) for p in found) for kind, found in temporaries(clone).items()}
    assert not any(left.values()), f"temporaries of killed writes left behind: {left}"
    ours = output_hashes(clone)
    theirs = output_hashes(reference)
    differ = sorted(p for p in ours.keys() | theirs.keys() if ours.get(p) != theirs.get(p))
    assert not differ, f"{len(differ)} output files differ from the uninterrupted run: {differ[:20]}"
    # The uninterrupted run, published as a crate, is what this fresh clone's run checks against: the same
    # machine, every out identical, the same params, code and environment (pipelines.crate, pipelines.verify).
    crate = clone.parent / f"{clone.name}-reference.crate.zip"
    sh(f"python -m pipelines.crate --root {reference} --out {crate}", clone)
    verified = sh(f"python -m pipelines.verify --against {crate}", clone)
    outs = [line for line in verified.splitlines() if line.startswith(("identical", "within", "differs", "absent"))]
    assert outs and all(line.startswith("identical") for line in outs), verified[-3000:]
    assert "params, code and environment: as in the crate" in verified, verified[-3000:]
    assert UP_TO_DATE in sh("dvc status", clone), sh("dvc status", clone)
    assert "Nothing to be done" in sh("snakemake --cores 2 -n", clone)
    assert not re.findall(r"Running stage '([\w@]+)'", sh("dvc repro", clone)), "dvc repro re-ran a stage"
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipeline")
    running = client.search_runs([experiment.experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
    assert not running, [(r.info.run_name, r.data.tags.get("pid")) for r in running]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-delay", type=float, default=60.0, help="longest wait before a kill (s)")
    parser.add_argument("--dest", type=Path, default=None, help="the clone (default: a new temporary folder)")
    args = parser.parse_args()
    import tempfile

    dest = args.dest or Path(tempfile.mkdtemp(prefix="kill-fuzz-")) / "clone"
    dest.mkdir(parents=True)
    started = time.monotonic()
    points = fuzz(dest, args.kills, args.seed, args.max_delay)
    print(f"{len(points)} kills, every check held ({time.monotonic() - started:.0f} s); kill points:")
    for point, n in sorted({p: points.count(p) for p in points}.items(), key=lambda x: -x[1]):
        print(f"  {n:3d}  {point}")


if __name__ == "__main__":
    main()
