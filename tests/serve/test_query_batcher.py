"""Concurrent queries are embedded together; a lone one is not held back; failures reach every waiter."""

import asyncio
import threading

import pytest
import torch

from deployments.query_batcher import QueryBatcher


class _Slow:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def embed_tensor(self, texts):
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.release.wait(5)  # the first forward runs while the others arrive
        return torch.tensor([[float(len(t)), 1.0] for t in texts])


def test_queries_arriving_during_a_forward_share_the_next_one():
    embedder = _Slow()

    async def main():
        batcher = QueryBatcher(embedder, max_batch=8)
        first = asyncio.ensure_future(batcher.embed("a"))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher.embed("b" * n)) for n in range(2, 7)]
        await asyncio.sleep(0.05)
        embedder.release.set()
        return await first, await asyncio.gather(*rest), batcher.batches

    first, rest, batches = asyncio.run(main())
    assert embedder.calls == [["a"], ["bb", "bbb", "bbbb", "bbbbb", "bbbbbb"]] and batches == 2
    assert first.tolist() == [1.0, 1.0] and [v[0].item() for v in rest] == [2, 3, 4, 5, 6]


def test_a_failed_forward_fails_its_waiters_and_the_next_batch_runs():
    class _Flaky:
        calls = 0

        def embed_tensor(self, texts):
            _Flaky.calls += 1
            if _Flaky.calls == 1:
                raise RuntimeError("device lost")
            return torch.ones((len(texts), 2))

    async def main():
        batcher = QueryBatcher(_Flaky())
        with pytest.raises(RuntimeError, match="device lost"):
            await batcher.embed("x")
        return await batcher.embed("y")

    assert asyncio.run(main()).tolist() == [1.0, 1.0]
