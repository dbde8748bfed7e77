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
    assert args.engine_kwargs(cuda=True)["block_size"] == 64 and args.engine_kwargs(cuda=False)["block_size"] == 32
    with pytest.raises(ValidationError):
        AppArgs(**{**config["applications"][0]["args"], "llm": {"num_replica": 2}})


def test_given_engine_arguments_win_over_the_defaults():
    args = AppArgs(state_dir="/srv", llm={"engine_kwargs": {"block_size": 16, "dtype": "bfloat16"}})
    assert args.engine_kwargs(cuda=True) == {"block_size": 16, "dtype": "bfloat16"}
    assert args.engine_kwargs(cuda=False)["block_size"] == 16 and args.engine_kwargs(cuda=False)["dtype"] == "bfloat16"
    assert AppArgs(state_dir="/srv").engine_kwargs(cuda=True) == {"block_size": 64}


def test_the_arena_has_one_default_size():
    """The served app, the connector's config and the pure core size the device arena alike when nobody chooses."""
    import inspect

    from config.connector import DEFAULT_DEVICE_CACHE_BYTES, ConnectorConfig
    from kvcore.arena import DEFAULT_DEVICE_CACHE_BYTES as CORE_DEFAULT
    from kvcore.injection import InjectionWorker

    assert DEFAULT_DEVICE_CACHE_BYTES == CORE_DEFAULT  # the core cannot import the settings package
    assert AppArgs(state_dir="/srv").llm.device_cache_bytes == DEFAULT_DEVICE_CACHE_BYTES
    assert ConnectorConfig(store_root="/srv", fingerprint="f").device_cache_bytes == DEFAULT_DEVICE_CACHE_BYTES
    assert inspect.signature(InjectionWorker).parameters["device_cache_bytes"].default == DEFAULT_DEVICE_CACHE_BYTES


def test_records_are_stored_in_the_served_dtype_unless_one_is_named():
    """The serving app, the connector and the Helm chart agree: records in the engine's dtype by default."""
    from config.connector import ConnectorConfig

    values = yaml.safe_load((Path(__file__).parents[2] / "helm/inferscale/values.yaml").read_text())
    assert AppArgs(state_dir="/srv").llm.record_dtype == "engine"
    assert ConnectorConfig(store_root="/srv", fingerprint="f").record_dtype == "engine"
    assert values["serve"]["llm"]["recordDtype"] == "engine"


def test_the_connector_config_round_trips_and_refuses_what_it_does_not_know():
    """What the engine builders write into vLLM's extra config is what every connector process parses back; an
    unknown knob, a wrong type or a Redis password fails at engine start, naming the field."""
    from pydantic import ValidationError

    from config.connector import ConnectorConfig, TierConfig

    config = ConnectorConfig(
        store_root="/srv/records",
        fingerprint="f",
        device_tenant_bytes=1 << 20,
        tiers=TierConfig(
            disk_cache_dir="/srv/tiers", host_cache_bytes=64 << 20, compress_lower=False, pin_host_at_start=False
        ),
        report_placement=True,
        placement_redis_url="redis://127.0.0.1:6379/0",
        record_dtype="engine",
    )
    extra = config.to_extra()
    assert extra["tiers"] == {
        "disk_cache_dir": "/srv/tiers",
        "host_cache_bytes": 64 << 20,
        "disk_cache_bytes": None,
        "compress_lower": False,
        "pin_host_at_start": False,
    }
    assert ConnectorConfig.from_extra(extra) == config
    for bad, field in [
        ({**extra, "host_cache_bytes": 1}, "host_cache_bytes"),  # a tier knob at the wrong level
        ({**extra, "device_cache_bytes": "lots"}, "device_cache_bytes"),
        ({**extra, "tiers": {"host_cache_bytes": 1}}, "disk_cache_dir"),
        ({**extra, "placement_redis_url": "redis://:hunter2@redis:6379/0"}, "placement_redis_url"),
        ({k: v for k, v in extra.items() if k != "fingerprint"}, "fingerprint"),
        ({**extra, "record_dtype": "int8"}, "record_dtype"),
    ]:
        with pytest.raises(ValidationError, match=field):
            ConnectorConfig.from_extra(bad)
    with pytest.raises(ValidationError, match="tiers"):
        AppArgs(state_dir="/srv", llm={"tiers": {"disk_cache_dir": "/t", "host_cache": 1}})


def test_chats_go_over_the_channel_unless_serves_handle_is_asked_for_and_autoscaling_counts_them():
    from deployments.ray_serve.channel_load import POLICY, with_channel_policy

    autoscaled = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    assert AppArgs(state_dir="/s").chat_over_channel
    assert AppArgs(state_dir="/s", llm=autoscaled).chat_over_channel  # the policy counts the channel's chats
    assert AppArgs(state_dir="/s", llm=autoscaled, ingress={"chat_transport": "channel"}).chat_over_channel
    assert not AppArgs(state_dir="/s", ingress={"chat_transport": "serve"}).chat_over_channel
    scaling = with_channel_policy(autoscaled["autoscaling_config"])
    assert scaling == {"min_replicas": 1, "max_replicas": 2, "policy": {"policy_function": POLICY}}
    assert autoscaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2}  # the caller's dict untouched
    own = {"max_replicas": 3, "policy": {"policy_function": "mine:policy"}}
    assert with_channel_policy(own) == own  # a policy of the user's own is kept
    with pytest.raises(ValidationError, match="chat_transport"):
        AppArgs(state_dir="/s", ingress={"chat_transport": "grpc"})


def test_the_spins_are_off_by_default_and_bounded():
    args = AppArgs(state_dir="/s")
    assert args.ingress.embed_spin_ms == 0 and args.llm.ahead_spin_ms == 0
    given = AppArgs(state_dir="/s", ingress={"embed_spin_ms": 40}, llm={"ahead_spin_ms": 3})  # 40: kept warm
    assert given.ingress.embed_spin_ms == 40 and given.llm.ahead_spin_ms == 3
    for bad in (-1, 201):
        with pytest.raises(ValidationError, match="embed_spin_ms"):
            AppArgs(state_dir="/s", ingress={"embed_spin_ms": bad})
    for bad in (-1, 50):
        with pytest.raises(ValidationError, match="ahead_spin_ms"):
            AppArgs(state_dir="/s", llm={"ahead_spin_ms": bad})


def test_record_precisions_are_the_cores_and_the_app_passes_its_choice_to_the_connector():
    """The settings offer exactly the precisions the record format knows, and an unknown one fails at deploy."""
    from typing import get_args

    from config.connector import ConnectorConfig, RecordPrecision
    from kvcore.record import PRECISIONS

    assert get_args(RecordPrecision) == PRECISIONS
    assert AppArgs(state_dir="/srv", llm={"record_precision": "int8"}).llm.record_precision == "int8"
    assert ConnectorConfig(store_root="/srv", fingerprint="f").record_precision == "dense"
    values = yaml.safe_load((Path(__file__).parents[2] / "helm/inferscale/values.yaml").read_text())
    assert values["serve"]["llm"]["recordPrecision"] == "dense"
    with pytest.raises(ValidationError, match="record_precision"):
        AppArgs(state_dir="/srv", llm={"record_precision": "int4"})


def test_arena_precision_is_the_cores_and_reaches_the_workers_arena(tmp_path):
    """The settings offer the arena precisions the core knows; the connector's choice reaches the worker's arena
    (int8: codes, with scale tables); an unknown one fails at deploy; the chart's default is dense."""
    from typing import get_args

    import torch

    from config.connector import ArenaPrecision, ConnectorConfig
    from deployments.connector_worker import ConnectorWorker
    from kvcore.arena import ArenaPrecision as CoreArenaPrecision
    from kvcore.paged import PagedLayout
    from kvcore.store import LocalFactStore
    from tests.core.factories import ROPE

    assert get_args(ArenaPrecision) == get_args(CoreArenaPrecision)
    assert AppArgs(state_dir="/srv", llm={"arena_precision": "int8"}).llm.arena_precision == "int8"
    with pytest.raises(ValidationError, match="arena_precision"):
        AppArgs(state_dir="/srv", llm={"arena_precision": "fp4"})
    config = ConnectorConfig(
        store_root=tmp_path / "records", fingerprint="f", device_cache_bytes=1 << 20, arena_precision="int8"
    )
    worker = ConnectorWorker.build(config, LocalFactStore(config.store_root), ROPE, torch.device("cpu"))
    worker.injection.register({f"l{i}": torch.zeros(16, 2, 4, 16) for i in range(3)}, PagedLayout("rows", 4, 2, 8))
    arena = worker.injection._arena
    assert arena.quantized and arena.k.dtype == torch.int8 and arena.k_scales.dtype == torch.float32
    values = yaml.safe_load((Path(__file__).parents[2] / "helm/inferscale/values.yaml").read_text())
    assert values["serve"]["llm"]["arenaPrecision"] == "dense"


def test_questions_are_embedded_from_the_loop_on_a_gpu_and_in_a_process_on_the_cpu_unless_named():
    def way(**ingress) -> str:
        return AppArgs(state_dir="/s", ingress=ingress).ingress.query_embedding_way

    assert way() == "process" and way(embed_device="cuda") == "inline"
    assert way(embed_device="cuda", query_embedding="process") == "process"
    assert way(query_embedding="inline") == "inline" and way(query_embedding="thread") == "thread"
    with pytest.raises(ValidationError, match="query_embedding"):
        way(query_embedding="fiber")


def test_retrieval_begins_in_the_middleware_on_a_gpu_and_in_the_handler_on_the_cpu_unless_named():
    def ahead(**ingress) -> bool:
        return AppArgs(state_dir="/s", ingress=ingress).ingress.retrieval_ahead_on

    assert ahead() is False and ahead(embed_device="cuda") is True
    assert ahead(retrieval_ahead="on") is True and ahead(embed_device="cuda", retrieval_ahead="off") is False
    with pytest.raises(ValidationError, match="retrieval_ahead"):
        ahead(retrieval_ahead=True)
