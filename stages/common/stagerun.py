"""One run of a training stage as one object: what it was given (its params section, the process group,
the stop flag, its inputs' content hash) and what it decides as it goes (its MLflow tracker, the checkpoint
folder it holds with the writer record its checkpoints get, a resume across a code change). Helpers take
the run instead of these one by one, and nothing is handed over through module globals. A stage's `run`:

    run = StageRun(STAGE, cfg, rt, stop, stage.inputs_hash([inp], rt))
    with run.checkpoints(), run.tracked():
        result = loop.fit(model, train_data, val_data, cfg.train, context, run)
        meta = run.publish(output, lambda tmp: save_outputs(tmp, ...))
        run.finish(output, measured=(path, figures), artifacts=[...], models={None: output / "model"}, inputs=[inp])

(the lock first, where the stage has one folder: a second run of the same params and inputs stops before
it opens an MLflow run). Checkpoints and tracking open in either order: a resume across a change, decided
when a checkpoint folder opens, is tagged on the run whether it is open yet or not, and on the models it
registers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from stages.common import ckpt, config, runtime, stage, timing
from stages.common.train_config import TrainConfig


@dataclass
class StageRun:
    section: str
    cfg: object
    rt: runtime.Runtime
    stop: runtime.StopFlag
    digest: str
    """The content hash of the stage's inputs (stage.inputs_hash)."""
    tracker: object = None
    """The open MLflow run's tracker (stages.common.tracking.tracker), while `tracked` holds it."""
    folder: ckpt.Folder | None = None
    """The checkpoint folder held now (`checkpoints`), with the writer record its checkpoints get."""
    across_code: str | None = None
    """A resume across a code or torch change that this run made or built on ("<old> -> <new>")."""
    spent: list[Path] = field(default_factory=list)
    """Checkpoint folders whose training is published: removed by `finish`."""

    @contextlib.contextmanager
    def tracked(self, tags: dict | None = None):
        """The stage's MLflow run (stage.tracked), tagged with the checkpoint folder held and a resume across
        a change decided so far. Yields its tracker, also `self.tracker` while open."""
        tags = dict(tags or {})
        if self.folder is not None:
            tags.setdefault("checkpoints", str(self.folder.path))
        if self.across_code:
            tags[ckpt.ACROSS_CODE] = self.across_code
        with stage.tracked(self.section, self.cfg, self.digest, self.rt, tags=tags) as (tracker, _):
            self.tracker = tracker
            try:
                yield tracker
            finally:
                self.tracker = None

    @contextlib.contextmanager
    def checkpoints(self, **key):
        """The checkpoint folder of these params and inputs (plus `key`, e.g. a variant), held while the run
        trains into it and publishes (stage.checkpoints). A resume across a change it brings is recorded on
        the run, and tagged on its MLflow run at once when that is open. Yields the ckpt.Folder."""
        params = config.as_dict(self.cfg)
        if isinstance(params.get("train"), dict):  # a run may resume under another layout of its processes
            params["train"] = TrainConfig.checkpoint_params(params["train"])
        with stage.checkpoints(self.section, self.cfg, self.digest, self.rt, params, **key) as folder:
            if folder.across_code and folder.across_code not in (self.across_code or ""):
                self.across_code = "; ".join(t for t in (self.across_code, folder.across_code) if t)
                if self.tracker is not None:
                    self.tracker.set_tags({ckpt.ACROSS_CODE: self.across_code})
            self.folder = folder
            try:
                yield folder
            finally:
                self.folder = None

    @timing.phase("outputs")
    def publish(self, output: str | Path, write):
        """stage.publish: rank 0 writes the output folder through `write(tmp)`, renamed into place."""
        return stage.publish(output, self.rt, write)

    def finish(
        self,
        output: Path,
        measured: tuple[Path, dict] | None = None,
        metrics: dict | None = None,
        artifacts: tuple = (),
        models: dict | None = None,
        inputs: tuple = (),
    ) -> None:
        """What follows a published output, on rank 0, with the run tracked: the run's measured figures
        (`measured`: their file and figures, stage.write_measured), final `metrics`, the `artifacts` (paths,
        or (path, artifact path)) and the measured file, the `models` registered ({item or None: folder},
        stage.register_models, with lineage to `inputs`), and the spent checkpoint folders removed."""
        if not self.rt.is_main:
            return
        if measured is not None:
            stage.write_measured(measured[0], output, measured[1])
        if metrics:
            self.tracker.log_metrics(metrics)
        for artifact in ((measured[0],) if measured else ()) + tuple(artifacts):
            self.tracker.log_artifact(*(artifact if isinstance(artifact, tuple) else (artifact,)))
        if models:
            stage.register_models(
                self.tracker, self.section, self.cfg, models, output, list(inputs), self.digest, self.across_code
            )
        for folder in self.spent:
            for kept in ckpt.checkpoints(folder):
                self.tracker.checkpoint_removed(kept, "removed once the stage's output was published")
            ckpt.discard(folder)
        self.spent.clear()
