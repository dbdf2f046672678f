"""`snakemake` for the system tests' SLURM cluster: the same command, with the SLURM executor plugin's
status checks at most STATUS_CHECK_S apart.

    python tests/system/snakemake_slurm.py --profile pipelines/profiles/slurm [snakemake arguments ...]

The plugin waits 10 s longer after every round of status checks that saw no job finish (40, 50, 60 s ...
up to 180 s; hard-coded, no option changes it): on a production cluster, whose jobs run for hours, that
spares its scheduler. The tests' jobs run for seconds, and each one's end was seen ~15 s late on average
(the two-node pipeline's 14 jobs, most waiting on the one before: about 2 of its 7 minutes). Only the
wait between two rounds changes here; submission, status and everything Snakemake does with them is
the plugin's own. tests/system/slurm.py: SNAKEMAKE.
"""

from __future__ import annotations

import sys

from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

STATUS_CHECK_S = 2

_interval = RemoteExecutor.__dict__["next_seconds_between_status_checks"]  # (a property; fails loudly if gone)


def _capped(executor, seconds) -> None:
    _interval.fset(executor, seconds if seconds is None else min(seconds, STATUS_CHECK_S))


RemoteExecutor.next_seconds_between_status_checks = property(_interval.fget, _capped)

if __name__ == "__main__":
    from snakemake.cli import main

    sys.argv[0] = "snakemake"
    sys.exit(main())
