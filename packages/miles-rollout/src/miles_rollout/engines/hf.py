"""`hf`: an in-process transformers engine.

Batched decoding with a KV cache, per-token logprobs, temperature / top-p / max tokens / stop
tokens. It is the light default where SGLang is not installed and the engine of fast unit tests.
Logprobs are those of the temperature-scaled distribution before top-p filtering, which is what a
trainer can recompute. With `routed_experts` (a mixture of experts), a forward hook on each of transformers' top-k
routers records the experts every fed position went to, as SGLang returns them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from miles_rollout.config import HFEngineConfig, PauseMode
from miles_rollout.engines.checkpoint import engine_dtype
from miles_rollout.engines.checks import check_push, group_by_sampling, held_fingerprint
from miles_rollout.engines.versions import WeightVersions
from miles_rollout.protocol import WeightPushError
from miles_rollout.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from miles_sync import WeightHandle, is_lora, lora_wire_name, receive
from miles_sync.naming import checkpoint_views
from miles_sync.protocol import Buckets
from miles_sync.vision import batch_inputs, model_class_name, suppress_placeholders

log = logging.getLogger(__name__)


def sample_next_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (token ids, their logprobs under the scaled distribution)."""
    logprobs = torch.log_softmax(logits.float() / sampling.logprob_temperature, dim=-1)
    if sampling.greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > sampling.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class HFEngine:
    """In-process engine over a transformers causal LM loaded from an HF folder."""

    name = "hf"
    max_concurrent_calls = 1  # one batch decodes at a time: calls that arrive meanwhile form the next batch

    verifies_loads = True  # its fingerprint is of the model that generates

    def __init__(
        self, model_path: str | Path, config: HFEngineConfig, seed: int = 0, lora: dict[str, Any] | None = None
    ) -> None:
        """`lora`: PEFT `LoraConfig` keyword arguments when the pushes carry an adapter (`sync.lora: adapter`): the
        model is wrapped with it (B = 0: the base's outputs until the first push), and a push, the weight check
        and a roll-back concern the adapter's matrices alone."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.dtype = engine_dtype(config.dtype, model_path)
        hf_config = transformers.AutoConfig.from_pretrained(str(model_path))
        self.model = getattr(transformers, model_class_name(hf_config)).from_pretrained(
            str(model_path), dtype=getattr(torch, self.dtype)
        )
        suppress_placeholders(self.model)  # a vision-language model's image placeholders are never sampled
        self.lora = lora
        self._views: dict[str, torch.Tensor] | None = None  # the checkpoint's tensors in the parameters (no adapter)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**lora))
        self.model.eval()
        self.model.requires_grad_(False)
        text_config = self.model.config.get_text_config()  # a vision-language model's ids are its text model's
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = getattr(text_config, "eos_token_id", None)
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or [])
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else 0
        self._generator = torch.Generator().manual_seed(seed)
        self._wire_dtype: str | None = None  # of the last push: the dtype the weight check compares in
        self._pieces: dict | None = None  # of the last push: the row ranges its senders held (several senders)
        # snapshot of a replaced version (receive(check_later=True)): the tensors a push overwrote, its wire dtype
        # and pieces
        self._versions: WeightVersions[tuple[dict[str, torch.Tensor], str | None, dict | None]] = WeightVersions()
        self._resumed = threading.Event()  # cleared while paused in place: decoding rows wait on it
        self._resumed.set()
        self._open = threading.Event()  # cleared while paused in any mode: a call made meanwhile starts on resume
        self._open.set()
        self._abort = False
        self._aborted_ids: set[str] = set()  # abort_requests(): rows that end at their next token
        self._weights_lock = threading.Lock()
        self._routers = _routers(self.model) if config.routed_experts else {}
        if config.routed_experts and not self._routers:
            raise ValueError(
                "hf engine: rollout.engine.routed_experts needs a mixture of experts; the model has no top-k router"
            )

    def _pushed_params(self) -> dict[str, torch.Tensor]:
        """What a push replaces, by the names it travels under: every checkpoint tensor (a tied head once, as the
        embedding: the rule of miles_sync.naming), as views into the parameters where transformers holds them in
        another layout (a mixture of experts' fused expert weights); or with an adapter its matrices alone (PEFT's
        save names)."""
        if self.lora is not None:
            return {lora_wire_name(n): p for n, p in self.model.named_parameters() if is_lora(n)}
        if self._views is None:
            from transformers.core_model_loading import revert_weight_conversion

            # the persistent buffers too (DeepSeek-V3's score-correction bias): the trainer's state dict carries them
            saved = set(self.model.state_dict())
            params = dict(self.model.named_parameters()) | {
                name: buffer for name, buffer in self.model.named_buffers() if name in saved
            }
            self._views = checkpoint_views(params, lambda tensors: revert_weight_conversion(self.model, tensors))
        return self._views

    @property
    def weight_version(self) -> int:
        return self._versions.version

    def receiver_ranks(self) -> int:
        """Receiving ranks this engine brings to a collective weight push: one (this process)."""
        return 1

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        by_params = group_by_sampling(requests)
        results: list[GenerateResult | None] = [None] * len(requests)
        try:
            for sampling, indices in by_params.items():
                for start in range(0, len(indices), self.config.max_batch_size):
                    chunk = indices[start : start + self.config.max_batch_size]
                    if not self._open.is_set():  # paused: nothing starts before the push is done
                        await asyncio.to_thread(self._open.wait)
                    outs = await asyncio.to_thread(self._generate_chunk, [requests[i] for i in chunk], sampling)
                    for i, out in zip(chunk, outs, strict=True):
                        results[i] = out
        finally:
            self._aborted_ids.difference_update(r.request_id for r in requests)
        return results  # type: ignore[return-value]

    async def abort_requests(self, request_ids: list[str]) -> None:
        """End these requests at their next token, finish reason `abort` (the rest of their batch goes on; a batch
        whose every row is done stops)."""
        self._aborted_ids.update(request_ids)

    def _wait_if_paused(self) -> bool:
        """Block while paused in place; True when the caller must abort its requests."""
        if self._abort:
            return True
        self._resumed.wait()
        return self._abort

    @torch.inference_mode()
    def _generate_chunk(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        batch = len(requests)
        lengths = [len(r.input_ids) for r in requests]
        if min(lengths) == 0:
            raise ValueError("generate() got a request with no input ids")
        width = max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding keeps the last position aligned
            input_ids[row, width - lengths[row] :] = torch.tensor(request.input_ids)
            attention[row, width - lengths[row] :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        eos = set() if sampling.ignore_eos else self.eos_token_ids
        stop_ids = torch.tensor(sorted(eos | set(sampling.stop_token_ids)), dtype=torch.long)

        out_ids: list[list[int]] = [[] for _ in requests]
        out_lps: list[list[float]] = [[] for _ in requests]
        reasons = [FinishReason.LENGTH] * batch
        finished = torch.zeros(batch, dtype=torch.bool)
        out_versions: list[list[int]] = [[] for _ in requests]  # per output id
        versions: list[list[int]] = [[] for _ in requests]  # every version a row ran under, in order

        cache = DynamicCache()
        routing = _Routing(self._routers, batch) if self._routers else None
        vision = batch_inputs([r.multimodal for r in requests], [width - n for n in lengths], width)
        with self._weights_lock, _recording(routing):
            version = self._versions.version  # of the weights these logits come from
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention,
                # with images the model works out its own 3-D positions, and keeps each row's offset from the text
                # positions (`rope_deltas`) for the tokens that follow
                position_ids=None if vision else positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **vision,
            ).logits[:, -1]
            deltas = self.model.base_model.rope_deltas if vision else None
        for step in range(sampling.max_new_tokens):
            tokens, logprobs = sample_next_token(logits, sampling, self._generator)
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()  # one copy each, not one per row
            for row in (~finished).nonzero().flatten().tolist():
                out_ids[row].append(token_list[row])
                out_lps[row].append(logprob_list[row])
                out_versions[row].append(version)
                if not versions[row] or versions[row][-1] != version:
                    versions[row].append(version)
            hit_stop = torch.isin(tokens, stop_ids) & ~finished
            for row in hit_stop.nonzero().flatten().tolist():
                reasons[row] = FinishReason.STOP
            finished |= hit_stop
            if bool(finished.all()) or step == sampling.max_new_tokens - 1:
                break
            if self._aborted_ids:
                for row in (~finished).nonzero().flatten().tolist():
                    if requests[row].request_id in self._aborted_ids:
                        reasons[row] = FinishReason.ABORT
                        finished[row] = True
                if bool(finished.all()):
                    break
            if self._wait_if_paused():
                for row in (~finished).nonzero().flatten().tolist():
                    reasons[row] = FinishReason.ABORT
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=-1)
            positions = positions[:, -1:] + 1
            with self._weights_lock, _recording(routing):
                version = self._versions.version
                logits = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=attention,
                    position_ids=positions if deltas is None else (positions + deltas)[None].expand(3, -1, -1),
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]
        return [
            GenerateResult(
                r.request_id,
                out_ids[i],
                out_lps[i],
                reasons[i],
                versions[i],
                out_versions[i],
                routed_experts=None if routing is None else routing.of_row(i, lengths[i], len(out_ids[i])),
            )  # fmt: skip
            for i, r in enumerate(requests)
        ]

    async def pause(self, mode: PauseMode = "in_place") -> None:
        # The KV cache lives in the decoding call, so in_place and retract both simply hold it.
        self._open.clear()
        self._abort = mode == "abort"
        if self._abort:
            self._resumed.set()  # wake held requests so that they end as aborted
        else:
            self._resumed.clear()

    async def resume(self) -> None:
        self._abort = False
        self._resumed.set()
        self._open.set()

    async def flush_cache(self) -> None:
        """Nothing is cached between requests in this engine."""

    async def health(self) -> bool:
        return self.model is not None

    def receive(self, handle: WeightHandle, check_later: bool = False) -> str:
        """Load a pushed version (`miles_sync.receive` calls `load_tensors`); with `check_later` the tensors it
        overwrites are kept for `roll_back()`. A stream that broke changed nothing: the engine keeps its version."""
        self._versions.begin(check_later)
        try:
            receive(handle, self)  # the transport's receiver calls load_tensors
        except ValueError:
            raise  # refused whole, naming this engine (check_push)
        except Exception as exc:
            # load_tensors reads every bucket before it copies one: a stream that broke changed nothing
            held = f"the engine still holds version {self._versions.version}"
            raise WeightPushError(f"{self.name} engine", handle.weight_version, held, exc) from exc
        self._versions.done()
        return "" if check_later else self.weight_fingerprint()

    def load_tensors(self, handle: WeightHandle, buckets: Buckets) -> None:
        """Read every bucket, refuse a version the model cannot take whole, then copy it into the model."""
        if handle.packed is not None:
            raise ValueError(
                f"hf engine: weight version {handle.weight_version} carries packed {handle.packed} weights, which "
                "only SGLang on a GPU loads; use sync.quant_wire: values"
            )
        params = self._pushed_params()
        # Read everything before touching the model, so a bad version is refused whole.
        tensors = dict(pair for bucket in buckets for pair in bucket)
        check_push(self.name, handle, set(tensors), set(params), self._versions.version)
        wrong = [f"{n}: {tuple(t.shape)}, the model's {tuple(params[n].shape)}" for n, t in tensors.items()
                 if t.shape != params[n].shape]  # fmt: skip
        if wrong:
            raise ValueError(
                f"{self.name} engine: weight version {handle.weight_version} has {len(wrong)} tensors whose shape "
                f"is not the model's ({'; '.join(wrong[:3])})"
            )
        with self._weights_lock, torch.no_grad():
            replaced = None
            if self._versions.keeps_previous:  # for roll_back(): what the pushed tensors overwrite
                kept = {name: params[name].detach().clone() for name in tensors}
                replaced = (kept, self._wire_dtype, self._pieces)
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
            self._versions.took(handle.weight_version, replaced)
            self._wire_dtype = handle.dtype
            self._pieces = handle.pieces

    def roll_back(self) -> int:
        """Back to the version a `receive(..., check_later=True)` replaced: its tensors are copied back."""
        params = self._pushed_params()
        with self._weights_lock, torch.no_grad():
            version, (kept, self._wire_dtype, self._pieces) = self._versions.roll_back(f"{self.name} engine")
            for name, tensor in kept.items():
                params[name].copy_(tensor)
        return version

    def drop_previous(self) -> None:
        """The check after `receive(..., check_later=True)` passed: the tensors kept for a roll-back go."""
        self._versions.drop_previous()

    def weight_fingerprint(self) -> str:
        """The fingerprint of the weights held (with an adapter: of its matrices), in the dtype of the last push (the
        engine's own before one)."""
        return held_fingerprint(self._pushed_params().items(), self.dtype, self._wire_dtype, self._pieces)

    def shutdown(self) -> None:
        self._resumed.set()
        self._open.set()


def _routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """transformers' top-k routers of a mixture of experts by layer index (their forward returns the router logits,
    the chosen experts' weights and their indices)."""
    import re

    found = {}
    for name, module in model.named_modules():
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        weight = getattr(module, "weight", None)  # a top-k router by what it holds, whatever its class's name
        router = isinstance(getattr(module, "top_k", None), int) and isinstance(weight, torch.nn.Parameter)
        if router and weight.dim() == 2 and not isinstance(module, torch.nn.Linear) and match is not None:
            found[int(match.group(1))] = module
    return found


class _Routing:
    """The experts each fed position of a decoding batch went to: per forward, per layer, [batch × positions, top_k]
    from the routers' outputs (prefill: every left-padded prompt position; then one position per decode step)."""

    def __init__(self, routers: dict[int, torch.nn.Module], batch: int) -> None:
        self.routers, self.batch = routers, batch
        self.layers = sorted(routers)
        self.forwards: list[dict[int, torch.Tensor]] = []

    def hook(self, layer: int):
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            self.forwards[-1][layer] = output[2].detach().to(torch.int16)

        return record

    def of_row(self, row: int, prompt_len: int, num_out: int) -> torch.Tensor:
        """[positions, layers × top_k] of prompt + output less the last id (the last id is never fed)."""
        steps = []
        for forward in self.forwards:
            per_layer = [forward[layer].view(self.batch, -1, forward[layer].shape[-1])[row] for layer in self.layers]
            steps.append(torch.cat(per_layer, dim=-1))  # [positions of this forward, layers × top_k]
        prefill, decoded = steps[0][-prompt_len:], steps[1:num_out]
        return torch.cat([prefill, *decoded], dim=0)


class _recording:
    """Within the block, each router's top-k of one forward goes to `routing` (nothing when it is None)."""

    def __init__(self, routing: _Routing | None) -> None:
        self.routing = routing
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        if self.routing is not None:
            self.routing.forwards.append({})
            self.handles = [r.register_forward_hook(self.routing.hook(i)) for i, r in self.routing.routers.items()]

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
