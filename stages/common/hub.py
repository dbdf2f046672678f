"""A base model from the Hugging Face hub at a pinned revision, or from a local Hugging Face folder: where
its files are on this machine and which commit they are, each refusal one line naming the cause and the fix.

The hub's files are read through huggingface_hub's cache (HF_HOME; HF_HUB_OFFLINE=1 reads the cache only),
so a model fetched once is not fetched again, and a cluster node without network reads what a login node
fetched. Only what a stage loads is fetched: the config, the tokenizer and safetensors weights (pickled
weights, which can run code when loaded, and the `original/` checkpoints some repositories carry, never)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from stages.common import hf_folder
from stages.common.config import UserError

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
COMMIT = re.compile(r"[0-9a-f]{40}")
# What a stage loads of a model repository: config, generation config, tokenizer, safetensors weights.
FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class Base:
    name: str  # the hub id (org/name), or the folder as given
    folder: Path  # where its files are on this machine
    revision: str | None = None  # as asked for (a commit, branch or tag); None for a folder
    commit: str | None = None  # the commit the files are of; None for a folder

    def record(self) -> dict:
        """What a stage records of where its base came from (meta.json, MLflow tags, the registry)."""
        if self.commit is None:
            return {"base_model": self.name}
        return {"base_model": self.name, "base_revision": self.revision, "base_commit": self.commit}


def is_hub_id(name: str) -> bool:
    """org/name that is not a folder here."""
    return bool(HUB_ID.fullmatch(name)) and not Path(name).exists()


def check_folder(folder: Path, where: str) -> None:
    """A Hugging Face model folder a stage can load: config.json, safetensors weights, a tokenizer."""
    hf_folder.check(folder, f"{where}: {folder}", "give a Hugging Face model folder or a hub id (org/name)")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise UserError(f"{where}: {folder} has no tokenizer (tokenizer.json); save the model's tokenizer beside it")


def resolve(name: str, revision: str, where: str) -> Base:
    """The base `name` (a hub id or a folder) at `revision`, its files on this machine; fetched from the hub
    into its cache when they are not there yet. A hub id needs a revision: a commit hash pins it; a branch
    or tag is resolved to the commit it points at now, and that commit is what the stage records."""
    if not name:
        raise UserError(f"{where}: no model named; set it to a hub id (org/name) or a Hugging Face model folder")
    if not is_hub_id(name):
        folder = Path(name)
        if not folder.is_dir():
            raise UserError(f"{where}: {name} is neither a folder here nor a hub id (org/name)")
        check_folder(folder, where)
        return Base(name=name, folder=folder)
    if not revision:
        raise UserError(
            f"{where}: {name} is a hub model without a revision; pin one (a commit hash from "
            f"https://huggingface.co/{name}/commits/main, or a branch or tag, resolved and recorded)"
        )
    folder = fetch(name, revision, where)
    commit = folder.name  # huggingface_hub keeps each commit's files in snapshots/<commit>/
    if not COMMIT.fullmatch(commit):
        raise UserError(f"{where}: {name}@{revision}: the hub cache gave {folder}, not a commit's snapshot")
    check_folder(folder, where)
    return Base(name=name, folder=folder, revision=revision, commit=commit)


def fetch(name: str, revision: str, where: str) -> Path:
    """The snapshot folder of `name` at `revision` in the hub cache, fetched if need be."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    at = f"{where}: {name}@{revision}"
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=list(FILES)))
    except hub_errors.GatedRepoError:
        raise UserError(
            f"{at}: the model is gated; accept its license at https://huggingface.co/{name} and log in "
            f"(hf auth login, or HF_TOKEN) on this machine"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise UserError(
            f"{at}: no such model on the hub (or a private one: log in with hf auth login); check the id"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise UserError(
            f"{at}: the model has no revision {revision!r}; give a commit hash, branch or tag it has"
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        raise UserError(
            f"{at}: not in the hub cache ({cache_dir()}) and the hub cannot be reached (HF_HUB_OFFLINE, or no "
            f"network); fetch it once where the hub is reachable: hf download {name} --revision {revision}"
        ) from None
    except hub_errors.HfHubHTTPError as e:
        raise UserError(f"{at}: the hub answered {str(e).splitlines()[0]}; try again, or check the id") from None


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
