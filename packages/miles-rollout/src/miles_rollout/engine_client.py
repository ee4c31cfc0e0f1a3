"""EngineClient: token-in/token-out generation for rollout code, one request at a time, batched underneath.

Generate functions and the episode runner call `await client.generate(ids, sampling)` per turn, each episode on
its own; the client gathers the calls made in the same turn of the event loop (every episode whose environment
has answered) into one `engine.generate` batch. An engine that decodes one batch at a time (`hf`, a `LimitsCalls`
with `max_concurrent_calls = 1`) gets the calls that arrive while it decodes as the next batch; an engine that
serves concurrent calls (SGLang) gets each batch at once.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from miles_rollout.episode import check_ids
from miles_rollout.protocol import AbortsRequests, RolloutEngine, call_limit
from miles_rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams

MAX_CONTINUATIONS = 16  # a partial rollout is continued across at most this many weight pushes, then dropped


def join_parts(parts: list[GenerateResult]) -> GenerateResult:
    """One result from a request and its continuations: ids, logprobs and per-id versions in order, every
    version any part ran under, and the last part's finish reason."""
    versions: list[int] = []
    for part in parts:
        versions += [v for v in part.weight_versions if v not in versions]
    return GenerateResult(
        request_id=parts[0].request_id,
        output_ids=[i for part in parts for i in part.output_ids],
        output_logprobs=[lp for part in parts for lp in part.output_logprobs],
        finish_reason=parts[-1].finish_reason,
        weight_versions=versions,
        token_versions=[v for part in parts for v in part.versions_per_token()],
        routed_experts=parts[-1].routed_experts,  # a continuation's input is every id before it: it covers them all
    )


class EngineClient:
    """The engine as rollout code sees it. `vocab_size`: ids at or above it are refused before they reach it."""

    def __init__(
        self,
        engine: RolloutEngine,
        vocab_size: int | None = None,
        batch_calls: bool = True,
        continue_aborted: bool = False,
    ) -> None:
        """`batch_calls=False`: every request is its own `engine.generate` call, answered as soon as it is done (for
        an engine that serves concurrent calls and batches them itself, as SGLang does: dynamic sampling judges each
        group when its samples are in, not when the slowest request of the step is).

        `continue_aborted` (`rollout.partial_rollouts`): a request the engine aborted for a weight push (pause mode
        `abort`) is sent again as prompt + what it generated so far, for the tokens it still had to generate; the
        engine takes it once the push is done, so the rest is generated under the new weights. The answer joins the
        parts: their ids, logprobs and the version of every id. Requests ended by `abort_outstanding` stay ended, and
        so does a continuation the engine aborts before its first id (a request it refuses)."""
        self.engine = engine
        self.continue_aborted = continue_aborted
        self.num_continued = 0  # continuation requests sent (partial rollouts)
        self.vocab_size = vocab_size
        self.batch_calls = batch_calls
        self.num_calls = 0  # engine.generate calls made (batches), for tests and metrics
        limit = call_limit(engine)
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._collector: asyncio.Task | None = None  # the task that will take `_pending` as its batch
        self._tasks: set[asyncio.Task] = set()
        self._count = 0
        self._prefix = uuid.uuid4().hex[:8]  # request ids unique across clients of one engine (SGLang's rid)
        self._in_flight: dict[str, asyncio.Future] = {}  # sent to the engine, not answered yet
        self.num_aborted = 0  # requests ended by abort_outstanding()
        self.closed = False  # after abort_outstanding(): new requests end at once, aborted (an episode's next turn)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str = "", multimodal: dict | None = None
    ) -> GenerateResult:
        """The engine's result for `input_ids` (its output ids, their logprobs, the finish reason, the weight
        versions it ran). ValueError, naming the offending id, for ids outside the vocabulary. `multimodal`: the
        processor's inputs for a prompt with images (`PromptEncoder.inputs`)."""
        where = f"generate: request {request_id or self._count + 1}: input_ids"
        check_ids(input_ids, self.vocab_size, where)
        if not input_ids:
            raise ValueError(f"{where} is empty")
        result = await self._request(input_ids, sampling, request_id, multimodal)
        parts = [result]
        made = len(result.output_ids)
        while (
            self.continue_aborted
            and result.finish_reason == FinishReason.ABORT
            and not self.closed  # abort_outstanding ended it: the step no longer wants it
            and made < sampling.max_new_tokens
            and len(parts) <= MAX_CONTINUATIONS
        ):
            self.num_continued += 1
            rest = replace(sampling, max_new_tokens=sampling.max_new_tokens - made)
            done = [i for part in parts for i in part.output_ids]
            result = await self._request(list(input_ids) + done, rest, f"{request_id}+{len(parts)}", multimodal)
            parts.append(result)
            made += len(result.output_ids)
            if not result.output_ids:  # aborted before its first id: not a push's doing (a refused request)
                break
        joined = parts[0] if len(parts) == 1 else join_parts(parts)
        if joined.finish_reason == FinishReason.ABORT and made >= sampling.max_new_tokens and self.continue_aborted:
            joined.finish_reason = FinishReason.LENGTH  # aborted with every id it could have: it is complete
        return joined

    async def _request(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str, multimodal: dict | None = None
    ) -> GenerateResult:
        self._count += 1
        # unique whatever the caller names it (SGLang's rid; abort_outstanding finds requests by it)
        rid = f"{self._prefix}:{self._count}:{request_id}" if request_id else f"{self._prefix}:{self._count}"
        request = GenerateRequest(list(input_ids), sampling, request_id=rid, multimodal=multimodal)
        if self.closed:
            self.num_aborted += 1
            return GenerateResult(request.request_id, [], [], FinishReason.ABORT, [])
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if not self.batch_calls:
            return await self._alone(request, future)
        self._pending.append((request, future))
        if self._collector is None:
            self._collector = asyncio.ensure_future(self._call())
            self._tasks.add(self._collector)
            self._collector.add_done_callback(self._tasks.discard)
        return await future

    async def _alone(self, request: GenerateRequest, future: asyncio.Future) -> GenerateResult:
        """One request as its own engine call; `future` marks it answered (or aborted) for abort_outstanding."""
        self._in_flight[request.request_id] = future
        try:
            if self._slots is not None:
                async with self._slots:
                    results = await self.engine.generate([request])
            else:
                results = await self.engine.generate([request])
            self.num_calls += 1
            if len(results) != 1:
                raise RuntimeError(f"{self.engine.name} engine: {len(results)} results for 1 request")
            return results[0]
        finally:
            self._in_flight.pop(request.request_id, None)
            if not future.done():
                future.set_result(None)

    async def _call(self) -> None:
        batch: list[tuple[GenerateRequest, asyncio.Future]] = []
        if self._slots is not None:
            await self._slots.acquire()
        try:
            await asyncio.sleep(0)  # let the other coroutines that are ready submit their turn
            batch, self._pending, self._collector = self._pending, [], None
            self._in_flight.update((request.request_id, future) for request, future in batch)
            results = await self.engine.generate([request for request, _ in batch])
            self.num_calls += 1
            if len(results) != len(batch):
                raise RuntimeError(f"{self.engine.name} engine: {len(results)} results for {len(batch)} requests")
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        except BaseException as exc:  # every caller of the batch gets the engine's error; none waits forever
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            for request, _ in batch:
                self._in_flight.pop(request.request_id, None)
            if self._collector is asyncio.current_task():  # cancelled before it took its batch
                self._collector = None
            if self._slots is not None:
                self._slots.release()

    async def abort_outstanding(self) -> int:
        """End every request not answered yet: those still waiting for a batch at once (no output, finish reason
        `abort`), those in the engine where it is an `AbortsRequests` (SGLang's /abort_request, the hf engine's
        per-request flag; they return what they generated so far, finish reason `abort`); and close the client: a
        request made afterwards (an episode's next turn) ends at once, aborted. A request still on its way to a
        server when the abort is sent may run to its end. Returns how many requests were ended."""
        self.closed = True
        waiting, self._pending = self._pending, []
        for request, future in waiting:
            if not future.done():
                future.set_result(GenerateResult(request.request_id, [], [], FinishReason.ABORT, []))
        running: list[str] = []
        if isinstance(self.engine, AbortsRequests):
            running = [rid for rid, future in self._in_flight.items() if not future.done()]
            if running:
                await self.engine.abort_requests(running)
        self.num_aborted += len(waiting) + len(running)
        return len(waiting) + len(running)
