"""The example Serve config is valid for Ray's own schema and for `AppArgs`; unknown args are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.app_args import AppArgs

EXAMPLE = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.example.yaml"


def test_example_config_validates_and_typos_are_refused():
    config = yaml.safe_load(EXAMPLE.read_text())
    ServeDeploySchema(**config)
    args = AppArgs(**config["applications"][0]["args"])
    assert args.llm.num_replicas == 2 and args.engine_kwargs(cuda=True)["max_model_len"] == 8192
    with pytest.raises(ValidationError):
        AppArgs(**{**config["applications"][0]["args"], "llm": {"num_replica": 2}})


def test_the_arena_has_one_default_size():
    """The served app and every engine builder size the connector's device arena alike when nobody chooses."""
    import inspect

    from deployments.vllm_adapter.engine import build_llm, kv_transfer_config
    from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES
    from kvcore.injection import InjectionWorker

    assert AppArgs(state_dir="/srv").llm.device_cache_bytes == DEFAULT_DEVICE_CACHE_BYTES
    for builder in (build_llm, kv_transfer_config, InjectionWorker):
        assert inspect.signature(builder).parameters["device_cache_bytes"].default == DEFAULT_DEVICE_CACHE_BYTES
