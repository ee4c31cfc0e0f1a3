"""Models and datasets named by their Hugging Face Hub id, resolved through `huggingface_hub` into its cache.

`huggingface_hub` does the work: it downloads a repository once into the cache (`HF_HOME` / `HF_HUB_CACHE`), reads
a token from `HF_TOKEN` (or `huggingface-cli login`) for private and gated repositories, and with `HF_HUB_OFFLINE=1`
reads only the cache. What Miles adds is one error that names the spec's field, the id and the cache, in place of
the library's several exception types; a token never enters a message or a log.
"""

from __future__ import annotations

from pathlib import Path


class HubError(ValueError):
    """A Hub id that cannot be resolved; the message names the spec's field, the id and the cache."""


def hub_cache() -> Path:
    """The cache `huggingface_hub` reads and writes (it follows `HF_HOME` and `HF_HUB_CACHE`)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot(repo_id: str, field: str, repo_type: str = "model", revision: str | None = None) -> Path:
    """The local folder of `repo_id` at `revision` (None: the default branch), from the cache or downloaded into it.
    `field` (e.g. `model.name`) is what an error names."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{field}: {repo_type} {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision))
    except GatedRepoError:
        raise HubError(
            f"{what} is gated: accept its terms on the Hub, then set HF_TOKEN to a token that may read it"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} is not on the Hub, or is private (set HF_TOKEN to a token that may read it)") from None
    except RevisionNotFoundError:
        raise HubError(f"{what}: the Hub has no such revision") from None
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if offline()
            else "the Hub cannot be reached (no network here? set HF_HUB_OFFLINE=1 to use the cache only)"
        )
        raise HubError(
            f"{what} is not in the Hugging Face cache {hub_cache()} and {why}; download it where the Hub is "
            "reachable (`hf download ...`) into this cache, or point HF_HOME at a cache that holds it"
        ) from None
    except HfHubHTTPError as exc:  # the message holds the status and URL, never the token
        raise HubError(f"{what}: the Hub answered {exc}") from None
