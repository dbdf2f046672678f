"""Share a repository's results through its DVC remote, so that other machines reuse them.

    python -m pipelines.share push [--remote NAME] [--jobs N]      (make push)

pushes three things: the outs of dvc.lock (`dvc push`), DVC's run cache (`dvc push --run-cache`: one
entry per stage run, keyed by its command, deps and params), and every object a run-cache entry names
that those two leave behind. `dvc push` sends only the cached outs of dvc.lock, and `--run-cache` only the
entries, not the outputs they name: the files under measured/ (outs DVC records but does not cache; git
holds them) and the outputs of runs that dvc.lock no longer points to (an experiment, earlier params). A
clone elsewhere whose `dvc repro --pull` finds a stage's entry then finds its outputs too, and checks them
out instead of running the stage; without them it runs it again.

    python -m pipelines.share pull [--remote NAME] [--jobs N]      (make pull)

is `dvc pull`, then every pulled out hashed from its bytes against dvc.lock (pipelines.verify: DVC itself
trusts its cache, and checks out a damaged object as it is). What differs is mended once: a damaged object
of DVC's cache is removed and fetched again from the remote, a file that differs from an intact object is
checked out again; what still differs is named, with exit code 1. `dvc repro --pull` fetches the run cache
and what a stage's entry names when it needs them.
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


def pull(root: Path, remote: str | None = None, jobs: int | None = None) -> dict[str, list]:
    """`dvc pull`, then each out checked against dvc.lock from its bytes and mended once (see the module's
    doc); what still differs, as pipelines.verify.differing_outs."""
    import os

    from dvc.repo import Repo

    from pipelines import verify
    from pipelines.dag import parse_yaml

    os.chdir(root)  # (DVC resolves its paths from the working directory)
    with Repo(str(root)) as repo:
        repo.pull(remote=remote, jobs=jobs)
    lock = parse_yaml((root / "dvc.lock").read_text()) or {}
    differ = verify.differing_outs(root, lock)
    if not differ:
        return differ
    for files in differ.values():
        for name, _, damaged in files:
            if damaged is not None:
                print(f"share: {name}: DVC's cache object {damaged} is damaged; fetching it again", file=sys.stderr)
                damaged.unlink(missing_ok=True)
            else:
                print(f"share: {name} is not what dvc.lock records; checking it out again", file=sys.stderr)
    with Repo(str(root)) as repo:
        repo.fetch(targets=sorted(differ), remote=remote, jobs=jobs)
        repo.checkout(targets=sorted(differ), force=True, relink=True)
    return verify.differing_outs(root, lock)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.share", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("push", help="the outs of dvc.lock, the run cache, and what its entries name")
    p.add_argument("--remote", "-r", help="a remote's name (default: the default remote)")
    p.add_argument("--jobs", "-j", type=int, help="parallel transfers (DVC's default: 4 x cores)")
    p.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    p = sub.add_parser("pull", help="dvc pull, then every out checked from its bytes and mended")
    p.add_argument("--remote", "-r", help="a remote's name (default: the default remote)")
    p.add_argument("--jobs", "-j", type=int, help="parallel transfers (DVC's default: 4 x cores)")
    p.add_argument("--root", type=Path, default=Path("."), help="the repository (default: here)")
    args = parser.parse_args(argv)
    from dvc.config import NoRemoteError
    from dvc.exceptions import DvcException

    try:
        if args.command == "pull":
            differ = pull(args.root.resolve(), args.remote, args.jobs)
        else:
            counts = push(args.root.resolve(), args.remote, args.jobs)
    except NoRemoteError:
        print(f"share: this repository has no default DVC remote; {REMOTE_HELP}", file=sys.stderr)
        return 1
    except DvcException as e:
        print(f"share: {e}", file=sys.stderr)
        return 1
    if args.command == "pull":
        for name, want, _ in (f for files in differ.values() for f in files):
            what = "is missing" if want is None else f"is not what dvc.lock records (md5 {want})"
            print(f"share: {name} {what} after pulling it again; `dvc repro -f` its stage", file=sys.stderr)
        if differ:
            return 1
        print("pulled: every out is what dvc.lock records (hashed from its bytes)")
        return 0
    print("pushed: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
