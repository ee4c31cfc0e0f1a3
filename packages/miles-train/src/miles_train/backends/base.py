"""The machinery every trainer backend shares: ranks and data-parallel rows, the weights as the engines hold them
(pushed dtype, fake quantization) or as the forward uses them, the side models (PPO's critic, distillation's
teacher record), and the gathers that give every rank the whole batch's logprobs.

The update itself (advantages, the loss terms, minibatches, metrics) is `backends/update.py`'s `TrainerBase`, the
class a backend subclasses.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_train.backends.checkpoint import check_teacher, folder_identity, save_teacher
from miles_train.backends.distributed import DistributedGroup
from miles_train.collate import Collated, collate, logprobs_from_logits, unpad_response
from miles_train.config import TrainConfig
from miles_train.loss import ObjectiveError
from miles_train.objectives import build_objective
from miles_train.routing import Agreement, engine_routing
from miles_train.types import TrainBatch

log = logging.getLogger(__name__)


class BackendCore:
    """The machinery every trainer backend shares, beside the update (backends/update.py): ranks and rows, the
    weights as pushed or as the forward uses them, side models, gathers. Every rank receives the whole batch
    (advantages need whole groups); data-parallel rank d trains on rows d::dp_size; tensor-parallel peers take the
    same rows.

    Subclasses set `model`, `reference` (None without KL), `device`, `dp_rank`, `dp_size`,
    `pad_token_id` and implement `_logits`, `_step_optimizer`; `loss_scale` says how the backend's
    gradient reduction combines ranks (dp_size where it averages, 1 where it sums). They call
    `_init_side_models` once the policy is built, and `_save_side_models` / `_load_side_models` in `save` /
    `load` (PPO's value model, critic.py, and distillation's record of its teacher)."""

    name = "base"
    loss_scale: float = 1.0

    def __init__(self, config: TrainConfig, rank: int, world_size: int, init_method: str | None) -> None:
        """Checks the rank count, sets torch's threads, joins the default process group and picks
        the device (this rank's GPU, else the host)."""
        if config.backend.world_size != world_size:
            raise ValueError(
                f"{self.name}: started with {world_size} ranks but train.backend.world_size is "
                f"{config.backend.world_size}"
            )
        if config.backend.num_threads is not None:
            torch.set_num_threads(config.backend.num_threads)
        self.group = DistributedGroup(rank, world_size, init_method)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.dp_rank, self.dp_size = rank, world_size
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.model: Any = None
        self.reference: Any = None
        self.critic: Any = None  # miles_train.critic.Critic, for an objective with needs_values (ppo)
        self.routing_agreement = Agreement()  # a mixture of experts: the trainer's routing against the engine's
        self._teacher_identity: dict[str, str] = {}
        self.pad_token_id = 0
        self.step = 0
        self.objective = build_objective(config.algorithm)
        self.set_push_dtype(None)

    lora_push: str = "adapter"  # train.lora: what a push sends (sync.lora: adapter | merge)

    def set_lora_push(self, mode: str) -> None:
        """With `train.lora`, what `export_weights` gives: the adapter alone (`adapter`, PEFT's names) or the merged
        weights under the model's own names (`merge`). No effect without an adapter."""
        if mode not in ("adapter", "merge"):
            raise ValueError(f"sync.lora: {mode!r} is not adapter or merge")
        self.lora_push = mode

    push_dtype: torch.dtype | None = None  # what the engines hold, when a push rounds the master weights
    push_quant: tuple[str, int] | None = None  # (format, int4 group) the push quantizes linear weights to (informs
    # old_logprobs: auto; the trainer's numerics are train_quant's)
    train_quant: tuple[str, int] | None = None  # (format, int4 group) the forward fake-quantizes linear weights to

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank holds, for a transport that sends from every rank: by default what `export_weights`
        gives (gathered on rank 0); a backend whose ranks hold HF-named row shards sends those instead."""
        return self.export_weights()

    def set_push_dtype(self, dtype: str | None, quantization: str = "none", group_size: int = 128) -> None:
        """The dtype the engines hold the weights in (`float32`, `bfloat16`, `float16`; None: as the trainer) and
        the format the push quantizes the linear weights to (`sync.quantization`: then `old_logprobs: auto`
        recomputes the ratio's denominator, so the engines' quantized logprobs never enter the PPO ratio).

        When it is narrower than the fp32 master weights, a push rounds them: the trainer then forwards with the
        weights as pushed (`train.policy_weights`), recomputes the ratio's denominator under them
        (`algorithm.old_logprobs`), and reports how much of each update the rounding lets through."""
        held = None if dtype is None else getattr(torch, dtype)
        self.push_dtype = held if held is not None and held.itemsize < 4 else None
        self.push_quant = None if quantization == "none" else (quantization, group_size)
        trained = self.config.quantization
        self.train_quant = None if trained == "none" else (trained, self.config.quant_group_size)
        policy, old = self.config.policy_weights, self.config.algorithm.old_logprobs
        self._pushed_forward = policy == "pushed" or (policy == "auto" and self.push_dtype is not None)
        rounds = self.push_dtype is not None or self.push_quant is not None
        self._recompute_old = old == "recompute" or (
            old == "auto" and (rounds or self.config.algorithm.corrects_rollout)
        )

    # ---- beside the policy: PPO's critic, the teacher's record -----------------------------------
    def _init_side_models(self, model_path: str | Path) -> None:
        """The value model (train.critic), when the objective reads one: from train.critic.model, else the policy's
        checkpoint. With a teacher (distill), its identity, which every checkpoint records and a resume checks."""
        if self.config.teacher is not None:
            self._teacher_identity = folder_identity(self.config.teacher)
        if not self.objective.needs_values:
            return
        from miles_train.critic import Critic

        config = self.config.critic_config
        replicas = self.world_size // self.dp_size  # ranks that train on the same rows (tensor-parallel peers)
        self.critic = Critic(config, config.model or model_path, self.config.optimizer, self.device, replicas)

    def _save_side_models(self, directory: str | Path) -> None:
        if self.config.teacher is not None and self.rank == 0:
            save_teacher(directory, self.config.teacher, self._teacher_identity)
        if self.critic is not None:
            self.critic.save(directory, self.rank)
        dist.barrier()

    def _load_side_models(self, directory: str | Path) -> None:
        teacher = self.config.teacher
        if teacher is not None and not check_teacher(directory, teacher, self._teacher_identity):
            log.warning("%s: checkpoint %s records no teacher; distilling from %s", self.name, directory, teacher)
        if self.critic is not None and not self.critic.load(directory):
            log.warning(
                "%s: checkpoint %s holds no critic (written by another algorithm); the value model starts from "
                "train.critic.model",
                self.name,
                directory,
            )

    # ---- what a backend provides -------------------------------------------------------------
    def _logits(self, model: Any, c: Collated) -> torch.Tensor:
        """[B, T, V] logits of `model` (the policy or the reference) over the full vocabulary."""
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of the (local) loss; a backend with fp16 loss scaling scales it first."""
        loss.backward()

    overflow_skips = 0  # optimizer steps skipped for an fp16 overflow (dynamic loss scaling), since the start

    def _step_optimizer(self) -> float | None:
        """Reduce gradients, clip to `optimizer.max_grad_norm` (measure only, where it is None), step; the global
        norm, or None when the step was skipped (an fp16 overflow)."""
        raise NotImplementedError

    def _dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (None: every rank)."""
        return None

    # ---- shared ------------------------------------------------------------------------------
    def _param_shards(self) -> list[torch.Tensor]:
        """This rank's part of every parameter as a plain tensor (the local shard of a DTensor: a view).

        FSDP2 modules are resharded first: a root module keeps its parameters unsharded after a forward, and
        their memory is freed at the next reshard, so only the sharded parameters are stable."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]

    @contextlib.contextmanager
    def _weights_as(self, quant: tuple[str, int] | None, dtype: torch.dtype | None) -> Iterator[None]:
        """For the duration, the parameters hold the master weights with the linear weights rounded to the grid of
        `quant` (format, int4 group) and everything rounded to `dtype`; afterwards the master weights are back,
        bit for bit. A backward inside gives the gradient at the rounded weights, which the optimizer applies to the
        master weights (a straight-through estimator, as mixed-precision training and QAT do). A no-op when both
        are None."""
        if quant is None and dtype is None:
            yield
            return
        shards = self._param_shards()
        with torch.no_grad():
            master = [p.detach().clone() for p in shards]
        try:
            with torch.no_grad():  # inside the try: a format that refuses a tensor leaves the master weights intact
                if quant is not None:
                    self._fake_quantize(shards, *quant)
                if dtype is not None:
                    for p in shards:
                        p.copy_(p.to(dtype))
            yield
        finally:
            with torch.no_grad():
                for p, m in zip(shards, master, strict=True):
                    p.copy_(m)

    def _fake_quantize(self, shards: list[torch.Tensor], fmt: str, group_size: int) -> None:
        """Round this rank's part of every linear weight to `fmt`'s grid, as the whole (HF-layout) tensor rounds.

        A sharded DTensor is gathered whole first (the scales of a tensor or of a block span ranks) and this rank
        keeps its slice: a collective that every rank runs in the same order. Plain tensors (megatron) round as they
        are; its config admits only the formats whose scales are local to a row's block (int4, mxfp8)."""
        from miles_sync import formats

        for (name, param), shard in zip(self.model.named_parameters(), shards, strict=True):
            if not formats.quantizable(name, param.shape):
                continue
            if hasattr(param, "full_tensor"):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                full = formats.fake_quantize(param.full_tensor(), fmt, group_size, name)
                shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
                part = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                shard.copy_(part)
            else:
                shard.copy_(formats.fake_quantize(shard, fmt, group_size, name))

    def _weights_as_pushed(self, active: bool = True) -> contextlib.AbstractContextManager[None]:
        """The weights of the ratio's denominator: rounded to the dtype the engines hold, under the trainer's own
        quantization (`train.quantization`). A push's quantization (`sync.quantization`) is not emulated here:
        with matching training it is the same grid; without, the trainer's π_old differs from the engine's
        π_rollout by the format's error, which is what TIS and MIS correct (and the PPO ratio starts at 1)."""
        return self._weights_as(self.train_quant, self.push_dtype) if active else contextlib.nullcontext()

    def _weights_for_forward(self) -> contextlib.AbstractContextManager[None]:
        """The weights the trainer's forward uses: `train.quantization`'s grid, then the push dtype when the policy
        trained is the policy pushed (`train.policy_weights`)."""
        return self._weights_as(self.train_quant, self.push_dtype if self._pushed_forward else None)

    def _replicas(self, param: torch.Tensor) -> int:
        """How many ranks hold the local data of `param` (so that global counts take each element once): for a
        DTensor, the mesh dimensions it is replicated over; a plain tensor is on every rank."""
        placements = getattr(param, "placements", None)
        if placements is None:
            return self.world_size
        return math.prod(param.device_mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())

    def _update_kept(self, before: list[torch.Tensor]) -> float:
        """Of the weights this step changed, the share whose pushed (rounded) value changed too (all ranks)."""
        changed = kept = 0.0
        shards = self._param_shards()  # reshards FSDP2 modules: parameters() below are the sharded ones
        with torch.no_grad():
            for param, p, old in zip(list(self.model.parameters()), shards, before, strict=True):
                moved = p != old
                share = 1.0 / self._replicas(param)
                changed += int(moved.sum()) * share
                kept += int((moved & (p.to(self.push_dtype) != old.to(self.push_dtype))).sum()) * share
        counts = torch.tensor([changed, kept], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        return float(counts[1] / counts[0]) if counts[0] > 0 else 1.0

    def _my_rows(self, num_rows: int) -> list[int]:
        return list(range(self.dp_rank, num_rows, self.dp_size))

    def _token_logprobs(
        self, model: Any, c: Collated, temperature: float, with_entropy: bool = False, entropy_grad: bool = False
    ):
        if model is self.model:  # the policy: its routers meet the engine's routing (miles_train.routing)
            with engine_routing(model, c.routed_experts, self.config.routing_replay, self.routing_agreement):
                logits = self._logits(model, c)
        else:
            logits = self._logits(model, c)
        return logprobs_from_logits(logits, c, temperature, with_entropy, entropy_grad)

    def _collate(self, batch: TrainBatch) -> Collated:
        c = collate(batch, self.pad_token_id)
        if self.device.type != "cpu":
            for field_name, value in vars(c).items():
                if value is not None:
                    setattr(c, field_name, value.to(self.device))
        return c

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self._dp_group())
        return t.tolist()

    def _agreed(self, check: Any) -> Any:
        """`check()`, with every rank agreeing on its outcome before any goes on: a rank whose rows fail it must not
        leave the others waiting in the backward's collectives. Every rank raises the failing rank's message."""
        try:
            value, message = check(), ""
        except ObjectiveError as exc:
            value, message = None, str(exc)
        messages: list = [None] * self.world_size
        dist.all_gather_object(messages, message)
        failed = next((m for m in messages if m), "")
        if failed:
            raise ObjectiveError(failed)
        return value

    def _quantile(self, parts: list[torch.Tensor], q: float) -> float:
        """The `q` quantile of the values all data-parallel ranks collected (tensor-parallel peers hold the same)."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self.dp_rank, torch.cat(parts) if parts else torch.zeros(0)))
        values = torch.cat(list(dict(gathered).values()))  # keyed by data-parallel rank: each token once
        return float(torch.quantile(values.double(), q)) if values.numel() else 0.0

    @torch.no_grad()
    def _padded_logprobs(self, batch: TrainBatch, as_pushed: bool | None = None, model: Any = None) -> torch.Tensor:
        """Logprobs of the whole batch, [B, T-1], identical on every rank: under the weights the forward uses,
        or (`as_pushed`) under the weights as pushed; or under `model` (the reference) as it is."""
        rows = self._my_rows(len(batch))
        if model is not None:
            weights: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            model, weights = self.model, self._weights_as_pushed() if as_pushed else self._weights_for_forward()
        with weights:
            logprobs, _ = self._token_logprobs(model, self._collate(batch.select(rows)), batch.temperature)
        return self._gather_rows(batch, rows, logprobs)

    @torch.no_grad()
    def _padded_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values of the whole batch, [B, T-1], identical on every rank."""
        rows = self._my_rows(len(batch))
        return self._gather_rows(batch, rows, self.critic.values(self._collate(batch.select(rows))))

    def _gather_rows(self, batch: TrainBatch, rows: list[int], part: torch.Tensor) -> torch.Tensor:
        """[B, T-1] of the whole batch from each data-parallel rank's `rows` of it (`part`, [len(rows), ≤ T-1])."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (rows, part.cpu()))  # tensor-parallel peers send the same rows
        width = max(len(ids) for ids in batch.input_ids) - 1
        full = torch.zeros((len(batch), width))
        for part_rows, values in gathered:
            full[part_rows, : values.shape[1]] = values
        return full

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return unpad_response(self._padded_logprobs(batch), batch)

    def shutdown(self) -> None:
        self.group.close()
