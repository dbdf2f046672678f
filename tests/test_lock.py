"""requirements.lock and the hashed install: every pin carries sha256 hashes in the format make lock writes;
pip, run as the Makefile runs it, refuses a file whose bytes the lock does not record, and keeps an
installed build with a local label (torch's +cpu) without fetching or checking it. pip runs against a PEP 503
index on 127.0.0.1 serving a wheel made here, with no configuration of this machine's (no find-links, no
other index)."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import threading
import zipfile
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ROOT

from pipelines import lock

NAME = "lockdemo"
MISMATCH = "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE"


def wheel(folder: Path, version: str) -> Path:
    """A pure-Python wheel of NAME at `version`: one module, its metadata, its RECORD."""
    dist_info = f"{NAME}-{version}.dist-info"
    members = {
        f"{NAME}.py": f"VERSION = {version!r}\n".encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    members[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    path = folder / f"{NAME}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def index(tmp_path):
    """(index URL, the served wheel, the paths requested): NAME 1.0 as a PEP 503 simple index serves it,
    the link without a hash, so pip hashes the bytes it receives."""
    root = tmp_path / "index"
    (root / "simple" / NAME).mkdir(parents=True)
    served = wheel(root, "1.0")
    link = f'<a href="../../{served.name}">{served.name}</a>'
    (root / "simple" / NAME / "index.html").write_text(f"<!DOCTYPE html><html><body>{link}</body></html>\n")
    requested: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/simple", served, requested
    httpd.shutdown()
    httpd.server_close()


def pip_install(url: str, locked: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The Makefile's hashed install of a lock, from the index at `url` only: this machine's pip
    configuration (files and PIP_* variables) left out, no cache."""
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    cmd = [sys.executable, "-m", "pip", "install", "--require-hashes", "--no-deps", "--no-cache-dir"]
    cmd += ["--disable-pip-version-check", "--index-url", url, "-r", str(locked), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def lock_file(folder: Path, digest: str) -> Path:
    path = folder / "requirements.lock"
    path.write_text(lock.render([lock.Pin(NAME, "1.0", (f"sha256:{digest}",))]))
    return path


def test_pip_refuses_a_file_whose_sha256_the_lock_does_not_record(index, tmp_path):
    url, served, _ = index
    right = hashlib.sha256(served.read_bytes()).hexdigest()
    wrong = hashlib.sha256(b"the wheel as it was first uploaded").hexdigest()

    ok = pip_install(url, lock_file(tmp_path, right), "--target", str(tmp_path / "ok"))
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "ok" / f"{NAME}.py").read_text() == "VERSION = '1.0'\n"

    refused = pip_install(url, lock_file(tmp_path, wrong), "--target", str(tmp_path / "refused"))
    assert refused.returncode != 0
    assert MISMATCH in refused.stderr, refused.stderr
    assert f"Expected sha256 {wrong}" in refused.stderr and f"Got        {right}" in refused.stderr
    assert not (tmp_path / "refused" / f"{NAME}.py").exists()


def test_an_installed_build_with_a_local_label_satisfies_its_hashed_pin_unfetched(index, tmp_path):
    # As torch 2.13.0+cpu, installed first by the Makefile, against the lock's torch==2.13.0 and the hashes
    # of PyPI's builds: pip keeps it and neither fetches nor checks a file (--dry-run: nothing is installed).
    url, served, requested = index
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel(tmp_path, "1.0+cpu")) as z:
        z.extractall(site)
    locked = lock_file(tmp_path, hashlib.sha256(served.read_bytes()).hexdigest())

    kept = pip_install(url, locked, "--dry-run", env={**os.environ, "PYTHONPATH": str(site)})
    assert kept.returncode == 0, kept.stderr
    assert f"Requirement already satisfied: {NAME}==1.0" in kept.stdout and "(1.0+cpu)" in kept.stdout, kept.stdout
    assert "Would install" not in kept.stdout and requested == [], requested

    fetched = pip_install(url, locked, "--dry-run")  # the same without the installed build: fetched, checked
    assert fetched.returncode == 0 and f"Would install {NAME}-1.0" in fetched.stdout, fetched.stdout + fetched.stderr
    assert f"/{served.name}" in requested


def test_every_pin_of_requirements_lock_carries_sha256_hashes_in_the_format_make_lock_writes():
    text = (ROOT / "requirements.lock").read_text()
    pins = lock.parse(text)
    assert len(pins) > 200
    unhashed = [pin.name for pin in pins if not any(h.startswith("sha256:") and len(h) == 71 for h in pin.hashes)]
    assert unhashed == [], f"requirements.lock pins these without a sha256: {unhashed} (make lock)"
    assert lock.render(pins) == text, "requirements.lock is not as pipelines/lock.py writes it: make lock"
    # PyPI serves no local versions: torch's build (+cpu) is the Makefile's, pinned without its label.
    assert [pin for pin in pins if "+" in pin.version] == []
    assert {pin.name for pin in pins} >= {"torch", "uv"}


def test_a_lock_line_that_is_not_a_hashed_pin_is_refused_naming_it():
    with pytest.raises(lock.LockError, match=r"`torch>=2` is not `name==version --hash=sha256:...`: run make lock"):
        lock.parse("torch>=2\n")
    with pytest.raises(lock.LockError, match="--hash=md5:"):
        lock.parse("torch==2.13.0 \\\n    --hash=md5:00\n")
