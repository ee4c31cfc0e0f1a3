"""`sglang` engine: generation, pauses and weight updates through SGLang's native HTTP API.

Weights are loaded with `/update_weights_from_disk` (transport `disk`). After every load the engine
asks each server for its per-tensor checksums (`/weights_checker`) and compares them with the ones
computed from the published HF tensors, so equality is bit-exact without reading weights back.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from miles_rollout.config import PauseMode, SGLangEngineConfig
from miles_rollout.engines.checks import check_names, group_by_sampling
from miles_rollout.engines.sglang.layout import expected_checksums
from miles_rollout.engines.sglang.server import EngineStartError, SGLangServer, resolve_dtype
from miles_rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_sync import WeightHandle, read_buckets, weight_fingerprint

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class WeightMismatchError(RuntimeError):
    """An engine holds other weights than the ones published."""


def _version_number(label: str | None) -> int:
    return int(label) if label and label.isdigit() else 0


class SGLangEngine:
    """One or more SGLang servers behind one `RolloutEngine`; requests are spread round-robin."""

    name = "sglang"

    def __init__(self, model_path: str | Path, config: SGLangEngineConfig, seed: int = 0) -> None:
        self.config = config
        self.servers: list[SGLangServer] = []
        dtype_name = resolve_dtype(config, model_path)
        self.param_dtype = getattr(torch, dtype_name)
        self._client = httpx.Client(timeout=config.request_timeout_s)
        try:
            self._start(model_path, config, dtype_name, seed)
        except BaseException:
            self.shutdown()  # never leave launched servers behind a failed start
            raise

    def _start(self, model_path: str | Path, config: SGLangEngineConfig, dtype_name: str, seed: int) -> None:
        if config.urls:
            self.urls = [u.rstrip("/") for u in config.urls]
        else:
            log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="miles-sglang-"))
            self.servers = [
                SGLangServer(model_path, config, dtype_name, i, log_dir, seed) for i in range(config.num_engines)
            ]
            for server in self.servers:
                server.wait_ready(config.startup_timeout_s)
            self.urls = [s.url for s in self.servers]
        for url in self.urls:
            self._check_reachable(url)
        self._weight_version = 0
        self._pause_mode: PauseMode | None = None
        initial = _folder_tensors(Path(model_path))
        self._expected = expected_checksums(initial, self.param_dtype)
        self._fingerprint = weight_fingerprint(initial, self.param_dtype)
        self._verify()

    def _check_reachable(self, url: str) -> None:
        try:
            self._client.get(f"{url}/model_info", timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineStartError(f"sglang engine at {url} is unreachable: {exc}") from None

    def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        response = self._client.post(f"{url}{path}", json=body or {})
        if response.status_code >= 400:
            raise RuntimeError(f"sglang engine {url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}

    @property
    def weight_version(self) -> int:
        return self._weight_version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        by_params = group_by_sampling(requests)
        calls = []
        for sampling, indices in by_params.items():
            per_server = [indices[i :: len(self.urls)] for i in range(len(self.urls))]
            calls += [(url, sampling, chunk) for url, chunk in zip(self.urls, per_server, strict=True) if chunk]
        results: list[GenerateResult | None] = [None] * len(requests)
        async with httpx.AsyncClient(timeout=self.config.request_timeout_s) as client:
            answers = await asyncio.gather(
                *(self._generate_on(client, url, s, [requests[i] for i in c]) for url, s, c in calls)
            )
        for (_, _, chunk), outs in zip(calls, answers, strict=True):
            for i, out in zip(chunk, outs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    async def _generate_on(
        self, client: httpx.AsyncClient, url: str, sampling: SamplingParams, requests: list[GenerateRequest]
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
        response = await client.post(f"{url}/generate", json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"sglang engine {url}/generate answered {response.status_code}: {response.text[:500]}")
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

    async def pause(self, mode: PauseMode = "in_place") -> None:
        for url in self.urls:
            self._post(url, "/pause_generation", {"mode": mode})
        self._pause_mode = mode

    async def resume(self) -> None:
        for url in self.urls:
            self._post(url, "/continue_generation")
        self._pause_mode = None

    async def flush_cache(self) -> None:
        for url in self.urls:
            self._post(url, "/flush_cache")

    async def health(self) -> bool:
        try:
            return all(self._client.get(f"{u}/health_generate", timeout=30).status_code == 200 for u in self.urls)
        except httpx.HTTPError:
            return False

    def receive(self, handle: WeightHandle) -> str:
        if handle.transport != "disk":
            raise ValueError(
                f"sglang engine: transport {handle.transport!r} is not supported yet; use sync.transport: disk"
            )
        tensors = [pair for bucket in read_buckets(handle) for pair in bucket]
        expected = expected_checksums(tensors, self.param_dtype)
        check_names(self.name, handle.weight_version, set(expected), set(self._expected))
        for url in self.urls:
            self._post(
                url,
                "/update_weights_from_disk",
                {
                    "model_path": handle.location,
                    "weight_version": str(handle.weight_version),
                    # Held requests keep their KV cache under in_place (they continue on the new weights);
                    # a paused engine stays paused until resume().
                    "flush_cache": self._pause_mode != "in_place",
                    "keep_pause": self._pause_mode is not None,
                },
            )
        # What the servers hold, in HF layout: the published tensors cast to the engine's dtype.
        self._expected, self._fingerprint = expected, weight_fingerprint(tensors, self.param_dtype)
        self._weight_version = handle.weight_version
        self._verify()
        return self._fingerprint

    def _verify(self) -> None:
        """Every server must report exactly the checksums of the weights last published to it."""
        for url in self.urls:
            ranks = self._post(url, "/weights_checker", {"action": "checksum"})["ranks"]
            for rank in ranks:
                actual = rank["checksums"]
                differ = sorted(n for n in self._expected if actual.get(n) != self._expected[n])
                extra = sorted(set(actual) - set(self._expected))
                if differ or extra:
                    raise WeightMismatchError(
                        f"sglang engine {url}: {len(differ)} tensors differ from weight version "
                        f"{self._weight_version} (e.g. {differ[:3]}); unexpected tensors {extra[:3]}"
                    )

    def weight_fingerprint(self) -> str:
        """The HF-layout fingerprint of the weights every server was verified to hold."""
        self._verify()
        return self._fingerprint

    def shutdown(self) -> None:
        for server in self.servers:
            server.stop()
        self._client.close()


def _folder_tensors(folder: Path) -> list:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineStartError(f"sglang engine: no *.safetensors weights in {folder}")
    return [pair for f in files for pair in load_file(str(f)).items()]
