"""``hf://`` URLs: Hugging Face Hub repositories, fetched into the standard cache through cached-path.

``hf://ORG/NAME[@REVISION][/PATH]`` names a repository (at a branch, tag or commit; ``main``
by default), or a folder or one ``.safetensors`` file in it. :func:`fetch_hf` makes it local:

1. a ``PATH`` ending in ``.safetensors`` is fetched alone;
2. otherwise the folder's ``model.safetensors.index.json`` is fetched; a repository without one
   (or, offline, without one in the cache) is read from its ``model.safetensors``;
3. with an index, the shards it lists are fetched, only those holding a key ``wanted`` accepts
   (all of them when ``wanted`` is None);
4. the result is the snapshot folder (or file) in the cache, links into its ``blobs/``, which
   :class:`~checkpointer.tools.hf.HFSource` reads as a local Hugging Face directory.

cached-path hands ``hf://`` to ``huggingface_hub``, so the standard settings apply: ``HF_ENDPOINT``
(a mirror), ``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache is), ``HF_TOKEN`` (private repositories),
``HF_HUB_OFFLINE``. A file already in the cache is not downloaded again (one ``HEAD`` request
checks its revision).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.local import LocalStorage
from ..storage.redact import redact
from .hf import INDEX_NAME, SINGLE_NAME, read_hf_index, resolve

__all__ = ["is_hf_url", "parse_hf_url", "fetch_hf", "HFUrl", "NotInCacheError"]

HFUrl = tuple[str, str | None, str]
"""``(repo id, revision or None, path inside the repository or "")``."""


def is_hf_url(url: object) -> bool:
    """Whether ``url`` is an ``hf://`` URL."""
    return isinstance(url, str) and url[:5].lower() == "hf://"


def parse_hf_url(url: str) -> HFUrl:
    """``hf://ORG/NAME[@REVISION][/PATH]`` as ``(ORG/NAME, REVISION or None, PATH)``.

    Raises:
        ValueError: not of that form.
    """
    parts = url[5:].strip("/").split("/")
    if len(parts) < 2 or not parts[0] or not parts[1] or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{url!r} is not a Hugging Face URL of the form hf://ORG/NAME[@REVISION][/PATH]")
    name, _, revision = parts[1].partition("@")
    if not name or (_ and not revision):
        raise ValueError(f"{url!r}: empty repository name or revision (hf://ORG/NAME[@REVISION][/PATH])")
    # cached-path reads the revision up to the next "@" or "/": another would fetch something else
    if "@" in parts[0] or "@" in revision:
        raise ValueError(f"{url!r}: an organisation or revision holding '@' cannot be fetched through hf:// "
                         "(pass the commit hash, or a local snapshot's path)")
    if revision == "refs" and parts[2:3] in (["pr"], ["convert"]):
        raise ValueError(f"{url!r}: a revision holding '/' ({'/'.join(['refs', *parts[2:4]])}) cannot be fetched through "
                         "hf:// (pass its commit hash, or a local snapshot's path)")
    return f"{parts[0]}/{name}", revision or None, "/".join(parts[2:])


def fetch_hf(url: str, wanted: Callable[[str], bool] | None = None) -> str:
    """The local path (a snapshot folder or file in the cache) of the Hugging Face checkpoint at
    ``url``, its files fetched as the module docstring says.

    Args:
        url: ``hf://ORG/NAME[@REVISION][/PATH]``.
        wanted: which checkpoint keys are needed; shards holding none of them are not fetched.

    Raises:
        FileNotFoundError: no such repository, revision or file (naming the URL).
        CorruptCheckpointError: the index lists a shard the repository does not hold.
        NotInCacheError: offline, and a file is not in the cache (naming the URL).
        OSError: the hub could not be reached, naming the URL.
    """
    repo, revision, path = parse_hf_url(url)
    base = f"hf://{repo}" + (f"@{revision}" if revision else "")
    if path.lower().endswith(".safetensors"):
        return _cached(f"{base}/{path}", url)
    folder = f"{base}/{path}" if path else base
    try:
        index_path = _cached(f"{folder}/{INDEX_NAME}", url, missing_ok=True)
    except NotInCacheError as offline:  # a repository without an index has only its model.safetensors cached
        try:
            return os.path.dirname(_cached(f"{folder}/{SINGLE_NAME}", url))
        except NotInCacheError:
            raise NotInCacheError(f"{url}: neither {INDEX_NAME} nor {SINGLE_NAME} is in the local cache, and the Hugging "
                             "Face hub cannot be reached (offline, or HF_HUB_OFFLINE set)") from offline
    if index_path is None:
        return os.path.dirname(_cached(f"{folder}/{SINGLE_NAME}", url, missing=f"neither {INDEX_NAME} nor {SINGLE_NAME}"))
    snapshot = os.path.dirname(index_path)
    index = read_hf_index(*resolve(LocalStorage(snapshot), INDEX_NAME), where=f"{folder}/{INDEX_NAME}")
    for name, keys in index.items():
        if wanted is None or any(wanted(k) for k in keys):
            try:
                _cached(f"{folder}/{name}", url)
            except FileNotFoundError as ex:
                raise CorruptCheckpointError(
                    f"{url}: {INDEX_NAME} lists the shard {name}, which the repository does not hold"
                ) from ex
    return snapshot


class NotInCacheError(OSError):
    """The Hugging Face hub cannot be reached (offline, or ``HF_HUB_OFFLINE`` set), and a file
    is not in the local cache."""


def _said(ex: BaseException) -> str:
    """What the hub's error (or the one it wraps) says, first line, credentials redacted: a
    download is redirected to a signed URL, which the hub's messages quote."""
    inner = ex.__cause__ or ex
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {redact(lines[0]) if lines else ''}"


def _cached(file_url: str, url: str, *, missing_ok: bool = False, missing: str | None = None) -> str | None:
    """``cached_path(file_url)`` as a str; the hub's errors as builtin ones naming ``url``. Their
    chains are not kept (``from None``): the hub's errors quote signed download URLs."""
    from cached_path import cached_path
    from huggingface_hub import errors as hub_errors

    try:
        return str(cached_path(file_url, quiet=True))
    except hub_errors.LocalEntryNotFoundError as ex:  # offline: not a missing file, an unreachable hub
        raise NotInCacheError(f"{url}: {file_url} is not in the local cache, and the Hugging Face hub cannot be "
                              f"reached (offline, or HF_HUB_OFFLINE set; {_said(ex)})") from None
    except (hub_errors.EntryNotFoundError, hub_errors.RevisionNotFoundError,
            hub_errors.RepositoryNotFoundError) as ex:
        if missing_ok and isinstance(ex, hub_errors.EntryNotFoundError):
            return None
        what = f"{missing} found" if missing else f"{file_url} not found"
        raise FileNotFoundError(f"{url}: no Hugging Face checkpoint there ({what}: {type(ex).__name__})") from None
    except (hub_errors.HfHubHTTPError, OSError) as ex:
        if isinstance(ex, FileNotFoundError) and missing_ok:
            return None
        raise OSError(f"{url}: cannot fetch {file_url} from the Hugging Face hub ({_said(ex)})") from None
    except (ValueError, CheckpointError) as ex:
        raise OSError(f"{url}: cannot fetch {file_url} from the Hugging Face hub ({_said(ex)})") from None
