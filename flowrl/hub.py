"""A hub id that cannot be fetched gets one sentence within seconds.

Loading a hub id that is not in the local cache on a machine without the hub makes the hub client
retry for about 30 seconds, printing a line per retry, before diffusers or transformers raise. So
before loading, a hub id that the cache lacks is asked for once, with a short timeout: no network,
no such repository and a gated one each get their own sentence."""

from __future__ import annotations

from flowrl.errors import UserError

HUB_TIMEOUT_SECONDS = 5.0


def check_hub_id(repo_id: str, index_file: str, field: str = "model.path", timeout: float = HUB_TIMEOUT_SECONDS) -> None:
    """Return when `repo_id` can be loaded: its `index_file` (model_index.json, config.json) is in
    the local cache, or the hub answers for it; else one UserError sentence naming `field`."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, index_file), str):
        return  # cached: the loader finds it (HF_HUB_OFFLINE=1 keeps it from asking the hub for updates)
    where = f"{field} '{repo_id}' is a hub id that is not in the local cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{where}, and HF_HUB_OFFLINE is set; download it on a machine with the hub, or give a local directory")
    try:
        HfApi().model_info(repo_id, timeout=timeout)
    except GatedRepoError:
        raise UserError(f"{field} '{repo_id}' is a gated model: accept its licence on its hub page and log in "
                        "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{field} '{repo_id}' names no model on the hub (or a private one this login cannot see); check the id, "
                        "or give a local directory") from None
    except HfHubHTTPError:
        return  # the hub answered with another error: the loader's own message says more
    except Exception as exc:  # noqa: BLE001 - no answer at all: no network, no name resolution, a timeout
        raise UserError(f"{where}, and the hub cannot be reached ({type(exc).__name__}); on a machine without it set "
                        "HF_HUB_OFFLINE=1 and use the cache, or give a local directory") from None
