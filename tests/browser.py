"""Headless Chromium over pages of the MLflow UI and of `dvc plots`: the DOM after the page's scripts ran,
its visible text, a screenshot. Tests that need it skip when it is not installed
(`bash tests/system/install.sh browser`)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(url: str, profile: Path, *extra: str, width: int = 1600, height: int = 1000) -> str:
    """The page's DOM after its scripts ran (or Chromium's output for a screenshot). The runs table
    draws only the columns within the window's width."""
    browser = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--virtual-time-budget=30000",
    ]
    return subprocess.run(
        [*browser, *(extra or ("--dump-dom",)), url], capture_output=True, text=True, timeout=300
    ).stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def answers(base: str) -> bool:
    """Whether the MLflow server at `base` answers its health check."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False
