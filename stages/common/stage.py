"""What every stage does around its own work: command line and params, the process group, the stop
signals, the MLflow run with the inputs' content hash, the checkpoint folder, and atomic publishing.

A stage's `main` reads:

    args, cfg = stage.setup(__doc__, STAGE, Config, {"input": "data/tokenize", "output": "data/pretrain"}, argv)
    ... check the inputs (before any compute) ...
    return stage.launch(STAGE, lambda rt, stop: run(cfg, ..., rt, stop), train=cfg.train)

and a training stage's `run` holds what it decides in one object (stages.common.stagerun.StageRun):

    run = StageRun(STAGE, cfg, rt, stop, stage.inputs_hash([inputs], rt))
    with run.checkpoints(), run.tracked():
        result = loop.fit(model, train_data, val_data, cfg.train, context, run)
        meta = run.publish(output, lambda tmp: save_outputs(tmp, ...))
        run.finish(output, measured=..., artifacts=..., models=..., inputs=...)

(the lock first: a second run of the same params and inputs stops before it opens an MLflow run).

The stop protocol of a training stage (one that passes its `train` section to `launch`): SIGTERM or
SIGINT (preemption, a SLURM time limit, Ctrl-C) lets the step finish, the loop saves a checkpoint,
`loop.fit` raises `Stopped`, and `launch` leaves the process group and exits with 143 (128 +
SIGTERM), the code schedulers read as "preempted, re-run to resume". Other stages stop at once.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stages.common import atomic, ckpt, config, contract, digest, environment, provenance, registry, runtime, timing
from stages.common.tracking import runs
from stages.common.tracking.sender import flush_s

REFUSAL_GRACE_S = 10.0  # how long a rank other than 0 that refused its input waits for rank 0 to say why
if TYPE_CHECKING:  # (the training stack is the training stages' own import)
    from stages.common.train_config import TrainConfig

Stopped = runtime.Stopped


def parse_cli(doc: str, paths: dict, argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The command line every stage shares: path options (name -> default; a list default takes one
    or more paths), `--params FILE`, and trailing `key=value` overrides of the stage's params section.
    Returns (args, overrides)."""
    parser = argparse.ArgumentParser(
        description=doc.strip().splitlines()[0],
        epilog="Trailing key=value pairs override the stage's params section (dotted keys for sub-sections).",
    )
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the command line and the params section with its overrides, print the section, and exit",
    )
    for name, default in paths.items():
        many = isinstance(default, list)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=default,
            nargs="+" if many else None,
            help=f"default: {default}",
        )
    parser.add_argument(
        "--measured",
        default=None,
        help="where to write what the run measured (timings, memory): a file outside the output, which DVC "
        "does not cache (default: <output>.measured.json)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # Intermixed: overrides may come before, between or after the options.
    args = parser.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    for name, default in paths.items():
        if isinstance(default, list):
            # `--inputs a b key=value`: argparse hands the override to --inputs; give it back.
            values = getattr(args, name)
            setattr(args, name, [v for v in values if "=" not in v])
            overrides += [v for v in values if "=" in v]
    if args.measured is None and getattr(args, "output", None):
        args.measured = f"{args.output}.measured.json"
    return args, overrides


def setup(doc: str, section: str, cls: type, paths: dict, argv=None):
    """Parse the command line and load the stage's params section (with overrides) into `cls`.
    Returns (args, config)."""
    args, overrides = parse_cli(doc, paths, argv)
    cfg = config.load(cls, section, args.params, overrides)
    exit_if_checking(args, section, cfg)
    return args, cfg


def exit_if_checking(args: argparse.Namespace, section: str, cfg) -> None:
    """`--check`: the command line and the params section are good (else a UserError came first); print
    the section as the stage would use it and exit 0, before any compute."""
    if args.check:
        import yaml

        if os.environ.get("RANK", "0") == "0":
            print(yaml.safe_dump({section: config.as_dict(cfg)}, sort_keys=False), end="")
        raise SystemExit(0)


def launch(section: str, body, train: TrainConfig | None = None):
    """Check the installed packages against those the stage's family records (stages.common.environment),
    join the process group, run `body(rt, stop)` and leave the group (also on errors: a wrapped model
    must be gone before, which is why it lives only inside `body`). With a `train` section the stage
    checkpoints, so SIGTERM and SIGINT set `stop` instead of ending the process (the loop saves and
    `loop.fit` raises Stopped: exit 143 after teardown); other stages keep Python's handlers and
    stop at once."""
    environment.check(section)  # (the packages: before the process group, on every node)
    timeout_s = train.collective_timeout_s if train is not None else runtime.COLLECTIVE_TIMEOUT_S
    rt = runtime.init(timeout_s=timeout_s, cpu_collectives=train is not None and train.offload)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = runtime.handle_signals() if train is not None else runtime.StopFlag()
    stopped = False
    try:
        runtime.preflight(rt)
        if train is not None:
            train.check_layout(f"{section}.train", rt)
            runtime.print0(
                f"preflight: collectives time out after {timeout_s:g} s ({section}.train.collective_timeout_s); "
                f"a rank without progress for {train.hang_timeout_s:g} s or 10 median steps ends the run "
                f"({section}.train.hang_timeout_s)",
                rt=rt,
            )
        timing.body_started()
        return body(rt, stop)
    except Stopped:
        stopped = True
    finally:
        timing.body_ended()
        runtime.teardown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stopped:
        contract.mark_stopped()  # tells this node's pipelines.launch
        raise SystemExit(contract.STOPPED_EXIT)  # preempted: a checkpoint holds the progress; re-running resumes


@timing.phase("tracking")
def inputs_hash(paths, rt: runtime.Runtime) -> str:
    """The content hash of a stage's inputs, computed by rank 0 and shared with every rank."""
    return runtime.broadcast_object(digest.hash_files(paths) if rt.is_main else None)


def record_tags(section: str, across_code: str | None = None) -> dict:
    """What a stage's run and registered models carry besides its params and inputs: the hash of its code
    (stages.common.provenance), the versions of the packages it imports, the environment it runs in
    (stages.common.environment.run_tags) and, after a resume across a code or torch change
    (PIPELINE_RESUME=across-code, or checkpoints of such a run), what it resumed from."""
    module = f"stages.{section}"
    tags = {"code_sha256": ckpt.writer_record(module)["code_sha256"]}
    try:
        tags |= {f"package.{name}": version for name, version in provenance.packages(module).items()}
    except KeyError:  # not a stage module (a bench's own run)
        pass
    if across_code:
        tags[ckpt.ACROSS_CODE] = across_code
    tags |= environment.run_tags(section)  # (and a run on packages other than its family's recorded ones)
    return tags


@contextlib.contextmanager
def tracked(section: str, cfg, inputs, rt: runtime.Runtime, tags: dict | None = None):
    """The stage's MLflow run (params: its whole section), tagged with the content hash of `inputs` (paths,
    or their hash from `inputs_hash`) and the stage's record_tags, its data inputs recorded as datasets
    (stages.common.tracking.datasets). Every rank enters it; rank 0 logs, and
    the first process of each node its system metrics (runs.node_metrics). Yields (tracker, inputs hash)."""
    digest = inputs if isinstance(inputs, str) else inputs_hash(inputs, rt)
    paths = () if isinstance(inputs, str) else inputs  # (recorded as datasets where no launcher names its deps)
    tags = {**(record_tags(section) if rt.is_main else {}), **(tags or {})}  # (rank 0 opens the run)
    run = runs.start_run(section, config.as_dict(cfg), digest, rt, tags=tags, inputs=paths)
    with timing.entered_in("tracking", run) as tracker:
        with timing.entered_in("tracking", runs.node_metrics(tracker, rt)):
            yield tracker, digest


@contextlib.contextmanager
def checkpoints(section: str, cfg, digest: str, rt: runtime.Runtime, keyed: dict | None = None, **key):
    """The checkpoint folder of these params and inputs (plus `key`, e.g. a variant name), held by this
    run while it trains into it and publishes: a second run of the same stage, params and inputs stops
    with a clear error instead of resuming from, or writing over, checkpoints in flight. Checkpoints
    written by other code or another torch are not resumed (see resume_problem) unless PIPELINE_RESUME
    says what to do with them. `keyed`: the params the folder's key holds (default: the whole section; a
    training stage's StageRun leaves out how its processes are laid out). Yields a ckpt.Folder: the folder
    and the writer record its checkpoints get (with a resume across a change this run makes or builds on)."""
    params = config.as_dict(cfg) if keyed is None else keyed
    folder = ckpt.checkpoint_dir(section, {**params, **key}, digest)
    with ckpt.exclusive(folder, rt):
        writer = ckpt.writer_record(f"stages.{section}")
        problem, across = None, None
        if rt.is_main:
            problem, across = resume_problem(folder, writer)
        problem, across = runtime.broadcast_object((problem, across))
        if problem:
            raise config.UserError(problem)
        # (the checkpoints this run writes carry a resume across a change on, to every run that resumes them)
        yield ckpt.Folder(folder, {**writer, ckpt.ACROSS_CODE: across} if across else writer)


RESUME_CHOICES = ("fresh", "across-code")


def resume_problem(folder: Path, writer: dict) -> tuple[str | None, str | None]:
    """(why the checkpoints in `folder` are not resumed, or None; "<old> -> <new>" when they are resumed
    across a change). A checkpoint records the hash of its stage's code and the torch version that wrote
    it: resuming one of other code would publish a model trained partly by that code under this one's
    commit, and torch's distributed checkpoints promise no compatibility across versions. A SLURM requeue
    of the same code resumes as ever. PIPELINE_RESUME=fresh sets the folder aside and starts over;
    PIPELINE_RESUME=across-code resumes and tags the run and its models. Checkpoints that a run resumed
    across a change wrote record it (ckpt.ACROSS_CODE): a run resuming them is tagged the same, asked or not."""
    choice = os.environ.get("PIPELINE_RESUME", "")
    if choice and choice not in RESUME_CHOICES:
        return f"PIPELINE_RESUME={choice}: unknown; valid: {', '.join(RESUME_CHOICES)} (or unset)", None
    differences, carried = [], None
    for path in ckpt.checkpoints(folder):
        written = ckpt.read_writer(path)
        carried = carried or written.get(ckpt.ACROSS_CODE)
        change = ckpt.writer_change(written, writer)
        if change:
            differences.append((path, written, change))
    if not differences and not (carried and choice == "fresh"):
        # Written by this code, but by a run that resumed across a change: what it built on goes on
        # being named, by this run and every later one, until PIPELINE_RESUME=fresh sets them aside.
        return None, carried
    if not differences:
        aside = ckpt.set_aside(folder)
        print(
            f"PIPELINE_RESUME=fresh: checkpoints resumed across code set aside in {aside}; starting afresh", flush=True
        )
        return None, None
    path, written, change = differences[0]
    old = f"code {written.get('code_sha256', 'unknown')[:12]}, torch {written.get('torch', 'unknown')}"
    new = f"code {writer['code_sha256'][:12]}, torch {writer['torch']}"
    if choice == "across-code":
        print(f"warning: resuming {path} across a change ({change}), as PIPELINE_RESUME=across-code asks", flush=True)
        return None, "; ".join(t for t in (carried, f"{old} -> {new}") if t)
    if choice == "fresh":
        aside = ckpt.set_aside(folder)
        print(f"PIPELINE_RESUME=fresh: checkpoints of other code set aside in {aside}; starting afresh", flush=True)
        return None, None
    return (
        f"checkpoint {path} was written by other code than this run's ({change}); resuming it would finish "
        f"that training with this code. Start afresh, keeping it aside: PIPELINE_RESUME=fresh; or resume "
        f"anyway: PIPELINE_RESUME=across-code (the MLflow run and its registered models are tagged "
        f"resumed_across_code: {old} -> {new})"
    ), None


def write_metrics(folder: str | Path, figures: dict, headline: dict) -> None:
    """A stage's figures, in two files of its output folder: metrics.json, the headline figures a user
    compares across experiments (a handful: the stage's DVC metrics, the columns `dvc exp show` prints),
    and figures.json, every figure (what the report, the tests and a closer look read)."""
    atomic.write_json(Path(folder) / "metrics.json", headline)
    atomic.write_json(Path(folder) / "figures.json", figures)


def write_measured(path: str | Path, output: str | Path, figures: dict) -> None:
    """What a run measured rather than computed (throughput, MFU, seconds, peak memory), written to
    `path` outside the stage's output (pipelines/stages.yaml `measured`, an out DVC does not cache):
    these numbers change from run to run on the same inputs, so inside the output they would change its
    hash. {"output": the output they were measured for, **figures}. Rank 0 calls it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(Path(path), {"output": str(output), **figures})


def code_record(section: str) -> dict:
    """What an output's meta.json records of the code and environment that made it: the hash of the
    stage's code (stages.common.provenance), the versions of the packages it imports, and the environment
    it ran in (`environment`: stages.common.environment.output_record). Not the git
    commit: an unrelated commit must not change an output's hash (the commit is in the MLflow run and
    the registered model's lineage)."""
    module = f"stages.{section}"
    record = {"code_sha256": ckpt.writer_record(module)["code_sha256"], "packages": provenance.packages(module)}
    return record | environment.output_record(section)


def read_figures(folder: str | Path) -> dict:
    """Every figure a stage wrote (its figures.json)."""
    path = Path(folder) / "figures.json"
    if not path.is_file():
        raise config.UserError(f"{path} not found; run the stage that writes {Path(folder)} first")
    return json.loads(path.read_text())


@timing.phase("outputs")
def publish(output: str | Path, rt: runtime.Runtime, write):
    """Write the stage's output folder atomically: rank 0 calls `write(tmp)` into a temporary folder
    beside `output`, which replaces `output` once every rank got there. Returns what `write` returned,
    on every rank."""
    result = None
    with atomic.folder(output, rt) as tmp:
        if rt.is_main:
            result = write(tmp)
    return runtime.broadcast_object(result)


@timing.phase("tracking")
def register_models(
    tracker, section: str, cfg, models: dict, output, inputs: list, digest: str, across_code: str | None = None
) -> None:
    """Register each model folder the stage published in `output` ({item or None: folder}) in the MLflow
    model registry as `<section>` or `<section>-<item>` (a sweep point's: `sweep_<name>-<point>[-<item>]`),
    with its lineage (stages/common/registry.py).
    Rank 0 with a run open."""
    if not tracker:
        return
    try:
        tags = registry.lineage(Path(output), [Path(p) for p in inputs], config.as_dict(cfg), digest)
        versions = ("package.", "packages_installed")  # (the run has them; the lineage keeps their hash)
        tags |= {k: v for k, v in record_tags(section, across_code).items() if not k.startswith(versions)}
        records = [
            registry.version_record(
                registry.model_name(contract.model_prefix(section), item),
                Path(folder),
                tags,
                f"The {section} stage's model{f' ({item})' if item else ''}, registered by each run.",
                item,
                list(models),
            )
            for item, folder in models.items()
        ]
        # Registered by the run's sender, after its other records (never waiting on the server here):
        # waited for at most PIPELINE_TRACKING_FLUSH_S; with the server lost they are kept with the rest.
        for record in records:
            tracker.register(record)
        if not tracker.flush(flush_s()):
            print(
                f"{section}: the MLflow server does not take records ({tracker.lost or 'still sending'}); "
                "the model version(s) are registered when the run's kept records are sent",
                file=sys.stderr,
            )
    except Exception as e:  # noqa: BLE001 - the stage published its output; the registry is a record of it
        print(f"{section}: could not register its model(s) in MLflow: {type(e).__name__}: {e}", file=sys.stderr)
        tracker.set_tags({"registry_error": f"{type(e).__name__}: {e}"[:500]})


def entry(main) -> None:
    """`python -m stages.<name>`: a UserError becomes one line on stderr (rank 0) and exit code 2. Under
    pipelines.launch the first rank to fail this way also leaves the line in its last-line file (contract): torchrun
    reports any failed worker as its own exit 1, after pages of its own, and the launcher ends with the line
    and exit 2. A stage that finished, or refused its input, ends without the interpreter's teardown
    (exit_now); other failures end as Python ends them, with their traceback."""
    try:
        main()
    except config.UserError as e:
        contract.leave_last_line(contract.REFUSED_EXIT, f"error: {e}")
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank refuses the same input and rank 0 says so. A rank that ended first would have a bare
            # torchrun stop rank 0, maybe before its line is out: the others wait, and are stopped once it is.
            time.sleep(REFUSAL_GRACE_S)
        exit_now(contract.REFUSED_EXIT)
    exit_now(0)


def exit_now(code: int) -> None:
    """End the process as Python would, but for the teardown of its modules: wait for its other threads
    that are not daemons, run the exit handlers (atexit: MLflow's, torch's, logging's), flush stdout and
    stderr, then os._exit. With torch, transformers and sympy loaded, the teardown that is left out is a
    second of CPU per process, after everything the stage makes has been written and closed."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if code == 0:
        timing.write_record()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
