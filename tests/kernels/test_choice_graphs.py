"""History mode's chunk order from fixed shapes (a CUDA graph's body) equals the eager order: interpreted on CPU;
on CUDA the chooser's graph replays too."""

import pytest
import torch

pytest.importorskip("triton")
from tests.kernels._run import run_check  # noqa: E402


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_a_history_padded_to_its_bucket_and_a_question_to_its_own_order_as_the_eager_path(style):
    """The bucket's tail holds another history's summaries and the question's padding garbage queries: masked
    and repeated away, the order is the eager one and the padding comes last."""
    got = run_check("order_check", "cpu", style, interpret=True)
    assert got == {"chunks": 75, "same_order": True, "padding_last": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_choices_graph_replays_order_as_the_eager_path_on_cuda():
    """Two histories (two chunk buckets) and two questions (two question buckets), each asked twice: every
    replay gives the eager order of the same question's pass."""
    got = run_check("order_check", "cuda", "neox", False, "graphs")
    assert got["same_order"] and got["padding_last"]
    assert got["graphs_agree"] == [True] * 8
