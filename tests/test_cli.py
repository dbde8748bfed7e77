"""The `inferscale` command line, run the way a user runs it."""

import re
import subprocess
import sys

import pytest


@pytest.mark.model
def test_demo_answers_every_question_both_ways(loaded):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "demo", "--max-new-tokens", "12", "--window", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
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
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "demo", "--window", "-3"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "inferscale: error: --window must be >= 0" in result.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "frobnicate"], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "invalid choice" in missing.stderr


@pytest.mark.model
@pytest.mark.redis
@pytest.mark.ray
def test_tenant_then_encode_on_the_embedded_default(tmp_path):
    """`inferscale tenant` and `inferscale encode` start their own redis-server and Ray, like a user's first run."""
    import json
    import os

    from tests.encoder_jobs.test_job import write_input

    env = {**os.environ, "INFERSCALE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("INFERSCALE_ADMIN_KEY", None)
    created = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "tenant", "maya", "--window", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert created.returncode == 0, created.stderr
    admin = re.search(r"admin key .*: (isa\.\S+)", created.stderr).group(1)
    assert json.loads(created.stdout)["api_key"].startswith("isk.maya.")
    env["INFERSCALE_ADMIN_KEY"] = admin
    path = write_input(tmp_path / "in.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"turns": []}x')
    refused = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "encode", "--tenant", "maya", "--input", str(bad)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "inferscale: error:" in refused.stderr and "not valid JSON" in refused.stderr
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "encode", "--tenant", "maya", "--input", str(path)]
        + ["--record-dtype", "bfloat16"],  # as a serving app with llm.record_dtype bfloat16 stores its own
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["total"], report["encoded"], report["failed"]) == (4, 4, 0) and "encoding [" in done.stderr
    from kvcore.store import LocalFactStore

    store = LocalFactStore(tmp_path / "state" / "records")
    assert {str(store.get("maya", r).k.dtype) for r in store.record_ids("maya")} == {"torch.bfloat16"}


@pytest.mark.model
@pytest.mark.redis
@pytest.mark.ray
def test_encode_submits_through_the_ray_jobs_api(tmp_path):
    """`--submit` sends the job to a running Ray cluster (`ray start --head`) and follows it to the end."""
    import json
    import os
    from pathlib import Path

    from cluster.ray_head import RayHead
    from tests.encoder_jobs.test_job import write_input

    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "INFERSCALE_STATE_DIR": str(tmp_path / "state"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "PATH": venv_bin + os.pathsep + os.environ["PATH"],
    }
    env.pop("INFERSCALE_ADMIN_KEY", None)
    env.pop("RAY_ADDRESS", None)
    created = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "tenant", "maya", "--window", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    env["INFERSCALE_ADMIN_KEY"] = re.search(r"admin key .*: (isa\.\S+)", created.stderr).group(1)
    head = RayHead.start(
        num_cpus=2, env=env
    )  # its own ports and temp folder: another Ray of this session holds the defaults
    try:
        url = head.dashboard_url
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "encode",
                "--tenant",
                "maya",
                "--input",
                str(write_input(tmp_path / "in.json")),
                "--submit",
                url,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["status"] == "SUCCEEDED" and '"encoded": 4' in done.stderr
        status = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "job", "status", result["job_id"], "--submit", url],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    finally:
        head.stop()  # only this head: `ray stop` would stop every Ray here


@pytest.mark.ray
@pytest.mark.parametrize("proxy", ["haproxy", "python"])
def test_serve_deploys_a_config_onto_a_cluster_in_the_chosen_proxy_mode(tmp_path, proxy):
    """`inferscale serve` onto a Ray head started without Serve's switches: the settings' proxy mode reaches Serve's
    controller and replicas (HAProxy in front, or not), and the app answers through the ingress and its downstream."""
    import os
    from pathlib import Path

    import psutil
    import requests

    from cluster.ray_head import RayHead, free_port

    root = Path(__file__).resolve().parents[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RAY_SERVE_") and k not in ("RAY_ADDRESS", "INFERSCALE_SERVE__PROXY")
    }
    env |= {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": str(root),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
    }
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"http_options: {{host: 127.0.0.1, port: {port}}}\napplications:\n  - name: tiny\n    route_prefix: /\n"
        "    import_path: tests.fixtures.tiny_serve_app:build\n    args: {}\n"
    )
    head = RayHead.start(num_cpus=4, env=env)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)],
            cwd=root,
            env={**env, "RAY_ADDRESS": head.address, "INFERSCALE_SERVE__PROXY": proxy},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert requests.get(f"http://127.0.0.1:{port}/hello", timeout=30).json() == {"downstream": "hello"}
        owned = [
            c
            for p in psutil.process_iter(["cmdline"])
            if any(head.temp_dir in part for part in p.info["cmdline"] or [])
            for c in p.children(recursive=True)
        ]  # the head's processes and what they started, not other clusters'
        haproxies = [p for p in owned if p.name() == "haproxy"]
        listeners = {
            c.laddr.port for p in haproxies for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
        }
        assert (port in listeners) == (proxy == "haproxy"), (proxy, listeners)  # HAProxy is the ingress, or absent
    finally:
        head.stop()


MARKER = "INFERSCALE_TEST_UP_RUN"  # set on `up` runs: every process they start inherits it


def _up_env(tmp_path, **extra: str) -> dict[str, str]:
    """A user's environment for `inferscale up`: its own state folder, its own redis-server and Ray head."""
    import os

    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("INFERSCALE_ADMIN_KEY", "INFERSCALE_REDIS__URL", "RAY_ADDRESS")
    }
    return {
        **env,
        "INFERSCALE_STATE_DIR": str(tmp_path / "state"),
        "RAY_USAGE_STATS_ENABLED": "0",
        MARKER: str(tmp_path),
        **extra,
    }


def _processes_of(run, wait_s: float = 0.0) -> list[str]:
    """Live processes that a test's `up` run started: they carry its marker, or (redis-server, which writes
    over its environment) work in its folder. Waits up to `wait_s` for them to go (Ray's workers exit
    a moment after their raylet)."""
    import time

    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.process_iter(["name", "status", "cwd"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and (
                    proc.environ().get(MARKER) == str(run) or (proc.info["cwd"] or "").startswith(str(run))
                ):
                    found.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.parametrize(
    "source, key, problem",
    [
        ("env", "my-key", "6 characters"),
        ("env", "my own admin key, with spaces", "it contains whitespace"),
        ("env", "isk.demo." + "s" * 43, "it has the tenant-key form"),
        ("stored", "isa.cut", "7 characters"),
    ],
)
def test_up_refuses_an_invalid_admin_key_before_starting_anything(tmp_path, source, key, problem):
    from cluster.ray_head import free_port
    from tenants.auth import ADMIN_KEY_RULE

    env = _up_env(tmp_path, **({"INFERSCALE_ADMIN_KEY": key} if source == "env" else {}))
    state = tmp_path / "state"
    if source == "stored":
        state.mkdir()
        (state / "admin.key").write_text(key)
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    where = "INFERSCALE_ADMIN_KEY" if source == "env" else f"the stored admin key ({state / 'admin.key'})"
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        result.stderr.splitlines()[-1] == f"inferscale: error: {where}: invalid admin key ({problem}): {ADMIN_KEY_RULE}"
    )
    assert key not in result.stderr and result.stdout == ""
    assert not (state / "up.json").exists() and not (state / "redis").exists()  # LocalRedis makes its folder first
    assert _processes_of(tmp_path) == []


FAILING_UP = """
import logging, os, sys
from cluster import up
from cluster.ray_head import LOOPBACK_ENV
from config import load_settings

def deploy(settings, address, port, args):
    os.environ.update(LOOPBACK_ENV)  # before Ray is imported, as in _deploy
    import ray
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)  # attached, like _deploy
    print("driver attached:", ray.is_initialized(), "admin key passed:", args["admin_key"] == os.environ["INFERSCALE_ADMIN_KEY"], flush=True)
    raise RuntimeError("the deployment failed (injected)\\nReplica constructor: detail of the cause")

sys.exit(up.run_up(load_settings(), port=int(sys.argv[1]), out=sys.stdout, deploy=deploy))
"""


@pytest.mark.redis
@pytest.mark.ray
def test_up_prints_a_deploy_failure_before_cleaning_up(tmp_path):
    """A failure after redis-server and the Ray head started is printed first; the driver then leaves Ray,
    everything is stopped, and the process exits 1 (it used to be aborted by Ray's client, silently)."""
    from cluster.ray_head import free_port

    env = _up_env(tmp_path, INFERSCALE_ADMIN_KEY="my-own-admin-key-2026")
    result = subprocess.run(
        [sys.executable, "-c", FAILING_UP, str(free_port())], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.stdout.strip() == "driver attached: True admin key passed: True", result.stderr[-3000:]
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    error = lines.index("inferscale: error: `inferscale up` failed: RuntimeError: the deployment failed (injected)")
    assert lines[error + 1] == "Replica constructor: detail of the cause"
    stopped = [i for i, line in enumerate(lines) if line.startswith("stopped what `inferscale up` started")]
    assert len(stopped) == 1 and stopped[0] > error, result.stderr[-3000:]
    assert int(re.search(r"the Ray head: (\d+) processes; the local redis-server", lines[stopped[0]]).group(1)) > 0
    assert not (tmp_path / "state" / "up.json").exists()
    assert _processes_of(tmp_path, wait_s=15) == []
