"""The first hour, again (issue 31): defaults that follow the machine, offline noticed at once, a laptop sizing a GPU
node, one plan for the dry run and the run, no silent override across nodes. Each test fails when its fix is undone."""

import os
import time

import pytest

from ulysses_lc.train import CheckFailed, parse_args
from ulysses_lc.train.loading import hub_offline
from ulysses_lc.train.preflight import preflight


@pytest.fixture
def fresh_probe():
    hub_offline.cache_clear()
    yield
    hub_offline.cache_clear()


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"},
                                 # no route: a closed local port refuses at once; huggingface_hub would retry it
                                 {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_offline_hub_name_fails_in_seconds_naming_data_and_model(env, monkeypatch, fresh_probe):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = parse_args(["--model", "Qwen/Qwen3-8B-not-cached", "--steps", "1"])
    t0 = time.monotonic()
    with pytest.raises(CheckFailed) as e:
        preflight(cfg, 1)
    assert time.monotonic() - t0 < 10, "the hub was retried"
    message = str(e.value)
    assert "--model ./folder" in message and "--model tiny" in message and "--data tiny" in message, message
    assert ("HF_HUB_OFFLINE=1" if env["HF_HUB_OFFLINE"] == "1" else "no route to 127.0.0.1:9") in message, message


def test_offline_hub_dataset_is_refused_naming_data(monkeypatch, fresh_probe):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckFailed, match="--data tiny"):
        preflight(parse_args(["--model", "tiny", "--data", "someorg/somedata"]), 1)
