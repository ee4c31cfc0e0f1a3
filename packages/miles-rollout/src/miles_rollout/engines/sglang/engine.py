"""`sglang` engine: generation, pauses and weight updates through SGLang's native HTTP API.

Requests go through a `Router` (least outstanding requests over the admitted servers, health checks,
quarantine, re-admission). Weights arrive through any miles-sync transport:

- `disk`: `/update_weights_from_disk` on the published folder;
- `tensor`: `/begin_weight_update` → `/update_weights_from_tensor` per bucket (shared-memory handles,
  CUDA IPC on GPU) → `/end_weight_update`;
- `broadcast`: `/init_weights_update_group` on every server, then per bucket
  `/update_weights_from_distributed` while the trainer broadcasts; this process joins the group too
  (rank 1) and receives a copy, which is what the equality check and recovery need.

After every load the engine asks each server for its per-tensor checksums (`/weights_checker`) and
compares them with checksums computed from the published HF tensors, so equality is bit-exact without
reading weights back. The engine keeps the tensors of the current version: a server that is restarted
after a crash, or re-admitted after a failed health check, gets them (`/update_weights_from_tensor`)
and is verified before it serves again.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from miles_rollout.config import PauseMode, SGLangEngineConfig
from miles_rollout.engines.checkpoint import engine_dtype, tied_embeddings
from miles_rollout.engines.checks import check_names, group_by_sampling, held_fingerprint
from miles_rollout.engines.sglang.layout import expected_checksums
from miles_rollout.engines.sglang.router import Router, Slot
from miles_rollout.engines.sglang.server import EngineStartError, SGLangServer
from miles_rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_sync import NamedTensor, WeightHandle, read_buckets, without_tied_head

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class WeightMismatchError(RuntimeError):
    """An engine holds other weights than the ones published."""


class _Quarantined(Exception):
    """The slot serving a call was quarantined while the call was in flight: retry elsewhere."""


def _version_number(label: str | None) -> int:
    return int(label) if label and label.isdigit() else 0


class SGLangEngine:
    """One or more SGLang servers behind one `RolloutEngine`."""

    name = "sglang"

    def __init__(self, model_path: str | Path, config: SGLangEngineConfig, seed: int = 0) -> None:
        self.config = config
        self.model_path = Path(model_path)
        self.seed = seed
        self.slots: list[Slot] = []
        self.router: Router | None = None
        self._busy = threading.Lock()  # weight updates vs health checks and recoveries
        self._dtype_name = engine_dtype(config.dtype, model_path)
        self.param_dtype = getattr(torch, self._dtype_name)
        self._tied = tied_embeddings(model_path)
        self._wire_dtype: str | None = None  # of the last push: the dtype the weight check compares in
        self._client = httpx.Client(timeout=config.request_timeout_s)
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="miles-sglang-"))
        try:
            self._start()
        except BaseException:
            self.shutdown()  # never leave launched servers behind a failed start
            raise

    # ---- start-up -------------------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        if config.urls:
            self.slots = [Slot(i, url.rstrip("/")) for i, url in enumerate(config.urls)]
        else:
            for i in range(config.num_engines):
                server = self._launch(i)
                self.slots.append(Slot(i, server.url, server))
            for slot in self.slots:
                assert slot.server is not None
                slot.server.wait_ready(config.startup_timeout_s)
        for slot in self.slots:
            self._check_reachable(slot.url)
        self._weight_version = 0
        self._pause_mode: PauseMode | None = None
        # A checkpoint may still carry the head of a tied model; SGLang skips it, and so does the check.
        self._set_current(list(without_tied_head(_folder_tensors(self.model_path), self._tied)))
        if config.verify_weights:
            for slot in self.slots:
                self._verify(slot)
        self.router = Router(self.slots, self._recover, config.health_interval_s, config.health_timeout_s, self._busy)

    def _launch(self, index: int) -> SGLangServer:
        return SGLangServer(self.model_path, self.config, self._dtype_name, index, self._log_dir, self.seed)

    def _check_reachable(self, url: str) -> None:
        try:
            self._client.get(f"{url}/model_info", timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineStartError(f"sglang engine at {url} is unreachable: {exc}") from None

    def _post(self, url: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        response = self._client.post(f"{url}{path}", json=body or {}, timeout=timeout or self.config.request_timeout_s)
        if response.status_code >= 400:
            raise RuntimeError(f"sglang engine {url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}

    @property
    def urls(self) -> list[str]:
        """URLs of the admitted servers."""
        return [s.url for s in self.slots if s.admitted]

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def broadcast_ranks(self) -> int:
        """Ranks this engine takes in a `broadcast` weight group: itself (the verifier) and every server rank."""
        return 1 + sum(self._tp_size(s) for s in self.slots)

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Split into calls of at most `max_requests_per_call`, each routed to the least busy server."""
        size = self.config.max_requests_per_call
        calls = [
            (sampling, indices[i : i + size])
            for sampling, indices in group_by_sampling(requests).items()
            for i in range(0, len(indices), size)
        ]
        results: list[GenerateResult | None] = [None] * len(requests)
        async with httpx.AsyncClient(timeout=self.config.request_timeout_s) as client:
            answers = await asyncio.gather(*(self._dispatch(client, s, [requests[i] for i in c]) for s, c in calls))
        for (_, chunk), outs in zip(calls, answers, strict=True):
            for i, out in zip(chunk, outs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    async def _dispatch(
        self, client: httpx.AsyncClient, sampling: SamplingParams, requests: list[GenerateRequest]
    ) -> list[GenerateResult]:
        """Run one call; if its server fails or is quarantined meanwhile, run it again on another."""
        assert self.router is not None
        max_attempts = len(self.slots) * (self.config.max_restarts + 2)
        for _attempt in range(max_attempts):
            slot = await self.router.acquire(self.config.startup_timeout_s + 60)
            try:
                results = await self._generate_on(client, slot, sampling, requests)
                slot.served += 1
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

    async def _flush_when_idle(self, client: httpx.AsyncClient, slot: Slot) -> None:
        """Drop prefix-cache entries of an older weight version once nothing runs on the server."""
        try:
            response = await client.post(f"{slot.url}/flush_cache", timeout=30)
            slot.stale_cache = response.status_code != 200
        except httpx.TransportError:
            pass  # the health checks deal with a server that went away

    async def _generate_on(
        self, client: httpx.AsyncClient, slot: Slot, sampling: SamplingParams, requests: list[GenerateRequest]
    ) -> list[GenerateResult]:
        body = {
            "input_ids": [r.input_ids for r in requests],
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_new_tokens": sampling.max_new_tokens,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": sampling.ignore_eos,
            },
            "return_logprob": True,
        }
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
        outs = response.json()
        results = []
        for request, out in zip(requests, outs, strict=True):
            meta = out["meta_info"]
            versions = [_version_number(v.get("version")) for v in meta.get("weight_versions") or []]
            results.append(
                GenerateResult(
                    request_id=request.request_id,
                    output_ids=list(out["output_ids"]),
                    output_logprobs=[float(lp) for lp, _, _ in meta["output_token_logprobs"]],
                    finish_reason=_FINISH[meta["finish_reason"]["type"]],
                    weight_versions=versions or [_version_number(meta.get("weight_version"))],
                )
            )
        return results

    # ---- pause, resume, health ------------------------------------------------------------------

    def _each_live(self, path: str, body: dict | None = None) -> None:
        """POST to every server that may be running, quarantined ones included (a paused server must get its
        resume). A failure quarantines an admitted server and is ignored for one already quarantined."""
        assert self.router is not None
        for slot in self.slots:
            if slot.server is not None and not slot.server.alive():
                continue
            try:
                self._post(slot.url, path, body, timeout=60)
            except (httpx.HTTPError, RuntimeError) as exc:
                if slot.admitted:
                    if not isinstance(exc, httpx.TransportError):
                        raise
                    self.router.quarantine(slot, f"{path} failed: {type(exc).__name__}")

    async def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop new calls; pause (with `mode`) the servers that have requests in flight.

        A server with nothing in flight is left running: a load then waits for anything SGLang itself has
        running (its health probe), and its prefix cache can be flushed.
        """
        assert self.router is not None
        busy = [s for s in self.slots if s.outstanding > 0 and (s.server is None or s.server.alive())]
        self.router.hold(wait_for_probe=bool(busy))
        self._pause_mode = mode
        for slot in busy:
            try:
                self._post(slot.url, "/pause_generation", {"mode": mode}, timeout=60)
                slot.paused = True
            except httpx.TransportError as exc:
                self.router.quarantine(slot, f"/pause_generation failed: {type(exc).__name__}")

    async def resume(self) -> None:
        assert self.router is not None
        for slot in [s for s in self.slots if s.paused]:
            slot.paused = False
            try:
                self._post(slot.url, "/continue_generation", timeout=60)
            except (httpx.HTTPError, RuntimeError) as exc:
                if slot.admitted:
                    self.router.quarantine(slot, f"/continue_generation failed: {exc}")
        self._pause_mode = None
        self.router.release_hold()

    async def flush_cache(self) -> None:
        self._each_live("/flush_cache")

    async def health(self) -> bool:
        """True when every server is admitted and answers `/health_generate`."""
        try:
            return all(
                s.admitted and self._client.get(f"{s.url}/health_generate", timeout=30).status_code == 200
                for s in self.slots
            )
        except httpx.HTTPError:
            return False

    # ---- weights --------------------------------------------------------------------------------

    def _set_current(self, tensors: list[NamedTensor]) -> None:
        """The HF tensors every server must hold now and their fingerprint (checksums: on first use)."""
        self._current = tensors
        self._names = {name for name, _ in tensors}
        self._expected_cache: dict[str, str] | None = None
        self._fingerprint = held_fingerprint(tensors, self._dtype_name, self._wire_dtype)

    @property
    def _expected(self) -> dict[str, str]:
        """Per-tensor checksums of the current weights in SGLang's layout (what /weights_checker reports)."""
        if self._expected_cache is None:
            self._expected_cache = expected_checksums(self._current, self.param_dtype)
        return self._expected_cache

    def receive(self, handle: WeightHandle) -> str:
        loaders = {"disk": self._receive_disk, "tensor": self._receive_tensor, "broadcast": self._receive_broadcast}
        if handle.transport not in loaders:
            raise ValueError(
                f"sglang engine: transport {handle.transport!r} cannot reach an SGLang server; "
                f"use sync.transport: {' | '.join(loaders)}"
            )
        with self._busy:
            loaders[handle.transport](handle)
            self._weight_version = handle.weight_version
            if self.config.verify_weights:
                for slot in [s for s in self.slots if s.admitted]:
                    self._verify(slot)
        return self._fingerprint

    def _accept(self, handle: WeightHandle, tensors: list[NamedTensor]) -> None:
        check_names(self.name, handle.weight_version, {name for name, _ in tensors}, self._names)
        self._wire_dtype = handle.dtype
        self._set_current(tensors)

    def _flags(self, slot: Slot, last: bool = True) -> dict:
        """Flush the prefix cache with the last bucket: entries computed under the old weights must not be
        reused. Under an in_place pause with requests in flight SGLang cannot flush (they keep their KV
        cache and continue on the new weights); the flush then happens as soon as the server is idle."""
        if not last:
            return {"flush_cache": False}
        flush = not (slot.paused and self._pause_mode == "in_place")
        slot.stale_cache = not flush
        return {"flush_cache": flush}

    def _on_admitted(self, work, what: str) -> None:
        """Run `work(slot)` on every admitted server in parallel; a transport failure quarantines it."""
        assert self.router is not None
        admitted = [s for s in self.slots if s.admitted]
        with ThreadPoolExecutor(max_workers=max(1, len(admitted))) as pool:
            futures = {slot: pool.submit(work, slot) for slot in admitted}
        for slot, future in futures.items():
            exc = future.exception()
            if isinstance(exc, httpx.TransportError):
                self.router.quarantine(slot, f"{what} failed: {type(exc).__name__}")
            elif exc is not None:
                raise exc

    def _receive_disk(self, handle: WeightHandle) -> None:
        self._accept(handle, [pair for bucket in read_buckets(handle) for pair in bucket])
        body = {
            "model_path": handle.location,
            "weight_version": str(handle.weight_version),
            "keep_pause": True,  # a paused server stays paused until resume()
        }
        self._on_admitted(
            lambda slot: self._post(slot.url, "/update_weights_from_disk", {**body, **self._flags(slot)}), "disk update"
        )

    def _receive_tensor(self, handle: WeightHandle) -> None:
        # Rebuilding from the handle maps the sender's shared memory (no copy); each server rank then gets
        # its own serialization of these mapped tensors (a payload is consumed by the one process reading it).
        buckets = list(read_buckets(handle))
        self._accept(handle, [(name, tensor.clone()) for bucket in buckets for name, tensor in bucket])
        self._on_admitted(lambda slot: self._load_tensors(slot, buckets, handle.weight_version), "tensor update")

    def _load_tensors(self, slot: Slot, buckets: list[list[NamedTensor]], version: int) -> None:
        """`/update_weights_from_tensor` per bucket, inside `/begin_weight_update` … `/end_weight_update`."""
        from miles_sync.transports.tensor import serialize_bucket, use_file_system_sharing

        use_file_system_sharing()
        self._post(slot.url, "/begin_weight_update")
        try:
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                payloads = [serialize_bucket(bucket) for _ in range(self._tp_size(slot))]
                body = {"serialized_named_tensors": payloads, **self._flags(slot, last)}
                if last:
                    body["weight_version"] = str(version)
                self._post(slot.url, "/update_weights_from_tensor", body)
        finally:
            self._post(slot.url, "/end_weight_update")

    def _receive_broadcast(self, handle: WeightHandle) -> None:
        """Every server joins the handle's group; this process joins as rank 1 and keeps a copy.

        Ranks: 0 the trainer, 1 this process, then each server's `rank_offset + tp_rank`. A server that is
        quarantined cannot take its ranks, so this process stands in for them (and the server gets the
        weights when it is re-admitted).
        """
        from miles_sync.transports.broadcast import read_broadcast

        group, layout = handle.group, handle.layout
        assert group is not None and layout is not None
        check_names(self.name, handle.weight_version, {n for bucket in layout for n, _, _ in bucket}, self._names)
        offsets, next_rank = {}, 2
        for slot in self.slots:
            offsets[slot.index] = next_rank
            next_rank += self._tp_size(slot)
        if group["world_size"] != next_rank:
            raise ValueError(
                f"sglang engine: the broadcast group has {group['world_size']} ranks but the trainer, this engine "
                f"and its servers need {next_rank}; build the sender with num_receivers={next_rank - 1}"
            )
        admitted = [s for s in self.slots if s.admitted]
        standins = [
            r
            for s in self.slots
            if not s.admitted
            for r in range(offsets[s.index], offsets[s.index] + self._tp_size(s))
        ]
        name = group["group_name"]
        pool = ThreadPoolExecutor(max_workers=len(admitted) + len(standins) + 1)
        try:
            # Joining blocks until every rank is there, so all joins run at once.
            joins = [
                pool.submit(
                    self._post,
                    s.url,
                    "/init_weights_update_group",
                    {
                        "master_address": group["master_address"],
                        "master_port": group["master_port"],
                        "rank_offset": offsets[s.index],
                        "world_size": group["world_size"],
                        "group_name": name,
                        "backend": group["backend"],
                    },
                    group["timeout_s"],
                )
                for s in admitted
            ]
            mine = read_broadcast(handle, rank=1)
            theirs = [read_broadcast(handle, rank=r) for r in standins]
            received: list[NamedTensor] = []
            for index, bucket_layout in enumerate(layout):
                last = index == len(layout) - 1
                names, dtypes, shapes = (list(x) for x in zip(*bucket_layout, strict=True))
                body = {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": name,
                    "load_format": "flattened_bucket",
                }
                if last:
                    body["weight_version"] = str(handle.weight_version)
                loads = [
                    pool.submit(self._load_distributed, s.url, {**body, **self._flags(s, last)}, joins[i], index)
                    for i, s in enumerate(admitted)
                ]
                stand = [pool.submit(next, it) for it in theirs]
                received += next(mine)  # this process's share of the collective
                for f in stand + loads:
                    f.result(timeout=group["timeout_s"])
            for s in admitted:
                self._post(s.url, "/destroy_weights_update_group", {"group_name": name})
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self._accept(handle, received)

    def _load_distributed(self, url: str, body: dict, joined, index: int) -> None:
        joined.result()
        if index == 0:
            self._post(url, "/begin_weight_update")
        try:
            self._post(url, "/update_weights_from_distributed", body)
        finally:
            if "weight_version" in body:  # the last bucket
                self._post(url, "/end_weight_update")

    def _tp_size(self, slot: Slot) -> int:
        return 1 if slot.server is None else slot.server.tp_size

    def _verify(self, slot: Slot) -> None:
        """The server must report exactly the checksums of the weights last published."""
        ranks = self._post(slot.url, "/weights_checker", {"action": "checksum"})["ranks"]
        for rank in ranks:
            actual = rank["checksums"]
            differ = sorted(n for n in self._expected if actual.get(n) != self._expected[n])
            extra = sorted(set(actual) - set(self._expected))
            if differ or extra:
                raise WeightMismatchError(
                    f"sglang engine {slot.url}: {len(differ)} tensors differ from weight version "
                    f"{self._weight_version} (e.g. {differ[:3]}); unexpected tensors {extra[:3]}"
                )

    def weight_fingerprint(self) -> str:
        """The HF-layout fingerprint of the weights every admitted server holds (verified now, always)."""
        for slot in [s for s in self.slots if s.admitted]:
            self._verify(slot)
        return self._fingerprint

    # ---- recovery -------------------------------------------------------------------------------

    def _recover(self, slot: Slot) -> None:
        """Called by the router (health thread, `_busy` held): bring a quarantined slot back in sync."""
        if slot.server is not None and not slot.server.alive():
            if slot.restarts >= self.config.max_restarts:
                raise RuntimeError(f"gave up after {slot.restarts} restarts; log {slot.server.log_path}")
            slot.server.stop()  # reap what is left of its process group
            slot.restarts += 1
            slot.note(f"restarting (restart {slot.restarts} of at most {self.config.max_restarts})")
            slot.server = self._launch(slot.index)
            slot.url = slot.server.url
            slot.server.wait_ready(self.config.startup_timeout_s)
        try:
            self._verify(slot)
        except WeightMismatchError:
            slot.note(f"loading weight version {self._weight_version} before it serves again")
            self._load_current(slot)
            self._verify(slot)

    def _load_current(self, slot: Slot) -> None:
        """Push the current version from this process's copy, through shared memory."""
        from miles_sync.transports.tensor import release_shared, use_file_system_sharing

        use_file_system_sharing()
        shared = [(name, tensor.clone().share_memory_()) for name, tensor in self._current]
        try:
            self._load_tensors(slot, [shared], self._weight_version)
        finally:
            release_shared([shared])

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
        for slot in self.slots:
            if slot.server is not None:
                slot.server.stop()
        self._client.close()


def _folder_tensors(folder: Path) -> list:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineStartError(f"sglang engine: no *.safetensors weights in {folder}")
    return [pair for f in files for pair in load_file(str(f)).items()]
