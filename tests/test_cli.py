"""The `inferscale` command line, run the way a user runs it."""

import re
import subprocess
import sys

import pytest


@pytest.mark.model
def test_demo_answers_every_question_both_ways(loaded):
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--max-new-tokens", "12", "--window", "2"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert "4 facts encoded with window w=2" in out
    assert out.count("Q: ") == 3
    plain = re.findall(r"prompt injection \(prefills (\d+) tokens\): (\S.*)", out)
    injected = re.findall(r"KV injection +\(prefills (\d+) tokens\): (\S.*)", out)
    assert len(plain) == len(injected) == 3
    for (p_tokens, _), (k_tokens, _) in zip(plain, injected):
        assert int(p_tokens) > int(k_tokens) + 40  # the facts were not prefilled
    saved = sum(int(p) - int(k) for (p, _), (k, _) in zip(plain, injected))
    assert f"total prefill tokens saved over 3 questions: {saved}" in out


def test_bad_arguments_give_an_error_line():
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--window", "-3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "inferscale: error: --window must be >= 0" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "cluster.cli", "frobnicate"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "invalid choice" in missing.stderr


@pytest.mark.model
@pytest.mark.redis
def test_tenant_then_encode_on_the_embedded_default(tmp_path):
    """`inferscale tenant` and `inferscale encode` start their own redis-server and Ray, like a user's first run."""
    import json
    import os

    from tests.encoder_jobs.test_job import write_input

    env = {**os.environ, "INFERSCALE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("INFERSCALE_ADMIN_KEY", None)
    created = subprocess.run([sys.executable, "-m", "cluster.cli", "tenant", "maya", "--window", "2"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert created.returncode == 0, created.stderr
    admin = re.search(r"admin key .*: (isa\.\S+)", created.stderr).group(1)
    assert json.loads(created.stdout)["api_key"].startswith("isk.maya.")
    env["INFERSCALE_ADMIN_KEY"] = admin
    path = write_input(tmp_path / "in.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"turns": []}x')
    refused = subprocess.run([sys.executable, "-m", "cluster.cli", "encode", "--tenant", "maya", "--input", str(bad)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "inferscale: error:" in refused.stderr and "not valid JSON" in refused.stderr
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "encode", "--tenant", "maya", "--input", str(path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["total"], report["encoded"], report["failed"]) == (4, 4, 0) and "encoding [" in done.stderr


@pytest.mark.model
@pytest.mark.redis
def test_encode_submits_through_the_ray_jobs_api(tmp_path):
    """`--submit` sends the job to a running Ray cluster (`ray start --head`) and follows it to the end."""
    import json
    import os
    import socket
    from pathlib import Path

    from tests.encoder_jobs.test_job import write_input

    def free_port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "INFERSCALE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "PATH": venv_bin + os.pathsep + os.environ["PATH"]}
    env.pop("INFERSCALE_ADMIN_KEY", None)
    env.pop("RAY_ADDRESS", None)
    created = subprocess.run([sys.executable, "-m", "cluster.cli", "tenant", "maya", "--window", "1"], env=env,
                             capture_output=True, text=True, timeout=300, check=True)
    env["INFERSCALE_ADMIN_KEY"] = re.search(r"admin key .*: (isa\.\S+)", created.stderr).group(1)
    port, dashboard = free_port(), free_port()
    import tempfile

    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix sockets must fit 107 characters
    ray = [os.path.join(venv_bin, "ray")]
    subprocess.run(ray + ["start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=true",
                          f"--dashboard-port={dashboard}", "--num-cpus=2", f"--temp-dir={ray_dir}",
                          # its own agent ports: another Ray of this test session already holds the defaults
                          f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                          f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                          f"--ray-client-server-port={free_port()}"],
                   env=env, capture_output=True, text=True, timeout=180, check=True)
    try:
        url = f"http://127.0.0.1:{dashboard}"
        done = subprocess.run([sys.executable, "-m", "cluster.cli", "encode", "--tenant", "maya", "--input",
                               str(write_input(tmp_path / "in.json")), "--submit", url],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["status"] == "SUCCEEDED" and '"encoded": 4' in done.stderr
        status = subprocess.run([sys.executable, "-m", "cluster.cli", "job", "status", result["job_id"], "--submit", url],
                                env=env, capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    finally:
        _kill_processes_mentioning(ray_dir)  # only this head: `ray stop` would stop every Ray here


def _kill_processes_mentioning(marker: str) -> None:
    import os

    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and any(marker in part for part in proc.info["cmdline"] or []):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
