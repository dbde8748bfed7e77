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
