"""Print CI's phase times (.ci/run writes them to REPORTS/phases.tsv) and, for each pytest phase, its
pytest time, its counts and its slowest tests (setup, call and teardown together) from its JUnit XML,
and the tests that used the most CPU (tests/conftest.py writes <report>.cpu.tsv); then the slowest shell
commands the tests ran, and why the shared ci run was made again, if it was.

    python3 .ci/summary.py REPORTS [--slowest N]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def pytest_figures(junit: Path, slowest: int) -> list[str]:
    if not junit.is_file():
        return ["    (no JUnit report: pytest did not finish)"]
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"    pytest {minutes(float(suite.get('time', 0)))}: {passed} passed, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped"
    ]
    cases = sorted(suite.iter("testcase"), key=lambda c: float(c.get("time", 0)), reverse=True)
    for case in cases[:slowest]:
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        lines.append(f"    {float(case.get('time', 0)):7.1f} s  {name}")
    cpu = Path(f"{junit}.cpu.tsv")  # tests/conftest.py: CPU seconds per test, its processes included
    if cpu.is_file():
        rows = [line.split("\t") for line in cpu.read_text().splitlines() if line.count("\t") == 1]
        total = sum(float(seconds) for seconds, _ in rows)
        lines.append(f"    CPU {minutes(total)} in all (tests and the processes they waited for); the most:")
        for seconds, test in sorted(rows, key=lambda x: -float(x[0]))[:slowest]:
            lines.append(f"    {float(seconds):7.1f} s  {test}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path)
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args(argv)
    rows = [line.split("\t") for line in (args.reports / "phases.tsv").read_text().splitlines() if line]
    for name, seconds, code, junit in rows:
        status = "ok" if code == "0" else f"FAILED (exit {code})"
        print(f"{name:<18} {minutes(float(seconds)):>13}  {status}")
        if junit != "-":
            print("\n".join(pytest_figures(Path(junit), args.slowest)))
    commands = args.reports / "commands.tsv"  # tests/shared_run.py: commands of the tests over 20 s
    if commands.is_file():
        print(f"slowest commands the tests ran ({commands}):")
        lines = [line.split("\t") for line in commands.read_text().splitlines() if line.count("\t") == 2]
        for seconds, test, cmd in sorted(lines, key=lambda x: -float(x[0]))[: args.slowest]:
            print(f"    {float(seconds):7.0f} s  {cmd}  ({test})")
    replaced = args.reports.parent / "ci-run" / "replaced.log"  # a shared ci run made again: why
    if replaced.is_file():
        print(f"the shared ci run was made again for a changed key ({replaced}):")
        print("\n".join("    " + line for line in replaced.read_text().splitlines()[:30]))


if __name__ == "__main__":
    main()
