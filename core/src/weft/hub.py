"""Hugging Face Hub repo ids as model folders: found in the local cache, downloaded with ``huggingface_hub`` when
missing.

``org/name`` (optionally ``org/name@revision``, or ``engine.revision``) resolves to the cache's
``models--org--name/snapshots/<commit>`` folder. What is downloaded is what a model needs: its
config, generation config and tokenizer files, and the safetensors shards its
``model.safetensors.index.json`` names (every top-level ``*.safetensors`` when there is no index):
never the whole repo (original checkpoints, GGUF files, ``*.bin`` twins stay on the Hub).

Rules, as Hugging Face's own libraries follow them:

* the cache is ``engine.download_dir``, else ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``; ``HF_ENDPOINT`` names the Hub, ``HF_TOKEN`` authenticates;
* ``HF_HUB_OFFLINE=1``: only the cache; a miss is an error naming the repo and the revision, raised
  before any network attempt;
* a 40-hex commit resolves to ``snapshots/<commit>`` with no ``refs/`` file, and a complete snapshot
  of a commit is used without asking the Hub (a commit never changes); a branch or tag asks the Hub
  for its current commit, and falls back to the cached snapshot (with a warning) when the Hub cannot
  be reached;
* concurrent starts on one machine share a download: ``huggingface_hub`` takes a file lock per
  file, and the second process finds the file the first one wrote;
* progress bars on a terminal, one log line per file otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("weft.hub")

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
INDEX_FILE = "model.safetensors.index.json"
METADATA_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|tokenizer\.model"
    r"|special_tokens_map\.json|added_tokens\.json|vocab\.json|vocab\.txt|merges\.txt|chat_template\.jinja"
    r"|chat_template\.json|preprocessor_config\.json|" + re.escape(INDEX_FILE) + r")$"
)
"""Files a model needs beside its weights (top level only)."""

_TRUE = {"1", "ON", "YES", "TRUE"}


def is_repo_id(source: str) -> bool:
    """Whether ``source`` has the shape of ``org/name[@revision]`` and names nothing on the local disk."""
    if not REPO_ID.match(source) or source.startswith((".", "/", "~")):
        return False
    try:
        return not Path(source).exists()
    except OSError:
        return False


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as Hugging Face reads it (read at each call, so a process may change it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_cache(download_dir: str | None = None) -> Path:
    """Where repos are cached: ``download_dir``, else ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def split_revision(source: str, revision: str | None = None) -> tuple[str, str]:
    """``(repo, revision)`` of ``org/name[@revision]``; ``revision`` (``engine.revision``) must agree with an ``@``."""
    repo, _, pinned = source.partition("@")
    if pinned and revision and pinned != revision:
        raise ValueError(
            f"model = {source!r} pins revision {pinned!r} but engine.revision = {revision!r}; keep one of them"
        )
    return repo, pinned or revision or "main"


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors shards of a model folder: those its index names, else every ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


def cached_snapshot(repo: str, revision: str, cache: Path) -> Path | None:
    """The cached snapshot folder of ``repo`` at ``revision`` holding a config and every weight file, or None."""
    root = repo_folder(cache, repo)
    if COMMIT.match(revision):
        commit = revision
    else:
        ref = root / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = root / "snapshots" / commit
    if not (snapshot / "config.json").is_file():
        return None
    try:
        shards = weight_files(snapshot)
    except (OSError, ValueError, KeyError):
        return None
    return snapshot if shards and all(shard.is_file() for shard in shards) else None


def needed_files(repo_files: list[str], read_index: Any) -> list[str]:
    """The files of a repo a model needs: metadata and tokenizer files, then the weight shards.

    ``read_index()`` returns the parsed ``model.safetensors.index.json`` (called only when the repo has one).
    """
    metadata = sorted(name for name in repo_files if METADATA_FILES.match(name))
    if INDEX_FILE in repo_files:
        shards = sorted(set(read_index()["weight_map"].values()))
        missing = sorted(set(shards) - set(repo_files))
        if missing:
            raise ValueError(f"{INDEX_FILE} names shards the repo does not have: {', '.join(missing)}")
    else:
        shards = sorted(name for name in repo_files if name.endswith(".safetensors") and "/" not in name)
    return [name for name in metadata if name != INDEX_FILE] + shards


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def _progress_class() -> Any:
    from tqdm.auto import tqdm

    class TerminalProgress(tqdm):  # type: ignore[misc]
        """Hugging Face's progress bars, on a terminal only (a log or a pipe gets one line per file)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = bool(kwargs.get("disable")) or not sys.stderr.isatty()
            super().__init__(*args, **kwargs)

    return TerminalProgress


def _explain(error: Exception, repo: str, revision: str) -> ValueError:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"Hugging Face repo {repo!r} at revision {revision!r} ({endpoint()})"
    if isinstance(error, GatedRepoError):
        fix = "it is gated: accept its terms on the Hub and set HF_TOKEN to a token of that account"
    elif isinstance(error, RepositoryNotFoundError):
        fix = "no such repo, or it is private: check the name, or set HF_TOKEN to a token that may read it"
    elif isinstance(error, RevisionNotFoundError):
        fix = "no such branch, tag or commit in the repo: check the revision"
    else:
        fix = (
            "the Hub could not be reached; check HF_ENDPOINT and the network, or set HF_HUB_OFFLINE=1 to use the "
            "cache only"
        )
    return ValueError(f"{where}: {fix} ({type(error).__name__}: {error})")


def download(repo: str, revision: str, cache: Path) -> Path:
    """Download what the model at ``repo@revision`` needs into ``cache``; return its snapshot folder."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    hub, token = endpoint(), os.environ.get("HF_TOKEN") or None
    info = HfApi(endpoint=hub, token=token).model_info(repo, revision=revision)
    commit = info.sha
    if not commit or not COMMIT.match(commit):
        raise ValueError(f"Hugging Face repo {repo!r} at revision {revision!r}: the Hub gave no commit ({hub})")

    def fetch(filename: str) -> Path:
        try:
            path = hf_hub_download(
                repo,
                filename,
                revision=commit,
                cache_dir=str(cache),
                endpoint=hub,
                token=token,
                tqdm_class=_progress_class(),
            )
        except HfHubHTTPError as error:
            raise _explain(error, repo, revision) from error
        if not sys.stderr.isatty():
            logger.info("%s@%s: %s ready", repo, commit[:12], filename)
        return Path(path)

    repo_files = [sibling.rfilename for sibling in info.siblings or []]
    files = needed_files(repo_files, lambda: json.loads(fetch(INDEX_FILE).read_text()))
    if "config.json" not in files:
        raise ValueError(f"Hugging Face repo {repo!r} at revision {revision!r} has no config.json ({hub})")
    if not any(name.endswith(".safetensors") for name in files):
        raise ValueError(
            f"Hugging Face repo {repo!r} at revision {revision!r} has no safetensors weights ({hub}); "
            f"its files: {', '.join(sorted(repo_files)) or 'none'}"
        )
    for filename in files:
        fetch(filename)
    if revision != commit:
        ref = repo_folder(cache, repo) / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        temporary = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        temporary.write_text(commit)
        temporary.replace(ref)
    return repo_folder(cache, repo) / "snapshots" / commit


def snapshot(source: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local folder of the repo id ``source`` (``org/name[@revision]``), downloading what is missing."""
    from huggingface_hub.errors import HfHubHTTPError

    repo, revision = split_revision(source, revision)
    cache = hub_cache(download_dir)
    cached = cached_snapshot(repo, revision, cache)
    if offline():
        if cached is None:
            raise ValueError(
                f"Hugging Face repo {repo!r} at revision {revision!r} is not in the local cache ({cache}) and "
                f"HF_HUB_OFFLINE is set, so nothing is downloaded; download it first (unset HF_HUB_OFFLINE, or "
                f"huggingface-cli download {repo} --revision {revision}) or point HF_HUB_CACHE / engine.download_dir "
                f"at the cache that holds it"
            )
        return cached
    if cached is not None and COMMIT.match(revision):
        return cached
    try:
        return download(repo, revision, cache)
    except HfHubHTTPError as error:  # the Hub answered no: the cache must not hide that
        raise _explain(error, repo, revision) from error
    except Exception as error:
        if not _unreachable(error):
            raise
        if cached is None:
            raise _explain(error, repo, revision) from error
        logger.warning("%s; using the cached snapshot %s", _explain(error, repo, revision), cached.name)
        return cached


def _unreachable(error: Exception) -> bool:
    """A connection that failed (refused, DNS, timeout), as opposed to an answer from the Hub."""
    return isinstance(error, OSError) or type(error).__module__.split(".")[0] in ("httpx", "httpcore", "httpx2")
