"""python -m pipelines.mirror against a local HTTP server on 127.0.0.1 serving small fake sources (their
sha256 put in place of the real ones): the download, a damaged file refused, a cut download resumed with
Range, a server that ignores Range, archives, a served mirror folder (members without their archive); and
the real source table's pins."""

from __future__ import annotations

import hashlib
import io
import random
import re
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipelines import mirror
from stages.common import sources

SIZE = 50_000


def blob(seed: int, size: int = SIZE) -> bytes:
    return random.Random(seed).randbytes(size)


def raw_file(path: str, data: bytes, **archive) -> sources.RawFile:
    return sources.RawFile(path, f"https://example.org/{path}", hashlib.sha256(data).hexdigest(), len(data), **archive)


def archive_of(name: str, data: bytes) -> sources.Archive:
    return sources.Archive(f"https://example.org/{name}", hashlib.sha256(data).hexdigest(), len(data))


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Server:
    """Serves `files` (URL path -> bytes); `ranges` False ignores Range; each of the next `cuts` responses
    sends only `cut` bytes of its body, then closes the connection."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.ranges = True
        self.cut = 0
        self.cuts = 0
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path, wanted = self.path.lstrip("/"), self.headers.get("Range")
                server.requests.append((path, wanted))
                body = server.files.get(path)
                if body is None:
                    self.send_error(404)
                    return
                start = int(re.fullmatch(r"bytes=(\d+)-", wanted)[1]) if wanted and server.ranges else 0
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if server.cuts:
                    server.cuts -= 1
                    payload = payload[: server.cut]
                    self.close_connection = True
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def fake(monkeypatch):
    """Four plain files, a zip with two members, a tarball with one; the server and the known files."""
    plain = {f"corpus/part{i}.txt": blob(i) for i in range(4)}
    zipped = {"inner/a.raw": blob(10), "inner/b.raw": blob(11)}
    tarred = {"pkg/c.bin": blob(12)}
    zip_blob, tar_blob = zip_bytes(zipped), tar_bytes(tarred)
    zip_archive, tar_archive = archive_of("set-v1.zip", zip_blob), archive_of("pkg-1.0.tar.gz", tar_blob)
    known = (
        *(raw_file(path, data) for path, data in plain.items()),
        *(raw_file(f"set/{Path(m).name}", d, archive=zip_archive, member=m) for m, d in zipped.items()),
        *(raw_file(f"pkg/{Path(m).name}", d, archive=tar_archive, member=m) for m, d in tarred.items()),
    )
    monkeypatch.setattr(sources, "all_files", lambda: known)
    server = Server({**plain, "set-v1.zip": zip_blob, "pkg-1.0.tar.gz": tar_blob})
    monkeypatch.setenv(mirror.BASE_URL_ENV, server.url)
    expected = {
        **plain,
        "set/a.raw": zipped["inner/a.raw"],
        "set/b.raw": zipped["inner/b.raw"],
        "pkg/c.bin": tarred["pkg/c.bin"],
    }
    yield server, expected
    server.httpd.shutdown()
    server.httpd.server_close()


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_builds_the_mirror_and_a_second_run_downloads_nothing(fake, tmp_path, capsys):
    server, expected = fake
    assert mirror.main([str(tmp_path / "m")]) == 0
    assert files_under(tmp_path / "m") == expected  # no .part, no archive left, nothing else
    out = capsys.readouterr().out
    for path, data in expected.items():
        line = f"{path}  {len(data):,} bytes  sha256 {hashlib.sha256(data).hexdigest()} ok"
        assert line in out, out
    assert "(from set-v1.zip)" in out and "(from pkg-1.0.tar.gz)" in out

    server.requests.clear()
    (tmp_path / "m/corpus/part1.txt").write_bytes(b"edited by hand")
    assert mirror.main([str(tmp_path / "m")]) == 0
    assert server.requests == [("corpus/part1.txt", None)]  # the rest were present and correct
    assert (tmp_path / "m/corpus/part1.txt.bad").read_bytes() == b"edited by hand"
    assert (tmp_path / "m/corpus/part1.txt").read_bytes() == expected["corpus/part1.txt"]
    assert capsys.readouterr().out.count("(already present)") == len(expected) - 1


def test_a_damaged_download_is_refused_and_set_aside(fake, tmp_path, capsys):
    server, expected = fake
    good = server.files["corpus/part2.txt"]
    server.files["corpus/part2.txt"] = good[:-1] + bytes([good[-1] ^ 1])  # one bit flipped
    server.files["set-v1.zip"] = zip_bytes({"inner/a.raw": b"x" * SIZE, "inner/b.raw": blob(11)})
    assert mirror.main([str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err  # one line per refused download, then the summary
    assert re.match(
        r"mirror: error: corpus/part2.txt: the download from http://.* has sha256 \w{64} .*moved aside", err[0]
    )
    assert re.match(r"mirror: error: set-v1.zip: the download from .* not the published", err[1])
    assert err[2].startswith("mirror: 3 of 7 files are not in place")
    m = tmp_path / "m"
    assert not (m / "corpus/part2.txt").exists() and not (m / "set/a.raw").exists()
    assert (m / "corpus/part2.txt.bad").read_bytes() == server.files["corpus/part2.txt"]
    assert (m / ".downloads/set-v1.zip.bad").exists()
    assert (m / "corpus/part3.txt").read_bytes() == expected["corpus/part3.txt"]


def test_a_member_that_differs_from_the_published_one_is_refused(fake, tmp_path, monkeypatch, capsys):
    server, _ = fake
    known = [
        raw if raw.mirror != "set/a.raw" else sources.RawFile(raw.mirror, None, "0" * 64, SIZE, raw.archive, raw.member)
        for raw in sources.all_files()
    ]
    monkeypatch.setattr(sources, "all_files", lambda: tuple(known))
    assert mirror.main([str(tmp_path / "m")]) == 1
    assert "set/a.raw: inner/a.raw of set-v1.zip has sha256" in capsys.readouterr().err
    assert not (tmp_path / "m/set/a.raw").exists() and (tmp_path / "m/set/a.raw.bad").exists()
    assert (tmp_path / "m/.downloads/set-v1.zip").exists()  # kept: the next run does not download it again


def test_a_cut_download_resumes_with_range_within_a_run_and_in_the_next(fake, tmp_path, capsys, monkeypatch):
    server, expected = fake
    first = sources.all_files()[:1]
    monkeypatch.setattr(sources, "all_files", lambda: first)
    cut = SIZE // 5
    server.cut, server.cuts = cut, 4  # four responses end after `cut` bytes: 3 tries in the first run
    assert mirror.main([str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "corpus/part0.txt: download from" in err and "part0.txt.part keeps what arrived" in err, err
    assert (tmp_path / "m/corpus/part0.txt.part").stat().st_size == 3 * cut
    assert not (tmp_path / "m/corpus/part0.txt").exists()

    assert mirror.main([str(tmp_path / "m")]) == 0
    assert (tmp_path / "m/corpus/part0.txt").read_bytes() == expected["corpus/part0.txt"]
    assert not (tmp_path / "m/corpus/part0.txt.part").exists()
    assert server.requests == [("corpus/part0.txt", r) for r in [None, *(f"bytes={k * cut}-" for k in range(1, 5))]]


def test_a_server_without_range_support_restarts_the_file(fake, tmp_path):
    server, expected = fake
    server.ranges = False
    server.cut, server.cuts = SIZE // 3, 1
    assert mirror.main([str(tmp_path / "m")]) == 0
    assert files_under(tmp_path / "m") == expected
    assert server.requests[:2] == [("corpus/part0.txt", None), ("corpus/part0.txt", f"bytes={SIZE // 3}-")]


def test_an_unknown_url_fails_with_the_status_and_what_to_check(fake, tmp_path, capsys):
    server, _ = fake
    del server.files["corpus/part1.txt"]
    assert mirror.main([str(tmp_path / "m")]) == 1
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "part1" in ln]
    expected = r"mirror: error: corpus/part1.txt: download from http://\S+ failed \(HTTP Error 404.*\); check "
    expected += mirror.BASE_URL_ENV
    assert re.fullmatch(expected, line), line


def test_a_served_mirror_folder_without_the_archives_gives_their_members_as_files(fake, tmp_path, capsys):
    server, expected = fake
    for archive in ("set-v1.zip", "pkg-1.0.tar.gz"):
        del server.files[archive]
    server.files.update({path: expected[path] for path in ("set/a.raw", "set/b.raw")})  # pkg/c.bin: on neither
    assert mirror.main([str(tmp_path / "m")]) == 1
    out, err = capsys.readouterr()
    assert "set/a.raw  50,000 bytes" in out and "ok (downloaded; the server has no set-v1.zip)" in out, out
    (line, summary) = err.splitlines()[-2:]
    assert re.fullmatch(
        r"mirror: error: pkg/c.bin: download from http://\S+/pkg/c.bin failed \(HTTP Error 404.*\); the server has "
        rf"neither it nor pkg-1.0.tar.gz: check {mirror.BASE_URL_ENV}",
        line,
    ), line
    assert summary.startswith("mirror: 1 of 7 files are not in place")
    assert files_under(tmp_path / "m") == {k: v for k, v in expected.items() if k != "pkg/c.bin"}
    assert ("set-v1.zip", None) in server.requests and ("set/a.raw", None) in server.requests


def test_every_known_file_has_a_pinned_public_source():
    known = sources.all_files()
    assert len({raw.mirror for raw in known}) == len(known)
    pinned = re.compile(
        r"https://(raw\.githubusercontent\.com/[^/]+/[^/]+|huggingface\.co/datasets/[^/]+/[^/]+/resolve)/[0-9a-f]{40}/"
    )
    for raw in known:
        assert re.fullmatch(r"[0-9a-f]{64}", raw.sha256) and raw.size > 0, raw
        source = raw.url or raw.archive.url
        assert pinned.match(source), f"{raw.mirror}: {source} is not pinned to a commit"
        assert (raw.archive is None) == (raw.member is None) and (raw.url is None) == (raw.archive is not None), raw
    assert sources.ALPACA_5K.url.endswith("/e130e29706ce232c2985c920ae6656b4eca2c664/data/alpaca_data_5k.jsonl")
