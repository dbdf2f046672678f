"""rocrate-validator, offline, with the JSON-LD contexts shipped in pipelines/crate_contexts/:

    <venv>/bin/python pipelines/tools/crate_check.py CACHE URL=FILE ... -- <rocrate-validator arguments>

Run by `python -m pipelines.crate check` with the validator's own venv (.cache/crate-check/venv: its
packages are not the project's). Two things around the validator's own command line:
  - each URL=FILE is stored in its HTTP cache (requests-cache, SQLite, at CACHE: give it `--offline
    --cache-path CACHE`) as if fetched, so resolving the crate's contexts needs no network;
  - its JSON report writes the crate's address (a `URI` object, which 0.13.0's JSON encoder rejects:
    "Object of type URI is not JSON serializable") as text.
"""

import io
import sys
from pathlib import Path

import requests
from requests_cache import CachedSession
from urllib3 import HTTPResponse


def seed(cache: str, pairs: list[str]) -> None:
    session = CachedSession(cache_name=cache, backend="sqlite", expire_after=-1, allowable_codes=(200, 302, 404))
    for pair in pairs:
        url, _, path = pair.partition("=")
        body, headers = Path(path).read_bytes(), {"Content-Type": "application/ld+json"}
        response = requests.Response()
        response.status_code, response.reason, response.url, response.encoding = 200, "OK", url, "utf-8"
        response.headers.update(headers)
        response._content = body
        response.raw = HTTPResponse(io.BytesIO(body), headers, 200, preload_content=False, request_url=url)
        response.request = requests.Request("GET", url).prepare()
        session.cache.save_response(response)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    seed(argv[0], argv[1:split])
    from rocrate_validator.cli import cli
    from rocrate_validator.models import result
    from rocrate_validator.utils.uri import URI

    encode = result.CustomEncoder.default
    result.CustomEncoder.default = lambda self, o: str(o) if isinstance(o, URI) else encode(self, o)
    sys.argv = ["rocrate-validator", *argv[split + 1 :]]
    return cli()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
