"""`sglang` engine: generation, pauses and weight updates through SGLang's native HTTP API.

The engine puts together one part per concern, each in its own module:

- `router.py`: the slots (one per server), least-outstanding routing, health checks and quarantine;
- `dispatch.py`: generation calls, retried on another server when theirs fails;
- `pause.py`: pause and resume around a weight push, and when a push may flush the prefix cache;
- `weights.py`: loading a pushed version through each transport and the checksum check: after every
  load each server reports per-tensor checksums (`/weights_checker`), compared with checksums computed
  from the published HF tensors, so equality is bit-exact without reading weights back;
- `recovery.py`: a restarted or re-admitted server gets the current version (kept in this process) and
  is verified before it serves again; each restart is kept (`take_restarts`) for the owner to record;
- `adapters.py`: with `sync.lora: adapter`, pushes are LoRA adapters, each loaded by name and named by the calls
  made after it (the base weights never change);
- `server.py` launches and stops one server process.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from miles_rollout.config import PauseMode, SGLangEngineConfig
from miles_rollout.engines.checkpoint import engine_dtype, read_config, tied_embeddings
from miles_rollout.engines.sglang.adapters import AdapterServing, server_flags
from miles_rollout.engines.sglang.calls import ServerCalls
from miles_rollout.engines.sglang.derived_layout import LayoutError
from miles_rollout.engines.sglang.dispatch import Dispatcher
from miles_rollout.engines.sglang.layout import FAMILIES
from miles_rollout.engines.sglang.pause import PauseControl
from miles_rollout.engines.sglang.recovery import EngineRestart, recover
from miles_rollout.engines.sglang.router import Router, Slot
from miles_rollout.engines.sglang.server import EngineStartError, SGLangServer, folder_tensors, use_cpu
from miles_rollout.engines.sglang.weights import HeldCopy, WeightLoader, WeightMismatchError
from miles_rollout.engines.versions import WeightVersions
from miles_rollout.protocol import WeightPushError, release_frames
from miles_rollout.types import GenerateRequest, GenerateResult
from miles_sync import WeightHandle, without_tied_head

__all__ = ["EngineRestart", "SGLangEngine", "WeightMismatchError"]


class SGLangEngine:
    """One or more SGLang servers behind one `RolloutEngine`."""

    name = "sglang"  # serves concurrent calls (the router balances them): not a `LimitsCalls`

    def __init__(
        self,
        model_path: str | Path,
        config: SGLangEngineConfig,
        seed: int = 0,
        packed: str | None = None,
        gpu_ids: list[list[str]] | None = None,
        lora: dict | None = None,
    ) -> None:
        """`packed`: pushes carry the linear weights packed in this format (`sync.quant_wire: packed`); the servers
        then start from a packed copy of the checkpoint written under the log folder (attached servers must
        already serve one: `miles_sync.formats.packed.write_packed_checkpoint`). GPU only. `gpu_ids`: each
        server's GPUs (the resource plan's, `miles_control.job.placement`); None leaves the choice to SGLang.
        `lora`: PEFT `LoraConfig` keyword arguments of the adapter the pushes carry (`sync.lora: adapter`); the
        servers start with SGLang's LoRA support (attached servers must already have it) and serve each pushed
        version by name (`adapters.py`)."""
        if lora is not None and packed is not None:
            raise ValueError("sync.lora: adapter pushes no packed weights: sync.quant_wire must be values")
        if lora is not None and not config.urls:
            config = config.model_copy(
                update={"extra_args": [*config.extra_args, *server_flags(lora, use_cpu(config))]}
            )
        self.lora = lora
        self._adapters: AdapterServing | None = None
        self.config = config
        self.model_path = Path(model_path)
        self.packed = packed
        self.gpu_ids = gpu_ids
        if gpu_ids is not None and len(gpu_ids) != config.num_engines:
            raise ValueError(f"sglang engine: {len(gpu_ids)} GPU assignments for {config.num_engines} servers")
        self.seed = seed
        self.slots: list[Slot] = []
        self.router: Router | None = None
        self._busy = threading.Lock()  # weight updates vs health checks and recoveries
        self._restarts: list[EngineRestart] = []  # since the last take_restarts (appended by the health thread)
        self._restarts_lock = threading.Lock()
        self._dtype_name = engine_dtype(config.dtype, model_path)
        self.param_dtype = getattr(torch, self._dtype_name)
        self._tied = tied_embeddings(model_path)
        self._versions: WeightVersions[HeldCopy] = WeightVersions()  # held, and replaced by a check_later push
        self._delta_base = 0  # the version a delta push may change: -1 after a failed load
        self.push_phases: dict[str, float] = {}  # seconds inside the last push's phases (pause, load), for its span
        self._calls = ServerCalls(config.request_timeout_s)
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="miles-sglang-"))
        # Packed weights are checked in transit (the fingerprint of what the servers received), not on the
        # servers: SGLang may re-lay-out fp8 scales after loading for the GPU's kernels, so its checksums of
        # them are not the published tensors' (miles_sync.formats.packed).
        self._server_check = config.verify_weights and packed is None
        # else the fingerprint is of this process's copy only; an adapter's check reaches the folder the servers read
        # (adapters.py), not what they loaded: not a check of the serving weights either
        self.verifies_loads = self._server_check and self.lora is None
        try:
            if packed is not None:
                self.model_path = self._packed_checkpoint(packed)
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
                slot.url = slot.server.url  # a server whose port was taken meanwhile started again on another
        for slot in self.slots:
            self._check_reachable(slot.url)
        # A checkpoint may still carry the head of a tied model; SGLang skips it, and so does the check.
        initial = list(without_tied_head(folder_tensors(self.model_path), self._tied))
        self._weights = WeightLoader(
            self.name, self.slots, self._calls, self._dtype_name, initial, self.packed, self._versions
        )
        if self._server_check:  # before the router's health checks start
            if (
                read_config(self.model_path).get("model_type") not in FAMILIES
            ):  # no table entry: the layout the first server built
                try:
                    self._weights.derive_from(self.slots[0])
                except LayoutError as exc:
                    raise ValueError(
                        f"sglang engine: config.json model_type {read_config(self.model_path).get('model_type')!r}: the weight "
                        f"check cannot follow SGLang's layout: {exc}; set rollout.engine.verify_weights: false to run it "
                        "unchecked"
                    ) from None
            for slot in self.slots:
                self._weights.verify(slot, self._versions.version)
        self.router = Router(self.slots, self._recover, config.health_interval_s, config.health_timeout_s, self._busy)
        self._pause = PauseControl(self.slots, self.router, self._calls)
        self._dispatcher = Dispatcher(config, self.slots, self.router)
        self._weights.attach(self.router, self._pause)
        if self.lora is not None:
            self._adapters = AdapterServing(self.lora, self._log_dir / "adapters", self.slots, self._calls)
            self._dispatcher.adapters = self._adapters

    def _packed_checkpoint(self, fmt: str) -> Path:
        if not self.config.urls and use_cpu(self.config):
            raise EngineStartError(
                f"sync.quant_wire: packed runs SGLang's {fmt} kernels, which need a GPU (this engine runs on CPU: "
                "rollout.engine.device, or no CUDA device); use sync.quant_wire: values, the weight-only emulation"
            )
        from miles_sync.formats.packed import write_packed_checkpoint

        # a whole model copy: in a temporary folder of its own, removed at shutdown (the log folder may be kept)
        self._packed_dir = Path(tempfile.mkdtemp(prefix="miles-sglang-packed-"))
        return write_packed_checkpoint(self.model_path, self._packed_dir / f"checkpoint-{fmt}", fmt)

    def _launch(self, index: int, restart: int = 0) -> SGLangServer:
        gpus = None if self.gpu_ids is None else self.gpu_ids[index]
        return SGLangServer(
            self.model_path, self.config, self._dtype_name, index, self._log_dir, self.seed, gpus, restart
        )

    def _restarted(self, restart: EngineRestart) -> None:
        with self._restarts_lock:
            self._restarts.append(restart)

    def take_restarts(self) -> list[EngineRestart]:
        """The servers restarted since the last call (the router restarts a server whose process is gone), oldest
        first: for the owner to record, since they happen on the router's health thread between its calls."""
        with self._restarts_lock:
            taken, self._restarts = self._restarts, []
        return taken

    def _check_reachable(self, url: str) -> None:
        try:
            self._calls.client.get(f"{url}/model_info", timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineStartError(f"sglang engine at {url} is unreachable: {exc}") from None

    @property
    def urls(self) -> list[str]:
        """URLs of the admitted servers."""
        return [s.url for s in self.slots if s.admitted]

    @property
    def weight_version(self) -> int:
        return self._versions.version

    def receiver_ranks(self) -> int:
        """Receiving ranks this engine brings to a collective weight push: itself (the verifier) and every server
        rank; with adapters, itself alone (it writes the adapter for the servers)."""
        return 1 if self.lora is not None else self._weights.receiver_ranks()

    # ---- generation, pause, health --------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Split into calls of at most `max_requests_per_call`, each routed to the least busy server."""
        return await self._dispatcher.generate(requests)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """End these requests now (SGLang's /abort_request): they return what they generated, finish reason abort."""
        await self._dispatcher.abort(request_ids)

    async def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop new calls; pause (with `mode`) the servers that have requests in flight. With adapters the servers
        go on: a running call keeps the adapter it started with, so only new calls wait for the next one."""
        began = time.time()
        if self._adapters is not None:
            assert self.router is not None
            self.router.hold(wait_for_probe=False)
            self._add_phase("pause/servers", time.time() - began)
            return
        self._pause.pause(mode)
        self._add_phase("pause/probe_wait", self._pause.probe_wait_s)
        self._add_phase("pause/servers", time.time() - began - self._pause.probe_wait_s)

    def _add_phase(self, phase: str, seconds: float) -> None:
        """Time inside a push's phase, summed until the rollout worker clears `push_phases` for the next push."""
        self.push_phases[phase] = self.push_phases.get(phase, 0.0) + seconds

    async def resume(self) -> None:
        self._pause.resume()

    async def flush_cache(self) -> None:
        self._pause.each_live("/flush_cache")

    def release_memory(self) -> None:
        """Colocated mode: give the GPU memory of weights and KV cache back while the trainer steps
        (`/release_memory_occupation`; the servers must run with `--enable-memory-saver`). Not run here: SGLang's
        memory saver needs CUDA."""
        with self._busy:
            self._pause.each_live("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        """Colocated mode: take the memory back before weights are loaded and generation goes on
        (`/resume_memory_occupation`)."""
        with self._busy:
            self._pause.each_live("/resume_memory_occupation", {})

    async def health(self) -> bool:
        """True when every server is admitted and answers `/health_generate`."""
        try:
            return all(
                s.admitted and self._calls.client.get(f"{s.url}/health_generate", timeout=30).status_code == 200
                for s in self.slots
            )
        except httpx.HTTPError:
            return False

    # ---- weights --------------------------------------------------------------------------------

    def receive(self, handle: WeightHandle, check_later: bool = False) -> str:
        """Load a pushed version into every admitted server, then verify each (with `verify_weights`; with
        `check_later`, `weight_fingerprint()` does, and the previous version is kept for `roll_back()`). A push
        that fails once a server was touched (a load, or the check after it) is rolled back: the version held
        before is reloaded into every server and verified (`_roll_back`)."""
        if self._adapters is not None:
            return self._receive_adapter(handle, check_later)
        with self._busy:
            self._versions.begin(check_later)
            try:
                self._weights.timing = {}
                self._weights.load(handle, self._delta_base)  # takes the version (`_versions.took`)
                for part, seconds in self._weights.timing.items():
                    self._add_phase(f"load/{part}", seconds)
                if self._server_check and not check_later:
                    began = time.time()
                    for slot in [s for s in self.slots if s.admitted]:
                        self._weights.verify(slot, self._versions.version)
                    self._add_phase("load/verify", time.time() - began)
            except BaseException as exc:
                if (replaced := self._versions.failed()) is not None:  # the version was taken: back to the one before
                    self._weights.reinstate(replaced)
                if not self._weights.servers_touched and isinstance(exc, ValueError):
                    raise  # refused whole before any server was asked to load: names this engine
                if not isinstance(exc, Exception):
                    self._delta_base = -1  # an interrupt: the servers may hold part of it
                    raise
                # They may hold part of this push: only a whole version may follow, unless the roll-back below
                # verifies every server on the previous one.
                self._delta_base = -1 if self._weights.servers_touched else self._delta_base
                release_frames(exc)  # the failed stream's buffers go before the previous version is loaded
                raise WeightPushError(self.describe(), handle.weight_version, self._roll_back(), exc) from exc
            self._versions.done()
            self._delta_base = handle.weight_version
        return "" if check_later else self._weights.fingerprint

    def _receive_adapter(self, handle: WeightHandle, check_later: bool) -> str:
        """An adapter push: loaded by name into every server (`AdapterServing`); a failure leaves the calls on the
        adapter they used before (the servers may hold the new one too, unused)."""
        assert self._adapters is not None
        with self._busy:
            self._adapters.timing = {}
            try:
                fingerprint = self._adapters.receive(handle, keep_previous=check_later)
            except ValueError:
                raise  # refused whole before any server was asked to load: names this engine
            except Exception as exc:
                held = f"new calls still use version {self._adapters.current or 0}'s adapter"
                raise WeightPushError(self.describe(), handle.weight_version, held, exc) from exc
            finally:
                for part, seconds in self._adapters.timing.items():
                    self._add_phase(f"load/{part}", seconds)
            self._versions.version = handle.weight_version  # the adapters keep what a roll-back needs
        return "" if check_later else fingerprint

    def roll_back(self) -> int:
        """Back to the version a `receive(..., check_later=True)` replaced: reloaded into every admitted server from
        this process's copy, and verified (with `verify_weights`)."""
        if self._adapters is not None:
            with self._busy:
                self._versions.version = self._adapters.roll_back()
                return self._versions.version
        with self._busy:
            version, replaced = self._versions.roll_back(self.describe())
            self._weights.reinstate(replaced)
            self._delta_base = -1
            restored = self._weights.restore(version, self._server_check)
            if self._server_check and len(restored) == len(self.slots):
                self._delta_base = version
            return version

    def drop_previous(self) -> None:
        """The check after `receive(..., check_later=True)` passed: the copy kept for a roll-back goes."""
        with self._busy:
            self._versions.drop_previous()
            if self._adapters is not None:
                self._adapters.drop_previous()

    def describe(self) -> str:
        """This engine in an error message: its servers' addresses."""
        return f"{self.name} engine (servers {', '.join(s.url for s in self.slots)})"

    def _roll_back(self) -> str:
        """After a failed load: every admitted server back on the version this process holds (a failed push leaves
        the copy as it was), verified against its checksums. What the servers hold now, for the error message."""
        version = self._versions.version
        if not self._weights.servers_touched:
            return f"its servers still hold version {version} (nothing was loaded)"
        restored = self._weights.restore(version, self._server_check)
        lost = [s.url for s in self.slots if s not in restored]
        if self._server_check and not lost:
            self._delta_base = version  # every server verified on it: a delta push may follow
        checked = "verified" if self._server_check else "not verified: verify_weights is off"
        again = f"hold version {version} again (reloaded from this engine's copy, {checked})"
        if not lost:
            return f"its servers {again}"
        done = f"servers {', '.join(s.url for s in restored)} {again}; " if restored else ""
        return done + f"quarantined until the router reloads version {version} into them: {', '.join(lost)}"

    def weight_fingerprint(self) -> str:
        """The HF-layout fingerprint of the weights every admitted server holds (verified now, except for packed
        weights: see `_server_check`). Under the weight lock: a recovery does not reload a server meanwhile. With
        adapters: the fingerprint of the adapter the servers were given (`adapters.py`)."""
        if self._adapters is not None:
            return self._adapters.fingerprint
        with self._busy:
            for slot in [s for s in self.slots if s.admitted and self.packed is None]:
                self._weights.verify(slot, self._versions.version)
            return self._weights.fingerprint

    def _recover(self, slot: Slot) -> None:
        """Called by the router (health thread, `_busy` held): bring a quarantined slot back in sync."""
        if self._adapters is not None:  # the base weights never change: the version the servers started with
            recover(slot, self.config, self._launch, self._weights, 0, self._restarted)
            self._adapters.restore(slot)
            return
        recover(slot, self.config, self._launch, self._weights, self._versions.version, self._restarted)

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
        for slot in self.slots:
            if slot.server is not None:
                slot.server.stop()
        if (weights := getattr(self, "_weights", None)) is not None:  # None: the engine failed to start
            weights.release_pinned()
        if (packed := getattr(self, "_packed_dir", None)) is not None:
            shutil.rmtree(packed, ignore_errors=True)
        self._calls.close()
