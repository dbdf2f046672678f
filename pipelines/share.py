"""Share a repository's results through its DVC remote, so that other machines reuse them.

    python -m pipelines.share push [--remote NAME] [--jobs N]      (make push)

pushes three things: the outs of dvc.lock (`dvc push`), DVC's run cache (`dvc push --run-cache`: one
entry per stage run, keyed by its command, deps and params), and every object a run-cache entry names
that those two leave behind. `dvc push` sends only the cached outs of dvc.lock, and `--run-cache` only the
entries, not the outputs they name: the files under measured/ (outs DVC records but does not cache; git
holds them) and the outputs of runs that dvc.lock no longer points to (an experiment, earlier params). A
clone elsewhere whose `dvc repro --pull` finds a stage's entry then finds its outputs too, and checks them
out instead of running the stage; without them it runs it again.

Elsewhere, nothing of this project is needed: `dvc pull` fetches the outs of the checked-out dvc.lock, and
`dvc repro --pull` fetches the run cache and what a stage's entry names when it needs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REMOTE_HELP = (
    "add one: dvc remote add -d store /shared/path/dvc-store (a folder every machine mounts) or "
    "ssh://host/path/dvc-store (needs dvc-ssh), then commit .dvc/config"
)


def push(root: Path, remote: str | None = None, jobs: int | None = None) -> dict[str, int]:
    """Push the outs of dvc.lock, the run cache and what its entries name; the counts of each pushed."""
    import os

    from dvc.repo import Repo

    os.chdir(root)  # (DVC resolves its paths from the working directory)
    with Repo(str(root)) as repo:
        outs = repo.push(remote=remote, jobs=jobs)
        entries = repo.stage_cache.push(remote)  # every entry (DVC overwrites them on each push)
        named = repo.stage_cache.get_used_objs(entries)
        objects = set().union(*named.values()) if named else set()
        result = repo.cloud.push(objects, jobs=jobs, remote=remote)
        if result.failed:
            missing = ", ".join(sorted(h.obj_name or h.value for h in result.failed)[:5])
            print(
                f"share: {len(result.failed)} object(s) the run cache names are not in this cache ({missing}); "
                f"those stage runs are not restorable elsewhere (dvc gc removed their outputs)",
                file=sys.stderr,
            )
    return {"outs": outs, "run-cache entries": len(entries), "objects they name": len(result.transferred)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.share", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("push", help="the outs of dvc.lock, the run cache, and what its entries name")
    p.add_argument("--remote", "-r", help="a remote's name (default: the default remote)")
    p.add_argument("--jobs", "-j", type=int, help="parallel transfers (DVC's default: 4 x cores)")
    p.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    args = parser.parse_args(argv)
    from dvc.config import NoRemoteError
    from dvc.exceptions import DvcException

    try:
        counts = push(args.root.resolve(), args.remote, args.jobs)
    except NoRemoteError:
        print(f"share: this repository has no default DVC remote; {REMOTE_HELP}", file=sys.stderr)
        return 1
    except DvcException as e:
        print(f"share: {e}", file=sys.stderr)
        return 1
    print("pushed: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
