"""The journal of a stage's run: `logs/mlflow-unsent/<run id>.jsonl`, one signed line per record
(stages/common/tracking/records.py), written by the stage and sent by its sender thread
(stages/common/tracking/sender.py). A file whose writer is gone is sent by the next stage of the
workspace that reaches the server, or by

    python -m stages.common.tracking.journal resend [FILE ...]   # default: every file under logs/mlflow-unsent/
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import itertools
import json
import os
import secrets
import sys
from pathlib import Path

from stages.common import contract
from stages.common.config import UserError
from stages.common.tracking import store
from stages.common.tracking.records import KINDS, NOT_SENT, say, send_records

UNSENT = Path("logs") / "mlflow-unsent"


def read_records(fh, start: int, end: int | None = None) -> list[tuple[dict, int]]:
    """The records of an unsent file from byte `start` (to `end`), each with the offset after its line. A
    last line without its newline (a write cut short by a kill or a full disk) is left out, as is a line
    that does not parse (named)."""
    fh.seek(start)
    data = fh.read() if end is None else fh.read(end - start)
    found, offset = [], start
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        offset += len(line)
        if line.strip():
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(line)
                found.append((record, offset))
            except ValueError:
                where = f"{getattr(fh, 'name', 'an unsent file')}, byte {offset - len(line)}"
                say(f"{where}: a damaged line passed over")
    return found


def open_locked(path: Path, mode: str):
    """`path` opened and locked (flock, without waiting), or OSError: a live writer holds it, or it was
    removed meanwhile (sent by another process: its lock was taken on the file just unlinked)."""
    fh = open(path, mode)  # noqa: SIM115 - returned
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fh.fileno()).st_nlink == 0:
            raise FileNotFoundError(path)
    except OSError:
        fh.close()
        raise
    return fh


# ------------------------------------------------------------------ whose records an unsent file holds
# An unsent file is replayed by another process (the next stage that starts, `resend`), whose records may
# upload local files. So it is replayed only when a stage of this workspace wrote it, line by line: each
# line carries an HMAC-SHA256, keyed by the workspace's secret KEY_FILE (made by the first stage that tracks,
# readable by its owner alone), over the run id, the workspace's root and the record; its header names
# the run the file is named after and the root. Someone who can write into logs/ but cannot read KEY_FILE
# cannot forge a line, move one to another run's file or another workspace, or make a file of another run;
# they can still delete or cut a file (its records are then not sent) or put back lines a stage of this
# workspace wrote for the same run (sent again: MLflow keeps one of two equal metric points, a model
# version is registered once per run, an artifact is uploaded again from where it was). Whoever can read
# KEY_FILE can sign lines; then the second check still holds: the files a replayed record uploads must
# lie, symlinks followed, inside the workspace's OUTPUT_ROOTS.
KEY_FILE = Path(".cache") / "tracking.key"
# The workspace's folders whose files stages log as artifacts and register as models (dvc.yaml's outs).
OUTPUT_ROOTS = ("data", "measured", "reports")


class JournalRefused(UserError):
    """An unsent file that is not replayed (named, with why): none of its records are sent."""


def journal_key(root: Path, make: bool = True) -> bytes | None:
    """The secret of workspace `root` that signs its unsent files: made on first use (`make`), whole, by
    the first of the stages that start at once; None when there is none and `make` is False."""
    path = root / KEY_FILE
    if make and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # (never replaces: a key that signed a file stays)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UserError(f"{path} is not a key a stage made; remove it (the unsent files it signed are then not sent)")
    return key


class Seal:
    """Signs and checks the lines of run `run_id`'s unsent file in workspace `root`."""

    def __init__(self, key: bytes, run_id: str, root: Path):
        self.key, self.bound = key, f"{run_id}\n{root}\n".encode()

    def _mac(self, body: str) -> str:
        return hmac.new(self.key, self.bound + body.encode(), hashlib.sha256).hexdigest()

    def line(self, record: dict) -> bytes:
        """`record` as a signed line (ASCII: non-ASCII is escaped)."""
        body = json.dumps(record, default=str, sort_keys=True)
        return (json.dumps({**json.loads(body), "mac": self._mac(body)}) + "\n").encode()

    def holds(self, record: dict) -> bool:
        """Whether `record` (a line read back) was signed by a stage of this workspace for this run."""
        mac = record.get("mac")
        body = json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True)
        return isinstance(mac, str) and hmac.compare_digest(mac, self._mac(body))


def check_journal(path: Path, lines: list[tuple[dict, int]], root: Path) -> tuple[dict, Seal]:
    """The header and Seal of the unsent file `path` (its records: `lines`), or JournalRefused naming why:
    it is replayed only if a stage of workspace `root` wrote it for the run it is named after."""

    def refuse(why: str) -> JournalRefused:
        return JournalRefused(f"{path} not sent: {why}; see who wrote it into {UNSENT}/, then remove it")

    header = lines[0][0] if lines else {}
    if header.get("kind") != "header" or header.get("run_id") != path.stem:
        raise refuse(f"its header does not name run {path.stem}, the run the file is named after")
    if header.get("root") != str(root):
        raise refuse(f"it was written for workspace {header.get('root')}, not this one ({root})")
    key = journal_key(root, make=False)
    if key is None:
        raise refuse(f"this workspace has no {KEY_FILE} to check its lines with")
    seal = Seal(key, path.stem, root)
    for n, (record, _) in enumerate(lines, 1):
        if not seal.holds(record):
            raise refuse(f"record {n} is not signed by this workspace's stages ({KEY_FILE})")
    return header, seal


def outside_outputs(path: Path, root: Path) -> str | None:
    """Why `path` (a file, or a folder and all it holds) may not be uploaded from a replayed record: some
    part of it, links followed, lies outside the workspace's OUTPUT_ROOTS; None when it may."""
    roots = [(root / name).resolve() for name in OUTPUT_ROOTS]
    found = [path]
    if path.is_dir() and not path.is_symlink():
        for folder, dirs, files in os.walk(path):  # (a linked folder inside is listed, not entered)
            found += [Path(folder, name) for name in dirs + files]
    for item in found:
        real = item.resolve()
        if not any(real.is_relative_to(r) for r in roots):
            places = ", ".join(f"{name}/" for name in OUTPUT_ROOTS)
            return f"{item} lies outside the workspace's outputs ({places} of {root})"
    return None


def leftover_files(root: Path, uri: str) -> list[Path]:
    """Unsent files under `root` of runs of `uri` whose writers are gone (their lock is free)."""
    found = []
    for path in sorted((root / UNSENT).glob("*.jsonl")):
        try:
            with open_locked(path, "rb") as fh:  # (the lock is released on close)
                header = json.loads(fh.readline())
        except (OSError, ValueError):
            continue  # written now by a live stage, sent meanwhile, or not a file of ours
        if isinstance(header, dict) and header.get("uri") == uri:
            found.append(path)
    return found


def resend(path: Path, client=None, root: Path | None = None) -> int:
    """Send the records of an unsent file whose writer is gone, then remove it; the number sent. Only a
    file a stage of workspace `root` (default: this one) wrote for its run is sent (check_journal, else
    JournalRefused), and its artifacts and model folders only from inside the workspace's outputs. Without
    `client`, one of the tracking server the file names, once it answers."""
    import mlflow

    root = Path(root or contract.workspace()).resolve()
    try:
        fh = open_locked(path, "rb+")
    except FileNotFoundError:
        raise
    except OSError:
        raise UserError(f"{path} is being written by a running stage; it sends it itself") from None
    with fh:
        lines = read_records(fh, 0)
        header, seal = check_journal(path, lines, root)
        sent_to = header["run_id"]
        if client is None:
            problem = store.server_problem(header["uri"])
            if problem:
                raise UserError(f"the tracking server of {path} does not answer ({problem}); try again once it does")
            client = mlflow.MlflowClient(header["uri"])
        upto = max((r["upto"] for r, _ in lines if r["kind"] == "sent"), default=0)
        # Records after the last one noted as sent (one sent just before its writer died is sent twice:
        # MLflow keeps one of two equal metric points, and a model version is registered once per run);
        # the run's end last.
        pending = [(r, at) for r, at in lines[1:] if at > upto and r["kind"] not in ("header", "sent")]
        ordered = sorted(pending, key=lambda p: KINDS.get(p[0]["kind"], NOT_SENT).last)

        def refused(record: dict) -> str | None:
            field = KINDS.get(record["kind"], NOT_SENT).uploads
            if field is None:
                return None
            why = outside_outputs(Path(record[field]), root)
            return why and f"{path}: a record of kind {record['kind']} not sent: {why}"

        progress = [0]
        try:
            send_records(client, sent_to, [r for r, _ in ordered], progress, refused=refused)
        except BaseException:
            done = {id(r) for r, _ in ordered[: progress[0]]}
            prefix = list(itertools.takewhile(lambda p: id(p[0]) in done, pending))  # sent, in the file's order
            if prefix:
                fh.seek(0, os.SEEK_END)
                end = fh.tell()
                if lines and end > lines[-1][1]:  # a cut last line: dropped before a line is added
                    fh.truncate(lines[-1][1])
                    fh.seek(lines[-1][1])
                fh.write(seal.line({"kind": "sent", "upto": prefix[-1][1]}))
            raise
        path.unlink()
    say(f"sent {len(pending)} records kept in {path} to run {sent_to}")
    return len(pending)


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m stages.common.tracking.journal",
        description="Send the MLflow records a stage kept on disk while its tracking server was lost.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("resend", help="send unsent files (default: every one under logs/mlflow-unsent/)")
    cmd.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    files = args.files or sorted((contract.workspace() / UNSENT).glob("*.jsonl"))
    if not files:
        print("nothing to send")
    failed = []
    for path in files:
        try:
            resend(path)
        except (UserError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed.append(path)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
