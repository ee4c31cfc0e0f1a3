"""Generation: split a batch into calls, route each to the least busy admitted server, and retry a call
elsewhere when its server fails or is quarantined while it runs."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import torch

from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.checks import group_by_sampling
from miles_rollout.engines.sglang.adapters import AdapterServing
from miles_rollout.engines.sglang.router import Router, Slot
from miles_rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class _Quarantined(Exception):
    """The slot serving a call was quarantined while the call was in flight: retry elsewhere."""


def _version_number(label: str | None) -> int:
    return int(label) if label and label.isdigit() else 0


def _token_versions(spans: list[dict], num_output: int) -> list[int]:
    """One version per output id from SGLang's `weight_versions` spans (`start`..`end` of the output ids each
    version generated); empty when the spans do not cover the output exactly (`versions_per_token` then falls
    back to the first version)."""
    out: list[int] = []
    for span in spans:
        if int(span.get("start", -1)) != len(out):
            return []
        out += [_version_number(span.get("version"))] * max(int(span.get("end", 0)) - len(out), 0)
    return out if len(out) == num_output else []


class Dispatcher:
    """Sends `/generate` calls through the router."""

    def __init__(self, config: SGLangEngineConfig, slots: list[Slot], router: Router) -> None:
        self.config, self.slots, self.router = config, slots, router
        # abort(): ids no server may hold yet (a call waiting for a slot, e.g. held by a pause): such a call ends
        # aborted once it gets its slot, instead of running to its end
        self._aborted: set[str] = set()
        self._waiting: set[str] = set()  # ids of the calls this dispatcher runs now
        self.adapters: AdapterServing | None = None  # sync.lora: adapter: calls name the newest adapter

    def _client(self, timeout: float) -> httpx.AsyncClient:
        """A client for one call. Servers on plain http (launched ones, on loopback) need no TLS: the client skips
        loading the CA bundle, which cost more than the rest of a call (a profile of the demo: 15 % of the rollout
        actor's time); an https server keeps full certificate checks."""
        plain = all(slot.url.startswith("http://") for slot in self.slots)
        return httpx.AsyncClient(timeout=timeout, verify=False) if plain else httpx.AsyncClient(timeout=timeout)

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Split into calls of at most `max_requests_per_call` (one sampling setting each), run concurrently."""
        size = self.config.max_requests_per_call
        calls = [
            (sampling, indices[i : i + size])
            for sampling, indices in group_by_sampling(requests).items()
            for i in range(0, len(indices), size)
        ]
        results: list[GenerateResult | None] = [None] * len(requests)
        async with self._client(self.config.request_timeout_s) as client:
            answers = await asyncio.gather(*(self._dispatch(client, s, [requests[i] for i in c]) for s, c in calls))
        for (_, chunk), outs in zip(calls, answers, strict=True):
            for i, out in zip(chunk, outs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    async def _dispatch(
        self, client: httpx.AsyncClient, sampling: SamplingParams, requests: list[GenerateRequest]
    ) -> list[GenerateResult]:
        """Run one call; if its server fails or is quarantined meanwhile, run it again on another."""
        max_attempts = len(self.slots) * (self.config.max_restarts + 2)
        ids = {r.request_id for r in requests}
        self._waiting |= ids
        try:
            return await self._attempts(client, sampling, requests, max_attempts)
        finally:
            self._waiting -= ids
            self._aborted -= ids

    async def _attempts(
        self, client: httpx.AsyncClient, sampling: SamplingParams, requests: list[GenerateRequest], max_attempts: int
    ) -> list[GenerateResult]:
        for _attempt in range(max_attempts):
            slot = await self.router.acquire(self.config.startup_timeout_s + 60)
            if all(r.request_id in self._aborted for r in requests):  # aborted while it waited: never sent
                self.router.release(slot)
                return [GenerateResult(r.request_id, [], [], FinishReason.ABORT, []) for r in requests]
            try:
                if self.adapters is None:
                    results = await self._generate_on(
                        client, slot, sampling, requests, routed=self.config.routed_experts
                    )
                else:
                    with self.adapters.checkout() as (name, version):
                        results = await self._generate_on(
                            client, slot, sampling, requests, name, version, routed=self.config.routed_experts
                        )
                slot.served += 1
                slot.answered_at = time.monotonic()
                return results
            except httpx.TransportError as exc:  # connection refused or reset: the server is gone
                self.router.quarantine(slot, f"/generate failed: {type(exc).__name__}: {exc}")
            except _Quarantined:
                pass
            finally:
                self.router.release(slot)
                if slot.stale_cache and slot.outstanding == 0 and slot.admitted:
                    await self._flush_when_idle(client, slot)
        raise RuntimeError(f"sglang engine: a generate call failed {max_attempts} times on every server")

    async def abort(self, request_ids: list[str]) -> None:
        """SGLang's /abort_request for each id on every admitted server (a server that does not hold it ignores it);
        the aborted requests return what they generated so far with finish reason `abort`. A call still waiting for
        a server (held by a pause) ends aborted when it gets one."""
        self._aborted.update(set(request_ids) & self._waiting)  # only ids a call still holds: the set stays small
        async with self._client(30) as client:
            calls = [
                client.post(f"{slot.url}/abort_request", json={"rid": rid})
                for slot in self.slots
                if slot.admitted
                for rid in request_ids
            ]
            for answer in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(answer, httpx.Response) and answer.status_code >= 400:
                    raise RuntimeError(
                        f"sglang engine: /abort_request answered {answer.status_code}: {answer.text[:300]}"
                    )

    @staticmethod
    async def _flush_when_idle(client: httpx.AsyncClient, slot: Slot) -> None:
        """Drop prefix-cache entries of an older weight version once nothing runs on the server."""
        try:
            response = await client.post(f"{slot.url}/flush_cache", timeout=30)
            slot.stale_cache = response.status_code != 200
        except httpx.TransportError:
            pass  # the health checks deal with a server that went away

    @staticmethod
    async def _generate_on(
        client: httpx.AsyncClient,
        slot: Slot,
        sampling: SamplingParams,
        requests: list[GenerateRequest],
        adapter: str | None = None,
        adapter_version: int | None = None,
        routed: bool = False,
    ) -> list[GenerateResult]:
        """One `/generate` call. With `adapter` (its version `adapter_version`), every request runs under that LoRA
        adapter, so every token is of that version whatever the servers' own weight version says. With `routed`,
        each result carries the experts every position was routed to (a mixture of experts)."""
        body: dict = {
            "input_ids": [r.input_ids for r in requests],
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_new_tokens": sampling.max_new_tokens,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
            },
            "return_logprob": True,
            "rid": [r.request_id for r in requests],  # unique per EngineClient: what abort_requests names
        }
        if adapter is not None:
            body["lora_path"] = [adapter] * len(requests)
        if routed:
            body["return_routed_experts"] = True
        call = asyncio.ensure_future(client.post(f"{slot.url}/generate", json=body))
        while not call.done():
            await asyncio.wait({call}, timeout=0.2)
            if not slot.admitted and not call.done():
                call.cancel()  # its results would come from a server we no longer trust
                raise _Quarantined
        response = call.result()
        if response.status_code >= 400:
            raise RuntimeError(
                f"sglang engine {slot.url}/generate answered {response.status_code}: {response.text[:500]}"
            )
        results = []
        for request, out in zip(requests, response.json(), strict=True):
            meta = out["meta_info"]
            spans = meta.get("weight_versions") or []
            if adapter_version is not None:  # the adapter is the version: one span over every token
                spans = [{"start": 0, "end": len(out["output_ids"]), "version": str(adapter_version)}]
            versions = list(dict.fromkeys(_version_number(v.get("version")) for v in spans))
            results.append(
                GenerateResult(
                    request_id=request.request_id,
                    output_ids=list(out["output_ids"]),
                    output_logprobs=[float(lp) for lp, _, _ in meta["output_token_logprobs"]],
                    finish_reason=_FINISH[meta["finish_reason"]["type"]],
                    weight_versions=versions or [_version_number(meta.get("weight_version"))],
                    token_versions=_token_versions(spans, len(out["output_ids"])),
                    routed_experts=_routed_experts(meta, len(request.input_ids) + len(out["output_ids"]))
                    if routed
                    else None,
                )
            )
        return results


def _routed_experts(meta: dict, num_tokens: int) -> torch.Tensor:
    """SGLang's `routed_experts` (base64 of int32 [positions, layers, top_k] over every token but the last) as an
    int16 tensor [positions, layers × top_k] (the trainer's routers know top_k); ValueError when the server returned
    none (started without --enable-return-routed-experts)."""
    encoded = meta.get("routed_experts")
    if not encoded:
        raise ValueError(
            "sglang engine: the server returned no routed experts (rollout.engine.routed_experts needs a mixture of "
            "experts model and the server flag --enable-return-routed-experts, which miles adds)"
        )
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    positions = max(num_tokens - 1, 1)
    if flat.numel() % positions:
        raise ValueError(f"sglang engine: {flat.numel()} routed experts do not divide over {positions} positions")
    return flat.view(positions, -1).to(torch.int16)
