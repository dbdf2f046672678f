"""Known raw inputs: where each file lives in a local mirror, where it is published, and its sha256.

A mirror (`PIPELINE_DATA_MIRROR`) is a directory laid out like the `mirror` paths below; `python -m
pipelines.mirror DIR` builds one from the public sources. Every source is pinned: a URL at a git commit
(GitHub, the Hugging Face hub) or a versioned release. A file found in a mirror, downloaded from `url` or
taken out of its `archive` is used only when its sha256 matches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Archive:
    """A published zip file or tarball that holds raw files (`RawFile.member`)."""

    url: str
    sha256: str
    size: int

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RawFile:
    mirror: str  # path inside a mirror directory
    url: str | None  # canonical public location of the file itself (None: inside `archive`)
    sha256: str
    size: int
    archive: Archive | None = None  # the published archive that holds it, at `member`
    member: str | None = None


_CHAR_RNN = "https://raw.githubusercontent.com/karpathy/char-rnn/6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e"
_PLANETOID = "https://raw.githubusercontent.com/kimiyoung/planetoid/af6abf468a772cc055bec88c52e4d6f51b7c37e3"

TINYSHAKESPEARE = RawFile(
    "tinyshakespeare/input.txt",
    f"{_CHAR_RNN}/data/tinyshakespeare/input.txt",
    "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    1115394,
)

# WikiText-2 raw (Merity et al. 2016), the files of the `wikitext-2-raw-v1` release: its zip as the
# ggml-org/ci dataset on the Hugging Face hub keeps it (the file llama.cpp's scripts/get-wikitext-2.sh fetches).
WIKITEXT2_ZIP = Archive(
    "https://huggingface.co/datasets/ggml-org/ci/resolve/927b3642933080f1b0e811e2f916e14c292992f9/"
    "wikitext-2-raw-v1.zip",
    "ef7edb566e3e2b2d31b29c1fdb0c89a4cc683597484c3dc2517919c615435a11",
    4721645,
)
WIKITEXT2 = {
    split: RawFile(f"wikitext-2-raw/{name}", None, sha, size, WIKITEXT2_ZIP, f"wikitext-2-raw/{name}")
    for split, name, sha, size in [
        ("train", "wiki.train.raw", "6707892fa3788b5ab9ed78ab5ff37d9fe825f6011a2ad4fcd6a6d467f0e7da57", 10940747),
        ("val", "wiki.valid.raw", "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7", 1146846),
        ("test", "wiki.test.raw", "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08", 1290590),
    ]
}
WIKITEXT2_HUB = ("wikitext", "wikitext-2-raw-v1")

# Stanford Alpaca, a fixed 5,000-record subset (CC BY-NC 4.0) published in zjunlp/EasyInstruct; the full
# set comes from the hub.
ALPACA_5K = RawFile(
    "alpaca-5k/alpaca_data_5k.jsonl",
    "https://raw.githubusercontent.com/zjunlp/EasyInstruct/e130e29706ce232c2985c920ae6656b4eca2c664/data/alpaca_data_5k.jsonl",
    "f0c5a51b4ed46c768c2eb617d29598bfe28dc4f4604dbbb5039016b7ae69aa39",
    2039290,
)
ALPACA_HUB = "tatsu-lab/alpaca"

_PLANETOID_SUMS = {
    "Cora": {
        "x": ("23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab", 22119),
        "tx": ("b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a", 148025),
        "allx": ("9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543", 257305),
        "y": ("94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1", 4054),
        "ty": ("41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad", 28135),
        "ally": ("2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71", 47959),
        "graph": ("58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d", 59847),
        "test.index": ("297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875", 5000),
    },
    "CiteSeer": {
        "x": ("d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6", 31087),
        "tx": ("539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21", 260321),
        "allx": ("2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668", 595021),
        "y": ("8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924", 3014),
        "ty": ("55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce", 24135),
        "ally": ("f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95", 55623),
        "graph": ("d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7", 61987),
        "test.index": ("2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4", 5000),
    },
    "PubMed": {
        "x": ("fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33", 23172),
        "tx": ("4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d", 405505),
        "allx": ("508e538e2abdccdd54c4d3e9f49d638b4af7107d85845f66ddea5a5152658b7e", 7578385),
        "y": ("e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3", 854),
        "ty": ("ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd", 12135),
        "ally": ("0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e", 224739),
        "graph": ("5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9", 471808),
        "test.index": ("b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5", 6000),
    },
}


def planetoid_files(name: str) -> dict[str, RawFile]:
    """Raw files of a Planetoid graph, keyed by the file name PyG's `Planetoid` reads."""
    low = name.lower()
    return {
        f"ind.{low}.{part}": RawFile(
            f"planetoid/{name}/raw/ind.{low}.{part}", f"{_PLANETOID}/data/ind.{low}.{part}", sha, size
        )
        for part, (sha, size) in _PLANETOID_SUMS[name].items()
    }


PLANETOID_NAMES = tuple(_PLANETOID_SUMS)


def all_files() -> tuple[RawFile, ...]:
    """Every known raw file: what a complete mirror holds."""
    graphs = [raw for name in PLANETOID_NAMES for raw in planetoid_files(name).values()]
    return (TINYSHAKESPEARE, *WIKITEXT2.values(), ALPACA_5K, *graphs)
