"""requirements.lock: every package of the environment pinned, each with the sha256 of every file PyPI
serves for its version (the wheels of every platform and the sdist), so that an install on any Linux
machine with Python 3.11 checks each file it fetches against the lock (`pip install --require-hashes -r
requirements.lock`: .venv, the container definitions) and refuses a substituted one.

    python -m pipelines.lock               rewrite requirements.lock from the packages installed here (make lock)
    python -m pipelines.lock --tool IN     IN's lock (IN with .lock for .in): a reader's tool kept outside the
                                           environment, resolved by itself (make lock writes it too)

The pins are the environment's (`pip freeze`): `make lock` installs requirements.in into .venv first, so a
new direct dependency is resolved there and nothing already pinned moves. uv looks up the hashes of exactly
those pins (`uv pip compile --no-deps --generate-hashes`); resolving requirements.in against PyPI instead
would pin torch's CUDA packages, which the CPU build installed here does not require.

torch is pinned without its local label (2.13.0, not 2.13.0+cpu), with the hashes of PyPI's builds. The
Makefile and the containers install torch first, by itself (the CPU build from PyTorch's index where there
is no NVIDIA GPU): an installed 2.13.0+cpu satisfies `torch==2.13.0`, and pip checks no hash of a
requirement already installed, so the hashed install leaves that build as it is.

A tool's lock (pipelines/tools/crate-check.lock: the RO-Crate validator of pipelines/crate.py) is resolved
from its .in file alone by uv (`uv pip compile --generate-hashes`): it is installed into a venv of its own,
on demand, never into .venv, whose pins it may contradict (the validator needs rich<14).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
HEADER = (
    "# The whole pinned environment (pip freeze), each package with the sha256 of every file PyPI serves for\n"
    "# its version: installs check them (pip install --require-hashes). torch is installed first, by the\n"
    "# Makefile: the CPU build where no NVIDIA GPU is present, the default (CUDA) build elsewhere; either\n"
    "# satisfies its pin here, so the hashed install keeps it. Regenerate: make lock (pipelines/lock.py)\n"
)


class LockError(Exception):
    """requirements.lock, or the environment it is made from, is not what this module can pin; one line."""


@dataclass(frozen=True)
class Pin:
    name: str  # as pip freeze spells it (pipelines/packages/*.txt copy the spelling)
    version: str
    hashes: tuple[str, ...] = ()  # "sha256:<hex>"

    def text(self) -> str:
        return " \\\n    ".join([f"{self.name}=={self.version}", *(f"--hash={h}" for h in self.hashes)])


def parse(text: str, where: str = "requirements.lock") -> list[Pin]:
    """The pins of a lock, a requirement's continuation lines (its hashes) joined to it."""
    pins = []
    for line in text.replace("\\\n", " ").splitlines():
        words = line.split("#", 1)[0].split()  # a comment, or none ("#" is in no pin or hash)
        if not words:
            continue
        name, equals, version = words[0].partition("==")
        hashes = tuple(w.removeprefix("--hash=") for w in words[1:])
        if not equals or not version or any(not w.startswith("--hash=sha256:") for w in words[1:]):
            raise LockError(f"{where}: `{line.strip()}` is not `name==version --hash=sha256:...`: run make lock")
        pins.append(Pin(name, version, hashes))
    return pins


def render(pins: list[Pin]) -> str:
    return HEADER + "".join(pin.text() + "\n" for pin in pins)


def frozen(python: str = sys.executable) -> list[Pin]:
    """The packages installed in `python`'s environment, this repository's editable install left out, each
    version without its local label (PyPI serves none: torch's 2.13.0+cpu is pinned as 2.13.0)."""
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout
    pins = []
    for line in out.splitlines():
        name, equals, version = line.partition("==")
        if not equals:
            raise LockError(f"pip freeze: `{line}` is no release on PyPI: install it from PyPI, or remove it")
        pins.append(Pin(name, re.sub(r"\+.*", "", version)))
    return sorted(pins, key=lambda p: f"{p.name}=={p.version}".lower())  # the order of pipelines/packages/*.txt


def hashed(pins: list[Pin]) -> list[Pin]:
    """`pins` with the sha256 of every file PyPI serves for each version, looked up by uv (no resolution:
    exactly these pins)."""
    with tempfile.TemporaryDirectory() as tmp:
        wanted = Path(tmp) / "pins.txt"
        wanted.write_text("".join(f"{p.name}=={p.version}\n" for p in pins))
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        cmd = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-deps", "--generate-hashes"]
        cmd += ["--no-header", "--no-annotate", "--python-version", python, str(wanted)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LockError(f"uv pip compile failed: {proc.stderr.strip()}")
    found = {canonicalize_name(p.name): p for p in parse(proc.stdout, "uv pip compile")}
    out = []
    for pin in pins:
        got = found.get(canonicalize_name(pin.name))
        if got is None or got.version != pin.version or not got.hashes:
            raise LockError(f"uv pip compile: no hashes for {pin.name}=={pin.version} (it gave {got})")
        out.append(Pin(pin.name, pin.version, got.hashes))
    return out


def tool_lock(infile: Path) -> Path:
    """Resolve a tool's requirements (`infile`, a .in file) by themselves, every pin with the sha256 of every
    file PyPI serves for it, into the .lock beside it; its comment lines head the lock."""
    out = infile.with_suffix(".lock")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--generate-hashes", "--no-header"]
    cmd += ["--no-annotate", "--python-version", python, str(infile)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LockError(f"uv pip compile {infile.name} failed: {proc.stderr.strip()}")
    comments = [line for line in infile.read_text().splitlines() if line.startswith("#")]
    header = "".join(f"{line}\n" for line in comments)
    out.write_text(f"{header}# Resolved by itself from {infile.name}: make lock (python -m pipelines.lock --tool)\n")
    with open(out, "a") as fh:
        fh.write(proc.stdout)
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["--tool"] and len(args) == 2:
            out = tool_lock(Path(args[1]).resolve())
            pins = parse(out.read_text(), out.name)
            print(
                f"lock: {out.relative_to(ROOT)}: {len(pins)} packages, {sum(len(p.hashes) for p in pins)} files' sha256"
            )
            return 0
        if args:
            print("usage: python -m pipelines.lock [--tool pipelines/tools/<name>.in]", file=sys.stderr)
            return 2
        pins = hashed(frozen())
    except LockError as e:
        print(f"lock: {e}", file=sys.stderr)
        return 2
    LOCK.write_text(render(pins))
    files = sum(len(p.hashes) for p in pins)
    print(f"lock: {LOCK.name}: {len(pins)} packages, {files} files' sha256")
    return 0


if __name__ == "__main__":
    sys.exit(main())
