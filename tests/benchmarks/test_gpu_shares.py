"""The serving benchmarks' GPU shares fit one GPU at every ingress replica count (else Serve waits forever)."""

import pytest

from benchmarks._cluster import LLM_GPU_SHARE, ingress_gpu_share


@pytest.mark.parametrize("replicas", [1, 2, 4, 5, 8, 16, 64])
def test_the_replicas_asks_fit_one_gpu(replicas):
    share = ingress_gpu_share(replicas)
    assert 0 < share <= 0.02
    assert LLM_GPU_SHARE + replicas * share <= 1.0


def test_four_replicas_keep_their_share_and_none_is_refused():
    assert ingress_gpu_share(4) == 0.02
    with pytest.raises(ValueError, match="at least 1"):
        ingress_gpu_share(0)
