"""`MemoryEngine`: a vLLM `AsyncLLM` with the inferscale connector, answering chat requests with memory.

One per serving replica. It turns a chat request plus its retrieved facts into token ids laid out by
`deployments.memory_prompt`, encodes each tenant's chat-frame record once with the engine itself (a
capture request, so the frame's K/V has exactly the engine's numerics), streams text deltas and ends
with the usage: prompt, injected, engine-cached and prefilled tokens, and the engine-side TTFT.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from config.connector import ConnectorConfig, stored_dtype
from deployments.app_args import SCORING_LAYERS
from deployments.chat_task import ChatAhead, ChatTask, RetrievedFact, message_dicts, single_question
from deployments.encode_slots import EncodeSlots
from deployments.history_mode import Choice, HistoryChooser
from deployments.memory_prompt import LaidOutPrompt, MemoryItem, Mode, lay_out
from deployments.vllm_adapter.detokenize import install_prompt_suffix_detokenizer, installed
from deployments.vllm_adapter.engine import capture_request, kv_transfer_config
from deployments.vllm_adapter.engine_phases import engine_phases
from kvcore.conversation import Fact
from kvcore.errors import KVCoreError
from kvcore.history_index import HISTORY_CHUNK, capture_spans
from kvcore.plan import CapturePlan, CaptureSpan
from kvcore.record import FactKV
from kvcore.spills import tier_key
from kvcore.store import LocalFactStore
from kvcore.tier_disk import advise_willneed, tier_files
from models.chat import build_frame, split_chat

log = logging.getLogger(__name__)
_KEPT_SPLITS = 256  # conversations tokenized ahead of their chats, waiting to be taken
_KEPT_LAST = 1024  # tenants whose last chat a note ahead lays out again, to warm the replica
_KEPT_CHOICES = 64  # history chunks chosen ahead of their chats, waiting to be taken
ChoiceKey = tuple[str, str, str, int]  # (tenant, history, question, budget): what a choice depends on


def _choice_key(chat: ChatAhead | ChatTask) -> ChoiceKey:
    return chat.tenant_id, chat.history_id, chat.question(), chat.history_budget  # type: ignore[return-value]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class MemoryEngine:
    """The async engine plus what it needs to lay out memory: tokenizer, frame, record headers."""

    def __init__(
        self,
        model: Path,
        connector: ConnectorConfig,
        system_prompt: str,
        *,
        engine_kwargs: dict[str, Any] | None = None,
        max_encodes_in_flight: int = 8,
        history_scoring_layers: int = SCORING_LAYERS,
    ) -> None:
        self.fingerprint = connector.fingerprint
        self.model_name = str(model)
        self._store = LocalFactStore(connector.store_root)
        self._store.set_precision(connector.record_precision)  # every writer of the store follows it
        self._tier_root = connector.tiers.disk_cache_dir if connector.tiers is not None else None
        kwargs = {"enable_prefix_caching": True, **(engine_kwargs or {})}
        install_prompt_suffix_detokenizer()  # the first token's text without decoding the whole prompt again
        self._engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=str(model), kv_transfer_config=kv_transfer_config(connector), **kwargs)
        )
        cache = self._engine.vllm_config.cache_config.cache_dtype  # "auto": the model's dtype, as captures see it
        # the dtype the captures store records in and the arena holds (a quantized cache's refused here, at start)
        try:
            self.record_dtype = stored_dtype(
                connector.record_dtype, str(self._engine.model_config.dtype) if cache == "auto" else cache
            )
        except ValueError:
            self._engine.shutdown()
            raise
        if not installed():  # a tokenizer backend loaded with the engine replaced it again
            log.warning("vLLM's detokenizer decodes each whole prompt at its first token (DecodeStream replaced)")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._system_prompt = system_prompt
        self._chat_frame = build_frame(self.tokenizer, system_prompt)
        self.prefix_ids = self._chat_frame.prefix_ids
        self.frame_id = f"chat-frame-{connector.fingerprint[:16]}"
        self._frames: dict[str, bool] = {}
        self._splits: OrderedDict[tuple, tuple[Sequence[int], list[int]]] = OrderedDict()  # tokenized ahead
        self._last: OrderedDict[str, ChatTask] = OrderedDict()  # each tenant's last chat that laid out facts
        self._choices: OrderedDict[ChoiceKey, tuple[float, asyncio.Future]] = OrderedDict()  # (began, choice)
        # the warm-up layout takes a core while the ingress embeds: on a GPU host the embedding runs on the device
        # and cores are spare; on a 2-core CPU it slowed the CPU embedding more than it saved (`prepare`)
        self._warm_ahead = _device() == "cuda"
        self._frame_locks: dict[str, asyncio.Lock] = {}
        self._encode_slots = EncodeSlots(max_encodes_in_flight)
        self.max_model_len = self._engine.model_config.max_model_len
        # on a GPU replica the question's pass and the bounds run beside the engine, on the same device
        self._histories = HistoryChooser(
            Path(model), self._store, self.tokenizer, _device(), scoring_layers=history_scoring_layers
        )

    async def warm_up(self) -> None:
        """One short generation, so the first real request does not pay for lazy initialisation."""
        params = SamplingParams(max_tokens=2, temperature=0.0)
        async for _ in self._engine.generate(
            TokensPrompt(prompt_token_ids=list(self.prefix_ids) + [1]), params, f"warmup-{uuid.uuid4().hex}"
        ):
            pass

    async def ensure_frame(self, tenant_id: str) -> bool:
        """Make sure the tenant has its chat-frame record (captured from the engine once); False if that failed."""
        if self._frames.get(tenant_id):
            return True
        lock = self._frame_locks.setdefault(tenant_id, asyncio.Lock())
        async with lock:
            if self._frame_ready(tenant_id):
                self._frames[tenant_id] = True
                return True
            plan = CapturePlan(tenant_id, (CaptureSpan(self.frame_id, 0, len(self.prefix_ids)),), keep_hot=True)
            prompt, params = capture_request([*self.prefix_ids, *self.prefix_ids[-1:]], plan)
            async for _ in self._engine.generate(prompt, params, f"frame-{uuid.uuid4().hex}"):
                pass
            self._frames[tenant_id] = self._frame_ready(tenant_id)
            if not self._frames[tenant_id]:
                log.warning("could not capture the chat frame of a tenant; its requests are served by prompt")
            return self._frames[tenant_id]

    async def encode_facts(
        self, tenant_id: str, facts: Sequence[tuple[str, int, str]], attach: Callable[[str, int, FactKV], None]
    ) -> dict[str, str]:
        """Encode facts `(id, version, text)` behind the chat frame with the engine's own prefill (a capture
        each, at most `max_encodes_in_flight` in the engine at once across callers, so a burst of writes does
        not queue ahead of chats) and hand each record to `attach`; returns fact id -> "encoded" or the error."""

        async def one(fact_id: str, version: int, text: str) -> tuple[str, str]:
            async with self._encode_slots:
                return await encode(fact_id, version, text)

        async def encode(fact_id: str, version: int, text: str) -> tuple[str, str]:
            scratch = f"{fact_id}.capture-{uuid.uuid4().hex[:8]}.v0"  # reconciled away if this process dies
            ids = self.tokenizer.encode(Fact(fact_id, text, 0).render(), add_special_tokens=False)
            begin = len(self.prefix_ids)
            plan = CapturePlan(tenant_id, (CaptureSpan(scratch, begin, begin + len(ids)),), window=0, version=version)
            prompt, params = capture_request([*self.prefix_ids, *ids, ids[-1]], plan)
            try:
                async for _ in self._engine.generate(prompt, params, f"encode-{uuid.uuid4().hex}"):
                    pass
                record = await self._written_record(tenant_id, scratch)
                await asyncio.to_thread(attach, fact_id, version, record)
                return fact_id, "encoded"
            except Exception as exc:  # noqa: BLE001 - reported per fact; the fact stays served by its text
                return fact_id, f"{type(exc).__name__}: {exc}"
            finally:
                self._store.delete(tenant_id, scratch)

        return dict(await asyncio.gather(*(one(*fact) for fact in facts)))

    async def encode_history(self, tenant_id: str, history_id: str, text: str) -> dict[str, int]:
        """Prefill a conversation history once behind the chat frame and keep each chunk of it as a record (the
        engine's own capture), indexed for history mode; returns its token and chunk counts."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        start = len(self.prefix_ids)
        room = self.max_model_len - start - 1
        if not ids:
            raise ValueError("the history is empty")
        if len(ids) > room:
            raise ValueError(f"the history has {len(ids)} tokens; this model holds {room} after the chat frame")
        spans = capture_spans(history_id, start, len(ids), HISTORY_CHUNK)
        prompt, params = capture_request(
            [*self.prefix_ids, *ids, ids[-1]], CapturePlan(tenant_id, spans, window=0, keep_hot=True)
        )
        async with self._encode_slots:
            async for _ in self._engine.generate(prompt, params, f"history-{uuid.uuid4().hex}"):
                pass
        records = [await self._written_record(tenant_id, span.fact_id) for span in spans]
        await asyncio.to_thread(self._histories.index_records, tenant_id, history_id, records)
        return {"tokens": len(ids), "chunks": len(spans)}

    def drop_history(self, tenant_id: str, history_id: str) -> int:
        """Delete a history's chunk records (one replaced by a newer history)."""
        return self._histories.drop(tenant_id, history_id)

    def prepare(self, note: ChatAhead, idle: bool) -> None:
        """On the loop, while the ingress still retrieves: tokenize the conversation for the chat to take; for a
        history-mode chat, start choosing its chunks (`_choose_ahead`); else, on a GPU replica that runs no chat (its
        core and caches gone cold after idleness), lay the tenant's last chat out again and drop it, so the coming
        layout finds its code and the tenant's record headers warm (a 2-core CPU, chats 30 ms apart: 0.67 ms a
        layout cold, 0.23 after such a warm-up 1.5 ms before, 0.16 back to back; but there the warm-up's core is
        the CPU embedding's, which it slowed by more than that: not done on a CPU)."""
        if not ChatAhead.fits(note.messages):
            return
        if note.history_id is not None:
            self._choose_ahead(note)
        split = self._splits[note.messages] = self._split_messages(note.messages)
        self._splits.move_to_end(note.messages)
        while len(self._splits) > _KEPT_SPLITS:
            self._splits.popitem(last=False)
        last = self._last.get(note.tenant_id)
        if idle and self._warm_ahead and last is not None and note.history_id is None:
            frame = (
                (self.frame_id, self.prefix_ids) if last.mode == "inject" and self._frames.get(last.tenant_id) else None
            )
            laid = self._lay_out(last, last.mode, split, frame)
            if laid.plan is not None:
                laid.plan.to_params()

    def _choose_ahead(self, note: ChatAhead) -> None:
        """Choose a history chat's chunks in a worker thread from now, for its task to take (`_choice`): the choice
        (the question's pass, the bounds, the selection: ~1.9 ms on an H100 host, 2026-12-06) then runs while the
        ingress finishes the request and sends it, not after."""
        key = _choice_key(note)
        if key in self._choices:
            return
        began = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(None, self._histories.choose, *key)
        self._choices[key] = (began, future)
        while len(self._choices) > _KEPT_CHOICES:  # a note whose chat never came
            _, (_, dropped) = self._choices.popitem(last=False)
            dropped.add_done_callback(_consumed)

    async def _choice(self, task: ChatTask) -> tuple[Choice, float]:
        """History mode's choice for `task`, and how long before its arrival it began (0: chosen now): the one begun
        ahead for the same question, history and budget where it succeeded, else chosen now in a worker thread."""
        key = _choice_key(task)
        arrived, pending = time.perf_counter(), self._choices.pop(key, None)
        if pending is not None:
            began, ahead = pending
            try:
                return await ahead, (arrived - began) * 1000
            except Exception:  # noqa: BLE001 - chosen again below, where the error (if it stays) reaches the chat
                log.warning("a history choice begun ahead failed; choosing again", exc_info=True)
        return await asyncio.to_thread(self._histories.choose, *key), 0.0

    async def chat(self, task: ChatTask) -> AsyncIterator[dict[str, Any]]:
        """Text deltas (`{"delta": ...}`) then one final `{"done": True, "finish_reason", "usage"}`, which carries the
        last piece's delta too (with `max_tokens=1`, as memory lookups often ask, the only event); the usage's
        `timeline` holds wall-clock times (s) of the task's arrival, the engine's start and its first token, so the
        ingress can split what lies between its own clock and the engine's (one host, one clock), and the CPU time
        the layout took (against its wall time: what it spent computing, not waiting for the GIL or a core)."""
        arrived, arrived_cpu = time.time(), time.thread_time()
        laid, chunks, chosen = await self._prompt_of(task)
        prompt = TokensPrompt(prompt_token_ids=laid.token_ids, cache_salt=laid.cache_salt)
        params = _sampling(task, laid)
        engine_start, layout_cpu = time.time(), time.thread_time() - arrived_cpu
        started, ttft, completion, cached, report, finish = time.monotonic(), None, 0, 0, None, None
        first, stats = 0.0, None  # vLLM's request timestamps are on this clock too (`engine_phases`)
        last: dict[str, Any] = {}  # the final piece's text rides on the done event: one streamed message fewer
        async for out in self._engine.generate(prompt, params, f"chat-{uuid.uuid4().hex}"):
            piece = out.outputs[0]
            completion += len(piece.token_ids)
            cached = out.num_cached_tokens or cached
            if ttft is None and piece.token_ids:
                first = time.monotonic()
                ttft = (first - started) * 1000
            event: dict[str, Any] = {}
            if task.logprobs is not None and piece.logprobs:  # every token's, even one whose text is not out yet
                event = {
                    "delta": piece.text,
                    "logprobs": _token_logprobs(piece.token_ids, piece.logprobs, task.logprobs),
                }
            elif piece.text:
                event = {"delta": piece.text}
            if out.finished:
                finish, stats = piece.finish_reason, out.metrics
                report = (out.kv_transfer_params or {}).get("inferscale")
                last = event
            elif event:
                yield event
        injected = int((report or {}).get("injected_tokens", 0))
        load_failed = int((report or {}).get("load_failed_tokens", 0))  # recomputed by the engine instead
        usage = {
            "prompt_tokens": len(laid.token_ids),
            "completion_tokens": completion,
            "total_tokens": len(laid.token_ids) + completion,
            "memory_tokens": laid.memory_tokens,
            "history_chunks": len(chunks),
            "history_choose_ms": chosen,
            "recomputed_tokens": laid.recomputed_tokens,
            "injected_tokens": injected,
            "load_failed_tokens": load_failed,
            "prefix_cached_tokens": max(0, cached - injected - load_failed),
            "prefilled_tokens": len(laid.token_ids) - cached + load_failed,
            "engine_ttft_ms": round(ttft or 0.0, 3),
            "engine_phases_ms": engine_phases(stats, started, first),
            "memory_fallback": (report or {}).get("fallback"),
            "timeline": {
                "arrived": arrived,
                "engine_start": engine_start,
                "first_token": engine_start + (ttft or 0.0) / 1000,
                "layout_cpu_s": layout_cpu,  # of the layout's wall time, this thread's own CPU time
            },
        }
        yield {**last, "done": True, "finish_reason": finish or "stop", "usage": usage}

    async def _prompt_of(self, task: ChatTask) -> tuple[LaidOutPrompt, Sequence[MemoryItem], dict[str, float] | None]:
        """The chat's prompt laid out (history mode's chunks chosen first), with the chosen chunks and the choice's
        timings; a prompt the model's context cannot hold with the answer is a `ValueError`."""
        if (
            task.mode in ("inject", "history") and self._tier_root is not None
        ):  # disk-tier facts start loading before the engine sees them
            self._prefetch(task.tenant_id, [f.record_id for f in task.facts if f.record_id])
        mode = "inject" if task.mode == "history" else task.mode  # history mode injects its chosen chunks
        frame = (
            (self.frame_id, self.prefix_ids) if mode == "inject" and await self.ensure_frame(task.tenant_id) else None
        )
        split = self._split(task)
        chosen: dict[str, float] | None = None
        chunks: Sequence[MemoryItem] = ()  # history mode's chosen chunks
        if task.mode == "history":
            if task.history_id is None:
                raise ValueError("history mode needs a history: none is written for this memory")
            called = time.perf_counter()
            choice, ahead_ms = await self._choice(task)
            # `call`: the choice as this loop waited for it (the worker thread's start and the way back included);
            # `ahead`: how long before the task came the choice began, from its note
            call_ms = round((time.perf_counter() - called) * 1000, 3)
            chunks, chosen = choice.items, {**choice.timings(), "call": call_ms, "ahead": round(ahead_ms, 3)}
            prefix_ids, query_ids = split
            # retrieved facts follow the history's chunks, in the chat's order, nearest the question; none recomputed
            items = [*chunks, *self._items(task.tenant_id, task.facts)]
            laid = lay_out(mode, task.tenant_id, task.version, prefix_ids, items, query_ids, frame)
        else:
            laid = self._lay_out(task, mode, split, frame)
            if task.mode in ("inject", "prompt") and task.facts:
                self._last[task.tenant_id] = replace(task, messages=())  # its facts are what a warm-up lays out
                self._last.move_to_end(task.tenant_id)
                while len(self._last) > _KEPT_LAST:
                    self._last.popitem(last=False)
        if len(laid.token_ids) + task.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(laid.token_ids)} tokens plus max_tokens {task.max_tokens} exceeds "
                f"the model's context of {self.max_model_len}"
            )
        return laid, chunks, chosen

    def _prefetch(self, tenant_id: str, record_ids: list[str]) -> None:
        """Advise the kernel to read the disk-tier files of these records (advisory: unknown records are skipped)."""
        try:
            stamps = [stamp for stamp, _ in self._store.checked_infos(tenant_id, record_ids)]
        except (KVCoreError, OSError):
            return
        advise_willneed(tier_files(self._tier_root, [tier_key(tenant_id, r, s) for r, s in zip(record_ids, stamps)]))

    async def check_health(self) -> None:
        """Raises when the engine process has died (Serve then replaces the replica)."""
        await self._engine.check_health()

    async def profile(self, on: bool) -> None:
        """Start or stop vLLM's own torch profiler (its traces go to the engine's `profiler_config` folder), so
        a benchmark can split a step's device time by kernel. Raises RuntimeError when the engine was built
        without a profiler."""
        if self._engine.vllm_config.profiler_config.profiler is None:
            raise RuntimeError("this engine was built without a profiler (llm.engine_kwargs.profiler_config)")
        await (self._engine.start_profile() if on else self._engine.stop_profile())

    def shutdown(self) -> None:
        self._engine.shutdown()

    async def _written_record(self, tenant_id: str, record_id: str, timeout_s: float = 10.0) -> FactKV:
        """A captured record, waiting for the worker process to finish writing it (it may trail the output)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._store.get(tenant_id, record_id)
            except (KVCoreError, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def _frame_ready(self, tenant_id: str) -> bool:
        try:
            return self._store.info(tenant_id, self.frame_id).token_ids == self.prefix_ids
        except (KVCoreError, OSError):
            return False

    def _split(self, task: ChatTask) -> tuple[Sequence[int], list[int]]:
        """(tokens before the memory region, tokens after it): a chat's as tokenized ahead (`prepare`), if it was."""
        if task.prompt is not None:  # a text completion: the memory region (with its frame) only when there are facts
            prefix = self.prefix_ids if task.facts and task.mode != "off" else ()
            return prefix, self.tokenizer.encode(task.prompt, add_special_tokens=not prefix)
        ahead = self._splits.pop(task.messages, None)
        return ahead if ahead is not None else self._split_messages(task.messages)

    def _split_messages(self, messages: tuple[tuple[str, str], ...]) -> tuple[Sequence[int], list[int]]:
        """A lone question is the only text tokenized, the frame around it is known; other conversations go through
        the chat template."""
        question = single_question(messages)
        if question is not None:
            return self.prefix_ids, self._chat_frame.query_ids(self.tokenizer, question)
        return split_chat(self.tokenizer, self._system_prompt, message_dicts(messages))

    def _lay_out(
        self,
        task: ChatTask,
        mode: Mode,
        split: tuple[Sequence[int], list[int]],
        frame: tuple[str, Sequence[int]] | None,
    ) -> LaidOutPrompt:
        """The prompt of a chat with retrieved facts (every mode but history)."""
        prefix_ids, query_ids = split
        items = self._items(task.tenant_id, task.facts)
        return lay_out(mode, task.tenant_id, task.version, prefix_ids, items, query_ids, frame, task.recompute)

    def _items(self, tenant_id: str, facts: Sequence[RetrievedFact]) -> list[MemoryItem]:
        """Each fact's tokens: its record's (headers read once, cached by the store) when it has one, else its
        text tokenized the way encoding does."""
        with_records = [f.record_id for f in facts if f.record_id is not None]
        tokens: dict[str, tuple[int, ...]] = {}
        if with_records:
            try:
                tokens = {
                    r: info.token_ids
                    for r, (_, info) in zip(with_records, self._store.checked_infos(tenant_id, with_records))
                }
            except (KVCoreError, OSError):
                tokens = self._record_tokens_one_by_one(tenant_id, with_records)
        items = []
        for fact in facts:
            if fact.record_id is not None and fact.record_id in tokens:
                items.append(MemoryItem(fact.fact_id, tokens[fact.record_id], fact.record_id, fact.score))
            else:
                ids = self.tokenizer.encode(Fact(fact.fact_id, fact.text, 0).render(), add_special_tokens=False)
                items.append(MemoryItem(fact.fact_id, tuple(ids)))
        return items

    def _record_tokens_one_by_one(self, tenant_id: str, record_ids: list[str]) -> dict[str, tuple[int, ...]]:
        """Headers of the records still there (one was removed since retrieval): the others are pasted."""
        found = {}
        for record_id in record_ids:
            try:
                found[record_id] = self._store.info(tenant_id, record_id).token_ids
            except (KVCoreError, OSError):
                log.info("a retrieved fact's record is gone; pasting its text")
        return found


def _sampling(task: ChatTask, laid: LaidOutPrompt) -> SamplingParams:
    """The chat's sampling, its memory plan riding along for the connector."""
    params = SamplingParams(
        max_tokens=task.max_tokens,
        temperature=task.temperature,
        top_p=task.top_p,
        seed=task.seed,
        stop=list(task.stop) if task.stop else None,
        output_kind=RequestOutputKind.DELTA,
        logprobs=task.logprobs,
        skip_clone=True,
    )  # this request's own: vLLM's deep copy of it (and its plan) cost ~0.2 ms
    if laid.plan is not None:
        params.extra_args = {"kv_transfer_params": laid.plan.to_params()}
    return params


def _token_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]], top: int) -> list[list[Any]]:
    """[token text, log probability, [[alternative text, log probability], ...]] per new token: the `top`
    most likely alternatives by vLLM's rank (the sampled token is in vLLM's dict even when it ranks lower)."""
    out = []
    for token_id, ranked in zip(token_ids, logprobs):
        chosen = ranked[token_id]
        best = sorted(ranked.values(), key=lambda entry: entry.rank)[:top]
        out.append(
            [chosen.decoded_token or "", chosen.logprob, [[entry.decoded_token or "", entry.logprob] for entry in best]]
        )
    return out


def _consumed(future: asyncio.Future) -> None:
    """A choice nobody took: its error (if any) is read, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
