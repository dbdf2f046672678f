"""The HTML page of a pipeline run (pipelines/html_report.py), made from a real ci run's reports/results.json:
the results table holds every reproduced row, every stage has its metrics table, and every PNG plot is
embedded byte for byte. Chromium renders it to tests/system/artifacts/report.png when installed."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from workspace import ROOT, local_run, sh

# local_run: the ci run shared with make test (tests/shared_run.py), made by whichever test asks first.
pytestmark = [pytest.mark.system, pytest.mark.timeout(1800)]


class Tables(HTMLParser):
    """Tables (lists of rows of cell texts) and img sources of a page."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell.strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_html_report_of_a_pipeline_run(tmp_path_factory, mirror):
    run = local_run()
    out = tmp_path_factory.mktemp("html") / "report.html"
    sh(f"python -m pipelines.html_report --output {out}", run)
    results = json.loads((run / "reports/results.json").read_text())
    page = Tables()
    page.feed(out.read_text())

    header, *rows = page.tables[0]
    assert header == results["row_fields"]
    assert len(rows) == len(results["rows"]) >= 2
    for row, expected in zip(rows, results["rows"], strict=True):
        assert row[0] == expected["result"] and float(row[header.index("ours")]) == pytest.approx(
            expected["ours"], rel=1e-3
        )
        assert row[header.index("pass")] == ("PASS" if expected["pass"] else "FAIL")
    # then what the stages measured (measured/report.json): its rows, then each stage's figures
    measured = json.loads((run / results["measured"]).read_text())
    assert measured["rows"] and measured["stages"]
    # (and last, where each stage's wall time went: measured/time/, pipelines.timebudget)
    assert len(page.tables) == 1 + len(results["stage_metrics"]) + 1 + len(measured["stages"]) + 1
    header, *rows = page.tables[-1]
    assert header[0] == "stage" and "pretrain" in [r[0] for r in rows] and rows[-1][0] == "share"
    pretrain = page.tables[1 + list(results["stage_metrics"]).index("pretrain")]
    assert dict(pretrain[1:])["final_val_loss"] and "tokens_per_s" not in dict(pretrain[1:])
    header, *rows = page.tables[1 + len(results["stage_metrics"])]
    assert header == measured["row_fields"] and [r[0] for r in rows] == [r["result"] for r in measured["rows"]]
    speed = page.tables[2 + len(results["stage_metrics"]) + list(measured["stages"]).index("pretrain")]
    assert float(dict(speed[1:])["tokens_per_s"]) > 0

    pngs = [p for p in results["plots"] + measured["plots"] if p.endswith(".png")]
    assert len(page.images) == len(pngs) >= 3
    for src, plot in zip(page.images, pngs, strict=True):
        data = re.fullmatch(r"data:image/png;base64,(.+)", src).group(1)
        assert base64.b64decode(data) == (run / plot).read_bytes()

    browser = shutil.which("chromium")
    if browser:
        shot = ROOT / "tests/system/artifacts/report.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={out.parent / 'chromium'}",
                "--window-size=1400,2400",
                f"--screenshot={shot}",
                out.as_uri(),
            ],
            capture_output=True,
            timeout=300,
        )
        assert shot.is_file() and shot.stat().st_size > 10_000
