"""The ci pipeline killed anywhere (tests/kill_fuzz.py): a few seeded kills of every process of a run,
through both tools, then a run to completion whose outputs, records and MLflow runs are those of the
uninterrupted run. `python tests/kill_fuzz.py --kills 50 --seed S` runs more."""

from __future__ import annotations

import pytest
from kill_fuzz import fuzz

KILLS = 3


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_the_pipeline_killed_anywhere_ends_as_the_uninterrupted_run(tmp_path, mirror):
    points = fuzz(tmp_path / "clone", kills=KILLS, seed=7, max_delay_s=60)
    assert len(points) == KILLS, "the pipeline finished before every kill"
