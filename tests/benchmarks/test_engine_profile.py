"""Blocks of work under one torch profiler window, each block's time by operator (a real trace, on the CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks._engine_profile import (
    ProfiledBlocks,
    difference,
    is_ours,
    is_work,
    per_request,
    read_events,
    self_times,
    trace_files,
)


def profiler_switch(folder):
    """What vLLM's worker does on start_profile / stop_profile: one torch profiler, its trace written at stop."""
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder), worker_name="w", use_gzip=True),
    )
    return lambda on: profiler.start() if on else profiler.stop()


def test_each_operator_lands_in_the_block_whose_span_holds_it_and_counts_per_request(tmp_path):
    a = torch.randn(64, 64)
    blocks = ProfiledBlocks(tmp_path, profiler_switch(tmp_path))
    with blocks.window():
        with blocks.block("mm", requests=4):
            for _ in range(8):
                torch.mm(a, a)
        time.sleep(0.01)  # between blocks: counted in neither
        torch.add(a, a)
        with blocks.block("add", requests=2):
            for _ in range(6):
                torch.add(a, a)
    report = blocks.report()  # no device kernels in a CPU trace: the operators instead, and it says so
    assert report["categories"] == ["cpu_op"]
    assert len(report["trace_files"]) == 1 and len(trace_files(tmp_path)) == 1
    mm, add = report["blocks"]["mm"], report["blocks"]["add"]
    assert "aten::mm" in mm["top_ms"] and "aten::mm" not in add["top_ms"]
    assert "aten::add" in add["top_ms"] and "aten::add" not in mm["top_ms"]
    # six adds in the block, none of the one outside: per request (2), three adds' worth
    _, events = read_events(tmp_path / report["trace_files"][0])
    adds = [e["dur"] / 1000 for e in sorted(events, key=lambda e: e["ts"]) if e["name"] == "aten::add"]
    assert len(adds) == 7
    assert add["top_ms"]["aten::add"] == pytest.approx(sum(adds[1:]) / 2, abs=1e-3)
    assert mm["total_ms"] > 0 and set(report["differences"]) == {"add - mm"}
    assert report["differences"]["add - mm"]["aten::mm"] < 0 < report["differences"]["add - mm"]["aten::add"]


def test_a_window_reports_only_the_traces_it_wrote(tmp_path):
    (tmp_path / "old.123.pt.trace.json").write_text('{"traceEvents": []}')
    blocks = ProfiledBlocks(tmp_path, profiler_switch(tmp_path))
    with blocks.window(), blocks.block("one", requests=1):
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert blocks.report(categories=("kernel",), fallback=())["blocks"]["one"]["total_ms"] == 0
    written = blocks.report(categories=("cpu_op",))["trace_files"]
    assert len(written) == 1 and written[0] != "old.123.pt.trace.json"


def test_per_request_ranks_names_and_difference_puts_the_largest_change_first():
    times = {"small": 1.0, "big": 9.0, "mid": 4.0}
    assert per_request(times, requests=2, top=2) == {"total_ms": 7.0, "top_ms": {"big": 4.5, "mid": 2.0}}
    a = {"inject": 6.0, "attention": 10.0}
    b = {"attention": 9.0, "gone": 5.0}
    assert list(difference(a, 2, b, 1, top=3).items()) == [("gone", -5.0), ("attention", -4.0), ("inject", 3.0)]
    assert list(difference(a, 2, b, 1, top=1)) == ["gone"]


def _host_helper_of_the_test(a):
    for _ in range(20):
        torch.mm(a, a)


def test_host_report_splits_a_block_by_python_function_where_the_trace_has_stacks(tmp_path):
    """With Python stacks the host's time is split by function; a CPU trace has no CUDA calls, so that part is left
    out rather than reported empty."""
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        with_stack=True,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(tmp_path), worker_name="w", use_gzip=True),
    )
    a = torch.randn(64, 64)
    blocks = ProfiledBlocks(tmp_path, lambda on: profiler.start() if on else profiler.stop())
    with blocks.window():
        with blocks.block("helper", requests=2):
            _host_helper_of_the_test(a)
        with blocks.block("plain", requests=1):
            torch.mm(a, a)
    host = blocks.host_report()
    assert set(host) == {"python"}
    helper, plain = host["python"]["blocks"]["helper"]["top_ms"], host["python"]["blocks"]["plain"]["top_ms"]
    assert any("_host_helper_of_the_test" in name for name in helper)
    assert not any("_host_helper_of_the_test" in name for name in plain)
    named = next(name for name in host["python"]["differences"]["plain - helper"] if "_host_helper" in name)
    assert host["python"]["differences"]["plain - helper"][named] < 0


def test_self_times_take_out_directly_nested_events_per_thread():
    events = [
        {"name": "outer", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"name": "child", "ts": 10, "dur": 30, "pid": 1, "tid": 1},
        {"name": "grandchild", "ts": 15, "dur": 10, "pid": 1, "tid": 1},
        {"name": "second child", "ts": 50, "dur": 20, "pid": 1, "tid": 1},
        {"name": "other thread", "ts": 20, "dur": 50, "pid": 1, "tid": 2},  # not nested in `outer`
    ]
    assert self_times(events) == [50, 20, 10, 20, 50]
    assert is_ours("kvcore/injection.py(192): _start") and is_ours("deployments/gateway.py(10): f")
    assert not is_ours("vllm/v1/core/sched/scheduler.py(300): schedule")
    assert not is_ours("vllm/model_executor/models/llama.py(534): forward")  # a folder of that name elsewhere
    assert not is_work("<built-in method acquire of _thread.lock object at 0x7f>") and is_work("kvcore/x.py(1): f")
