"""`build_app(args)`: the Serve application (ingress -> LLM servers), nameable from a Serve config YAML as
`import_path: deployments.ray_serve.app:build_app`, with `args` validated by `AppArgs`."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.app_args import AppArgs
from deployments.ray_serve.channel_load import with_channel_policy
from deployments.ray_serve.ingress import Ingress
from deployments.ray_serve.llm_server import GRACEFUL_SHUTDOWN_S, LLMServer

ROUTER_CLASS = "deployments.ray_serve.router.TenantAffinityRouter"


def build_app(args: dict[str, Any]) -> Application:
    parsed = AppArgs(**args)
    plain = parsed.model_dump(mode="json")
    llm_options: dict[str, Any] = {
        "max_ongoing_requests": parsed.llm.max_ongoing_requests,
        "ray_actor_options": parsed.llm.ray_actor_options,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"spill_queue_gap": parsed.llm.spill_queue_gap},
            request_routing_stats_period_s=1.0,  # the channel's chats (LLMServer.record_routing_stats), fresh
        ),
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
    }
    if parsed.llm.autoscaling_config is not None:
        scaling = parsed.llm.autoscaling_config
        llm_options["autoscaling_config"] = with_channel_policy(scaling) if parsed.chat_over_channel else scaling
    else:
        llm_options["num_replicas"] = parsed.llm.num_replicas
    llm = serve.deployment(LLMServer, name="LLMServer").options(**llm_options).bind(plain)
    return build_ingress(args, llm)


def build_ingress(args: dict[str, Any], llm: Any, name: str = "Ingress") -> Application:
    """The HTTP ingress over `llm`: the LLM deployment of the same application, or a handle to another
    application's (`serve.get_deployment_handle`), so that a second ingress with other settings serves the same
    LLM replicas under a route of its own (`benchmarks/serve_http.py --ab-ingress`)."""
    parsed = AppArgs(**args)
    ingress = serve.deployment(Ingress, name=name).options(
        num_replicas=parsed.ingress.num_replicas,
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options=parsed.ingress.ray_actor_options,
    )
    return ingress.bind(llm, parsed.model_dump(mode="json"))
