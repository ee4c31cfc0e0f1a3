"""The trainer: one class for every framework. It runs the update (`backends/update.py`), holds the side models
(PPO's critic, distillation's record of its teacher) and the weights as the engines hold them, and reaches the
framework only through the small `miles_train.protocol.Backend` it holds (`fsdp2`, `megatron`, `torchtitan`).

Every rank receives the whole batch (advantages need whole groups); data-parallel rank d trains on rows
d::dp_size; tensor-parallel peers take the same rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_train.backends import rows as row_ops
from miles_train.backends.checkpoint import check_teacher, folder_identity, save_teacher
from miles_train.backends.distributed import DistributedGroup
from miles_train.backends.weights_as import param_shards, weights_as
from miles_train.collate import Collated, collate, logprobs_from_logits, unpad_response
from miles_train.config import TrainConfig
from miles_train.objectives import build_objective
from miles_train.protocol import Backend, Rank
from miles_train.routing import Agreement, engine_routing
from miles_train.types import TrainBatch

log = logging.getLogger(__name__)


class Trainer:
    """One rank of a trainer (a `miles_train.protocol.TrainerBackend`): the framework's `Backend`, built by
    `make_backend` once this rank has joined the default process group, and everything around it."""

    def __init__(
        self,
        config: TrainConfig,
        model_path: str | Path,
        make_backend: Callable[[Rank, str | Path], Backend],
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        """Checks the rank count, sets torch's threads, joins the default process group, picks the device (this
        rank's GPU, else the host), builds the backend, then the side models."""
        if config.backend.world_size != world_size:
            raise ValueError(
                f"{config.backend.type}: started with {world_size} ranks but train.backend.world_size is "
                f"{config.backend.world_size}"
            )
        if config.backend.num_threads is not None:
            torch.set_num_threads(config.backend.num_threads)
        self.group = DistributedGroup(rank, world_size, init_method)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.critic: Any = None  # miles_train.critic.Critic, for an objective with needs_values (ppo)
        self.routing_agreement = Agreement()  # a mixture of experts: the trainer's routing against the engine's
        self._teacher_identity: dict[str, str] = {}
        self.step = 0
        self.objective = build_objective(config.algorithm)
        algorithm = config.algorithm
        self.aggregation = algorithm.aggregation or self.objective.aggregation
        self.kl_in_reward = self.objective.kl_in_reward if algorithm.kl_in_reward is None else algorithm.kl_in_reward
        self.lora_push = "adapter"  # train.lora: what a push sends (sync.lora: adapter | merge)
        self.set_push_dtype(None)
        self.backend = make_backend(Rank(config, rank, world_size, self.device), model_path)
        self.name = self.backend.name
        self.pad_token_id = getattr(self.backend.hf_config.get_text_config(), "pad_token_id", None) or 0
        self.backend.model.train()
        self._init_side_models(model_path)

    # ---- what the backend holds ----------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The policy (the backend's)."""
        return self.backend.model

    @property
    def reference(self) -> Any:
        """The frozen model of the KL term or the teacher (the backend's), or None."""
        return self.backend.reference

    # ---- what a push sends ---------------------------------------------------------------------
    def set_lora_push(self, mode: str) -> None:
        """With `train.lora`, what `export_weights` gives: the adapter alone (`adapter`, PEFT's names) or the merged
        weights under the model's own names (`merge`). No effect without an adapter."""
        if mode not in ("adapter", "merge"):
            raise ValueError(f"sync.lora: {mode!r} is not adapter or merge")
        self.lora_push = mode

    def set_push_dtype(self, dtype: str | None, quantization: str = "none", group_size: int = 128) -> None:
        """The dtype the engines hold the weights in (`float32`, `bfloat16`, `float16`; None: as the trainer) and
        the format the push quantizes the linear weights to (`sync.quantization`: then `old_logprobs: auto`
        recomputes the ratio's denominator, so the engines' quantized logprobs never enter the PPO ratio).

        When it is narrower than the fp32 master weights, a push rounds them: the trainer then forwards with the
        weights as pushed (`train.policy_weights`), recomputes the ratio's denominator under them
        (`algorithm.old_logprobs`), and reports how much of each update the rounding lets through."""
        held = None if dtype is None else getattr(torch, dtype)
        self.push_dtype: torch.dtype | None = held if held is not None and held.itemsize < 4 else None
        self.push_quant = None if quantization == "none" else (quantization, group_size)
        trained = self.config.quantization
        self.train_quant = None if trained == "none" else (trained, self.config.quant_group_size)
        policy, old = self.config.policy_weights, self.config.algorithm.old_logprobs
        self._pushed_forward = policy == "pushed" or (policy == "auto" and self.push_dtype is not None)
        rounds = self.push_dtype is not None or self.push_quant is not None
        self._recompute_old = old == "recompute" or (
            old == "auto" and (rounds or self.config.algorithm.corrects_rollout)
        )

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: rank 0 yields the HF-named tensors (with `train.lora` and `sync.lora: adapter`, the
        adapter alone under PEFT's names)."""
        return self.backend.export_weights(self.config.lora is not None and self.lora_push == "adapter")

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.export_shards()

    # ---- checkpoints and the side models -------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """The backend's checkpoint, then the side models (the critic, the teacher's record)."""
        self.backend.save(directory, self.step)
        if self.config.teacher is not None and self.rank == 0:
            save_teacher(directory, self.config.teacher, self._teacher_identity)
        if self.critic is not None:
            self.critic.save(directory, self.rank)
        dist.barrier()

    def load(self, directory: str | Path) -> None:
        """Resume from `save`'s folder: weights, optimizer state, step and side models."""
        self.step = self.backend.load(directory)
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

    def _init_side_models(self, model_path: str | Path) -> None:
        """The value model (train.critic), when the objective reads one: from train.critic.model, else the policy's
        checkpoint. With a teacher (distill), its identity, which every checkpoint records and a resume checks."""
        if self.config.teacher is not None:
            self._teacher_identity = folder_identity(self.config.teacher)
        if not self.objective.needs_values:
            return
        from miles_train.critic import Critic

        config = self.config.critic_config
        replicas = self.world_size // self.backend.dp_size  # ranks that train on the same rows (tensor-parallel peers)
        self.critic = Critic(config, config.model or model_path, self.config.optimizer, self.device, replicas)

    # ---- the weights a forward uses --------------------------------------------------------------
    def _weights_as_pushed(self, active: bool = True) -> contextlib.AbstractContextManager[None]:
        """The weights of the ratio's denominator: rounded to the dtype the engines hold, under the trainer's own
        quantization (`train.quantization`). A push's quantization (`sync.quantization`) is not emulated here:
        with matching training it is the same grid; without, the trainer's π_old differs from the engine's
        π_rollout by the format's error, which is what TIS and MIS correct (and the PPO ratio starts at 1)."""
        if not active:
            return contextlib.nullcontext()
        return weights_as(self.model, self.train_quant, self.push_dtype)

    def _weights_for_forward(self) -> contextlib.AbstractContextManager[None]:
        """The weights the trainer's forward uses: `train.quantization`'s grid, then the push dtype when the policy
        trained is the policy pushed (`train.policy_weights`)."""
        return weights_as(self.model, self.train_quant, self.push_dtype if self._pushed_forward else None)

    def _param_shards(self) -> list[torch.Tensor]:
        return param_shards(self.model)

    # ---- logprobs of the whole batch -------------------------------------------------------------
    def _my_rows(self, num_rows: int) -> list[int]:
        return row_ops.my_rows(self.backend.dp_rank, self.backend.dp_size, num_rows)

    def _token_logprobs(
        self, model: Any, c: Collated, temperature: float, with_entropy: bool = False, entropy_grad: bool = False
    ):
        if model is self.model:  # the policy: its routers meet the engine's routing (miles_train.routing)
            with engine_routing(model, c.routed_experts, self.config.routing_replay, self.routing_agreement):
                logits = self.backend.logits(model, c)
        else:
            logits = self.backend.logits(model, c)
        return logprobs_from_logits(logits, c, temperature, with_entropy, entropy_grad)

    def _collate(self, batch: TrainBatch) -> Collated:
        c = collate(batch, self.pad_token_id)
        if self.device.type != "cpu":
            for field_name, value in vars(c).items():
                if isinstance(value, dict):  # model_inputs
                    setattr(c, field_name, {key: tensor.to(self.device) for key, tensor in value.items()})
                elif value is not None:
                    setattr(c, field_name, value.to(self.device))
        return c

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
        return row_ops.gather_rows(self.world_size, batch, rows, logprobs)

    @torch.no_grad()
    def _padded_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values of the whole batch, [B, T-1], identical on every rank."""
        rows = self._my_rows(len(batch))
        return row_ops.gather_rows(self.world_size, batch, rows, self.critic.values(self._collate(batch.select(rows))))

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return unpad_response(self._padded_logprobs(batch), batch)

    # ---- the update ------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update on `batch` (`backends/update.py`): advantages of the whole batch, then per minibatch this rank's
        rows' loss terms, backward and an optimizer step (and the critic's); the metrics of every rank, reduced."""
        from miles_train.backends.update import train_step

        return train_step(self, batch)

    def shutdown(self) -> None:
        self.backend.shutdown()
        self.group.close()
