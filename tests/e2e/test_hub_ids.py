"""A hub id that cannot be fetched: one sentence, before any loader retries (flowrl/hub.py). The hub
is never contacted here: its client's answers are simulated."""

from __future__ import annotations

import re

import httpx2
import pytest
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from flowrl.cli import main
from flowrl.errors import UserError
from flowrl.hub import HUB_TIMEOUT_SECONDS, check_hub_id

REQUEST = httpx2.Request("GET", "https://huggingface.co/api/models/org/name")


def _answer(monkeypatch, outcome):
    """HfApi.model_info raises `outcome` (an exception) or returns it, online (the suite runs with
    HF_HUB_OFFLINE=1); the calls' timeouts are kept."""
    timeouts = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def model_info(self, repo_id, timeout=None, **kwargs):
        timeouts.append(timeout)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(HfApi, "model_info", model_info)
    return timeouts


@pytest.mark.parametrize("outcome, sentence", [
    (httpx2.ConnectError("Name or service not known"), "the hub cannot be reached (ConnectError); on a machine without it set "
                                                        "HF_HUB_OFFLINE=1 and use the cache, or give a local directory"),
    (RepositoryNotFoundError("404", response=httpx2.Response(404, request=REQUEST)), "names no model on the hub"),
    (GatedRepoError("401", response=httpx2.Response(401, request=REQUEST)), "is a gated model: accept its licence"),
])
def test_a_hub_id_the_cache_lacks_is_asked_for_once_with_a_short_timeout(monkeypatch, outcome, sentence):
    timeouts = _answer(monkeypatch, outcome)
    with pytest.raises(UserError, match=f"^model.path 'org/name' .*{re.escape(sentence)}"):
        check_hub_id("org/name", "model_index.json")
    assert timeouts == [HUB_TIMEOUT_SECONDS] and HUB_TIMEOUT_SECONDS <= 5


def test_a_hub_that_answers_or_a_cached_id_loads(monkeypatch):
    timeouts = _answer(monkeypatch, object())
    check_hub_id("org/name", "model_index.json")  # the hub knows it: the loader fetches it
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: "/cache/model_index.json")
    check_hub_id("org/name", "model_index.json")  # cached: the hub is not asked
    assert len(timeouts) == 1


def test_offline_mode_names_the_cache(monkeypatch):
    timeouts = _answer(monkeypatch, object())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="is not in the local cache .*, and HF_HUB_OFFLINE is set"):
        check_hub_id("org/name", "config.json", field="model.path")
    assert timeouts == []


def test_the_cli_says_it_in_one_line_and_exits_2(monkeypatch, capsys):
    _answer(monkeypatch, httpx2.ConnectError("Name or service not known"))
    assert main(["train", "tiny_jpeg", "model.path=no-such-org/no-such-model", "run.cpu_processes=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl: error: model.path 'no-such-org/no-such-model' is a hub id") and "HF_HUB_OFFLINE" in err
    assert "\n" not in err and "Retry" not in err
