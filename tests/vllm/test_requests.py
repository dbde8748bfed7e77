"""The requests the adapter hands vLLM are each request's own, so vLLM does not deep-copy them (and their memory
plans) again: that copy cost ~0.2 ms a request on the serving replica's event loop."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from deployments.vllm_adapter.engine import capture_request, memory_request
from kvcore.plan import CapturePlan, CaptureSpan, MemoryPlan

pytestmark = pytest.mark.vllm  # imports vLLM


def test_a_memory_request_is_a_copy_of_its_own_that_vllm_copies_shallowly():
    shared = SamplingParams(max_tokens=4)
    plan = MemoryPlan("t1", ("frame", *(f"fact-{i}" for i in range(50))), 3)
    prompt, params = memory_request(list(range(10)), plan, shared)
    assert params is not shared and shared.extra_args is None and not shared.skip_clone  # the caller's stays as it was
    assert params.skip_clone and params.extra_args["kv_transfer_params"] == plan.to_params()
    assert prompt["cache_salt"] == plan.cache_salt
    again = params.clone()
    assert again is not params and again.extra_args is params.extra_args  # shallow: the plan is not copied


def test_a_capture_request_is_not_copied_deeply_either():
    _, params = capture_request([1, 2, 3, 4], CapturePlan("t1", (CaptureSpan("f1", 0, 3),)))
    assert params.skip_clone and params.clone().extra_args is params.extra_args
