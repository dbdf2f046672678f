"""Build a data mirror: every known raw input (stages/common/sources.py) fetched from its pinned public
source into one folder, laid out as `PIPELINE_DATA_MIRROR` expects, each file checked against its sha256.

    python -m pipelines.mirror DIR        # or: make mirror DIR=...
    PIPELINE_DATA_MIRROR=DIR make test

A file already in DIR with its published sha256 is kept; one with another sha256 is moved aside to
`<file>.bad` and fetched again. A download goes to `<file>.part`; after a cut connection it resumes from
there with an HTTP Range request (a server that ignores Range sends the whole file, which starts it
again), within the run (3 tries) or in the next run. A download whose sha256 is not the published one is
moved to `<file>.bad` and the file is reported as failed: never left under its final name. Archives
(WikiText-2's zip) are downloaded to DIR/.downloads/, checked, and the members the mirror needs
extracted and checked in turn; the archive is removed once all its members are in place.

PIPELINE_MIRROR_BASE_URL=<url> fetches every file from `<url>/<its path in the mirror>` and every archive
from `<url>/<its file name>` instead of the public sources (a copy on a local server). Where that server
has no archive (404), each of its members is fetched as a file, from `<url>/<its path in the mirror>`: a
mirror folder served as it is.
Exit status: 0 when every file is in place, 1 when any failed (one line each, then a summary).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from stages.common import digest, sources

BASE_URL_ENV = "PIPELINE_MIRROR_BASE_URL"
DOWNLOADS = ".downloads"  # archives while their members are extracted
TRIES = 3
TIMEOUT_S = 60
CHUNK = 1 << 16


class MirrorError(Exception):
    """One file could not be put in place; the message names the file, the cause and what to do."""


class NotServed(MirrorError):
    """The server answered 404: it has no such file."""


@dataclass(frozen=True)
class Download:
    """One thing to fetch: a raw file or an archive, where from, and what it must hash to."""

    label: str  # for messages and the progress bar
    url: str
    sha256: str
    size: int
    fix: str = "check your connection and the URL"  # what to do when the server answers an error


def file_download(raw: sources.RawFile, base: str | None) -> Download:
    if base:
        return Download(raw.mirror, f"{base}/{raw.mirror}", raw.sha256, raw.size, f"check {BASE_URL_ENV}")
    return Download(raw.mirror, raw.url, raw.sha256, raw.size)


def archive_download(archive: sources.Archive, base: str | None) -> Download:
    if base:
        return Download(archive.name, f"{base}/{archive.name}", archive.sha256, archive.size, f"check {BASE_URL_ENV}")
    return Download(archive.name, archive.url, archive.sha256, archive.size)


def set_aside(path: Path) -> Path:
    bad = path.with_name(path.name.removesuffix(".part") + ".bad")
    os.replace(path, bad)
    return bad


def fetch_part(item: Download, part: Path) -> None:
    """One request: the rest of `part` (Range) or, when the server sends the whole file, all of it."""
    from tqdm.auto import tqdm

    have = part.stat().st_size if part.exists() else 0
    if have >= item.size:  # complete (its sha256 decides) or longer than the file: nothing to ask for
        return
    request = urllib.request.Request(item.url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
        if have and not (resp.status == 206 and resp.headers.get("Content-Range", "").startswith(f"bytes {have}-")):
            have = 0  # the server ignored Range: this is the whole file
        with (
            open(part, "ab" if have else "wb") as out,
            tqdm(
                total=item.size,
                initial=have,
                desc=item.label,
                unit="B",
                unit_scale=True,
                file=sys.stderr,
                leave=False,
                disable=None,
            ) as bar,
        ):
            while block := resp.read(CHUNK):
                out.write(block)
                bar.update(len(block))


def download(item: Download, dest: Path) -> None:
    """`item` to `dest` through `dest.part`, resumed after a cut connection; checked before it gets its name."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if part.exists() and part.stat().st_size > item.size:
        part.unlink()
    for _ in range(TRIES):
        try:
            fetch_part(item, part)
            failure = ""
        except (OSError, http.client.HTTPException) as e:  # URLError, a timeout, a reset, a cut chunk
            failure = str(e) or type(e).__name__
            if isinstance(e, urllib.error.HTTPError) and e.code not in (408, 429, 500, 502, 503, 504):
                error = NotServed if e.code == 404 else MirrorError
                raise error(f"{item.label}: download from {item.url} failed ({failure}); {item.fix}") from None
        got = part.stat().st_size if part.exists() else 0
        if got >= item.size:
            break
        failure = failure or f"the connection closed after {got:,} of {item.size:,} bytes"
    else:
        raise MirrorError(
            f"{item.label}: download from {item.url} stopped ({failure}); {part.name} keeps what arrived: run the "
            "command again to resume"
        )
    check(part, item, f"the download from {item.url}")
    os.replace(part, dest)


def check(path: Path, item: Download, what: str) -> None:
    """Refuse `path` unless it has the published size and sha256: it is moved to `<name>.bad`."""
    got = digest.sha256_file(path)
    if got != item.sha256:
        bad = set_aside(path)
        raise MirrorError(
            f"{item.label}: {what} has sha256 {got} ({bad.stat().st_size:,} bytes), not the published "
            f"{item.sha256} ({item.size:,} bytes); moved aside to {bad}: run the command again to download it anew"
        )


def present(raw: sources.RawFile, dest: Path) -> bool:
    """Whether `dest` already holds `raw`; a file with another sha256 is moved aside to be fetched again."""
    if not dest.is_file():
        return False
    if digest.sha256_file(dest) == raw.sha256:
        return True
    bad = set_aside(dest)
    print(f"{raw.mirror}: sha256 is not the published {raw.sha256}; moved aside to {bad}, fetching it again")
    return False


def extract(archive: Path, raw: sources.RawFile, dest: Path) -> None:
    """Member `raw.member` of the zip or tarball `archive` to `dest`, checked before it gets its name."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            src = z.open(raw.member) if raw.member in z.namelist() else None
            copy_member(src, part, raw, archive)
    else:
        with tarfile.open(archive) as t:
            copy_member(t.extractfile(raw.member) if raw.member in t.getnames() else None, part, raw, archive)
    check(part, Download(raw.mirror, "", raw.sha256, raw.size), f"{raw.member} of {archive.name}")
    os.replace(part, dest)


def copy_member(src, part: Path, raw: sources.RawFile, archive: Path) -> None:
    if src is None:
        raise MirrorError(f"{raw.mirror}: {archive.name} has no file {raw.member}; it is not the published archive")
    with src, open(part, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)


def report(raw: sources.RawFile, how: str) -> None:
    print(f"{raw.mirror}  {raw.size:,} bytes  sha256 {raw.sha256} ok ({how})", flush=True)


def build(folder: Path, base: str | None = None) -> list[str]:
    """Put every known raw file in `folder`; returns the failures (one line each), empty when all are in place."""
    failures = []
    archives: dict[sources.Archive, list[sources.RawFile]] = {}
    for raw in sources.all_files():
        try:
            if present(raw, folder / raw.mirror):
                report(raw, "already present")
            elif raw.archive is not None:
                archives.setdefault(raw.archive, []).append(raw)
            else:
                download(file_download(raw, base), folder / raw.mirror)
                report(raw, "downloaded")
        except MirrorError as e:
            failures.append(str(e))
            print(f"mirror: error: {e}", file=sys.stderr, flush=True)
    for archive, members in archives.items():
        kept = folder / DOWNLOADS / archive.name
        try:
            if not kept.is_file():
                download(archive_download(archive, base), kept)
            for raw in members:
                extract(kept, raw, folder / raw.mirror)
                report(raw, f"from {archive.name}")
            kept.unlink()
        except NotServed as e:
            if base is None:
                failures.append(str(e))
                print(f"mirror: error: {e}", file=sys.stderr, flush=True)
            else:
                failures += members_as_files(archive, members, folder, base)
        except MirrorError as e:
            failures.append(str(e))
            print(f"mirror: error: {e}", file=sys.stderr, flush=True)
    if (folder / DOWNLOADS).is_dir() and not any((folder / DOWNLOADS).iterdir()):
        (folder / DOWNLOADS).rmdir()
    return failures


def members_as_files(archive: sources.Archive, members: list[sources.RawFile], folder: Path, base: str) -> list[str]:
    """The members of an archive that the server at `base` does not have, each fetched as a file from
    `<base>/<its path in the mirror>` (a served mirror folder); the failures, one line each."""
    failures = []
    for raw in members:
        fix = f"the server has neither it nor {archive.name}: check {BASE_URL_ENV}"
        try:
            download(Download(raw.mirror, f"{base}/{raw.mirror}", raw.sha256, raw.size, fix), folder / raw.mirror)
            report(raw, f"downloaded; the server has no {archive.name}")
        except MirrorError as e:
            failures.append(str(e))
            print(f"mirror: error: {e}", file=sys.stderr, flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.mirror", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="DIR", help="the mirror folder (created if missing)")
    args = parser.parse_args(argv)
    base = os.environ.get(BASE_URL_ENV, "").rstrip("/") or None
    args.folder.mkdir(parents=True, exist_ok=True)
    failures = build(args.folder, base)
    known = sources.all_files()
    missing = sum(not (args.folder / raw.mirror).is_file() for raw in known)
    if failures:
        print(
            f"mirror: {missing} of {len(known)} files are not in place in {args.folder}; fix the causes above and "
            "run the command again (what arrived is kept)",
            file=sys.stderr,
        )
        return 1
    print(f"mirror: {len(known)} files in {args.folder}, each with its published sha256")
    print(f"use it with PIPELINE_DATA_MIRROR={args.folder.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
