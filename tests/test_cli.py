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
    from pathlib import Path

    from cluster.ray_head import RayHead
    from tests.encoder_jobs.test_job import write_input

    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "INFERSCALE_STATE_DIR": str(tmp_path / "state"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "PATH": venv_bin + os.pathsep + os.environ["PATH"]}
    env.pop("INFERSCALE_ADMIN_KEY", None)
    env.pop("RAY_ADDRESS", None)
    created = subprocess.run([sys.executable, "-m", "cluster.cli", "tenant", "maya", "--window", "1"], env=env,
                             capture_output=True, text=True, timeout=300, check=True)
    env["INFERSCALE_ADMIN_KEY"] = re.search(r"admin key .*: (isa\.\S+)", created.stderr).group(1)
    head = RayHead.start(num_cpus=2, env=env)  # its own ports and temp folder: another Ray of this session holds the defaults
    try:
        url = head.dashboard_url
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
        head.stop()  # only this head: `ray stop` would stop every Ray here

