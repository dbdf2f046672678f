"""The MLflow store the stages track to: its URI, a new SQLite store made whole, the experiment and its
saved view, and the checks that the server answers and lets this user in.

Default store: `sqlite:///<repo>/mlflow.db` with artifacts in `<repo>/mlartifacts`; the
`MLFLOW_TRACKING_URI` environment variable points elsewhere (a tracking server on a cluster).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from stages.common import atomic, contract
from stages.common.config import UserError

EXPERIMENT = os.environ.get("MLFLOW_EXPERIMENT_NAME", "pipeline")
# The experiment's kind: model training, not a GenAI app. (MLflow 3.17's UI picks its views from a
# switch of its own, remembered per browser, defaulting to GenAI; the links `make mlflow-ui` prints set
# it to model training: UI_QUERY.)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
UI_QUERY = "workflowType=machine_learning"
# The runs table as `make mlflow-ui` opens it (#/experiments/<id>/runs?viewStateShareKey=training&...):
# a saved view of the MLflow UI (also in its "Views" menu), with the columns a user compares across the
# stage runs, newest first, stage runs nested under their pipeline run.
VIEW = "training"
VIEW_COLUMNS = (
    "tags.`git_commit`",
    "metrics.`loss`",
    "metrics.`val_loss`",
    "metrics.`eval_loss`",
    "metrics.`tokens_per_s`",
    "metrics.`mfu`",
    "metrics.`peak_memory_mb`",
    "metrics.`gcn_test_acc_mean`",
    "metrics.`gat_test_acc_mean`",
    "metrics.`rows_passed`",
    "metrics.`rows_failed`",
    "params.`train.steps`",
    "params.`train.lr`",
    "params.`train.strategy`",
    "params.`train.optimizer`",
    "params.`model.n_layers`",
    "params.`model.hidden_size`",
    "params.`context_length`",
    "params.`vocab_size`",
    "params.`quantization`",
)


def tracking_off() -> bool:
    """`PIPELINE_TRACKING=off`: stages log nothing to MLflow (a machine without it); outputs are unchanged."""
    value = os.environ.get("PIPELINE_TRACKING", "on").strip().lower()
    if value not in ("on", "off"):
        raise UserError(f"PIPELINE_TRACKING must be 'on' or 'off', got {value!r}")
    return value == "off"


def view_tag() -> tuple[str, str]:
    """The experiment tag holding the saved view VIEW, in the MLflow UI's format."""
    state = {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": list(VIEW_COLUMNS)}
    envelope = {"name": "Training runs", "createdAt": int(time.time() * 1000), "state": json.dumps(state)}
    return f"mlflow.sharedViewState.{VIEW}", json.dumps(envelope)


def _view_state(tag: str | None):
    try:
        return json.loads(json.loads(tag)["state"])
    except (TypeError, ValueError, KeyError):
        return None


def view_url(base: str, experiment_id: str) -> str:
    """The page of the experiment's runs table in the saved view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW}&{UI_QUERY}"


def tracking_uri(root: Path | None = None) -> str:
    """MLFLOW_TRACKING_URI, else the repository's SQLite store (mlflow.db in contract.workspace())."""
    root = Path(root or contract.workspace()).resolve()
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"


def server_problem(uri: str, timeout_s: float = 10.0) -> str | None:
    """Why the tracking server at an http(s) URI does not answer its health check, or None (also for
    local stores). MLflow's own client retries for minutes before it fails; this asks once."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as e:
        return f"its /health answered HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None


# A server with users (MLflow's basic-auth app) answers these for a request it refuses.
ACCESS_REFUSED = ("UNAUTHENTICATED", "PERMISSION_DENIED")


def access_refused_line(error: Exception, uri: str) -> str | None:
    """The one line for a tracking server that refuses this user (MLflow's basic-auth app: MLflow's client
    sends MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, else those of ~/.mlflow/credentials), or
    None for another failure. The user is named, the password never."""
    from mlflow.utils.credentials import read_mlflow_creds

    code = getattr(error, "error_code", None)
    user = read_mlflow_creds().username or ""  # (the variables, else ~/.mlflow/credentials)
    if code == "UNAUTHENTICATED" and not user:
        return (
            f"MLflow tracking server {uri} asks for a user: set MLFLOW_TRACKING_USERNAME and "
            f"MLFLOW_TRACKING_PASSWORD to an account of it (its admin creates one)"
        )
    if code == "UNAUTHENTICATED":
        return (
            f"MLflow tracking server {uri} refused user {user!r}: MLFLOW_TRACKING_USERNAME or "
            f"MLFLOW_TRACKING_PASSWORD is wrong"
        )
    if code == "PERMISSION_DENIED":
        return (
            f"MLflow tracking server {uri} does not let user {user!r} write to experiment {EXPERIMENT!r}: "
            f"its admin grants EDIT on it, or use an account that has it"
        )
    return None


@contextlib.contextmanager
def access_checked(uri: str):
    """Inside the block, a request the tracking server refuses for this user is a UserError naming why."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        line = access_refused_line(e, uri)
        if line is None:
            raise
        raise UserError(line) from None


def _make_sqlite_store(path: Path) -> None:
    """Make a new SQLite store, whole or not at all. MLflow makes a store's tables one statement at a
    time, outside any transaction, so a store whose making was killed half-way fails every later
    opening ("table ... already exists"). Here the tables are made in a work folder beside `path` and the
    finished file renamed into place; a killed making leaves only that folder, which the next one
    removes (stages/common/atomic.py)."""
    from mlflow.store.db import utils

    with atomic.scratch(path) as work:
        engine = utils.create_sqlalchemy_engine(f"sqlite:///{work / path.name}")
        try:
            utils._initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(work / path.name, path)


def open_client(root: Path | None = None):
    """A client of the tracking store (`tracking_uri(root)`). A new SQLite store is made here, whole and
    once: MLflow would make its tables when a client first opens it, which fails in a process that does
    it beside another ("table ... already exists")."""
    import mlflow

    root = root or contract.workspace()
    uri = tracking_uri(root)
    if not uri.startswith("sqlite:"):
        return mlflow.MlflowClient(uri)
    lock_path = parent_lock(root)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:  # one opening at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        store = Path(uri.removeprefix("sqlite:///"))
        if not store.exists():
            _make_sqlite_store(store)
        return mlflow.MlflowClient(uri)


def experiment(root: Path):
    """(client, id) of the experiment EXPERIMENT, created on first use with its kind and saved view."""
    import mlflow

    uri = tracking_uri(root)
    client = open_client(root)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        location = (root / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        try:
            experiment_id = client.create_experiment(EXPERIMENT, artifact_location=location)
        except mlflow.exceptions.MlflowException as e:  # created meanwhile by a parallel stage
            if e.error_code in ACCESS_REFUSED:
                raise
            experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    else:
        experiment_id = exp.experiment_id
    tags = {} if exp is None else exp.tags
    if tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    key, view = view_tag()
    if _view_state(tags.get(key)) != _view_state(view):
        client.set_experiment_tag(experiment_id, key, view)
    return client, experiment_id


def parent_lock(root: Path) -> Path:
    """The file lock serializing changes to parent runs."""
    if tracking_uri(root).startswith("sqlite:"):
        return root / "mlflow.db.lock"
    return Path(tempfile.gettempdir()) / "mlflow-pipeline.lock"


def local_path(uri: str) -> Path | None:
    """The folder a file: artifact URI names, or None for other stores."""
    parsed = urlparse(uri)
    if parsed.scheme == "file" or (parsed.scheme == "" and uri.startswith("/")):
        return Path(unquote(parsed.path))
    return None
