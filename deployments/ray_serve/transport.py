"""Handles that call other replicas over the transport of the Serve mode this process runs in.

A deployment handle carries its transport (Ray actor calls, or gRPC in high-throughput mode) in its options,
fixed where the handle was made: in the driver that built the application. A driver that imported Ray Serve
before the mode's switches were in its environment (or one started without them, as `serve run` on a laptop
is) hands every replica handles that use actor calls, even on a cluster in high-throughput mode. The
replica's own environment is the cluster's, so it decides here.
"""

from __future__ import annotations

from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT  # no public API exposes the mode's transport
from ray.serve.handle import DeploymentHandle


def in_this_mode(handle: DeploymentHandle) -> DeploymentHandle:
    """`handle` calling over gRPC when this process runs in high-throughput mode, else over actor calls. Over
    gRPC, arguments and results are plain pickles: what crosses here (a `ChatTask`, event dicts) needs nothing
    of cloudpickle, whose pure-Python pickler took 0.3 ms to write a task of 50 facts (pickle: 0.1 ms)."""
    if not RAY_SERVE_USE_GRPC_BY_DEFAULT:
        return handle.options(_by_reference=True)
    return handle.options(_by_reference=False, request_serialization="pickle", response_serialization="pickle")


def uses_grpc(handle: DeploymentHandle) -> bool:
    return not handle.handle_options._by_reference
