"""FSDP2 trainer backend: HF model, `fully_shard` per layer, gloo on CPU / NCCL on GPU, GRPO loss."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM

from miles_train.backends.fsdp2.parallelize import apply_fsdp
from miles_train.collate import collate, token_logprobs, unpad_response
from miles_train.config import TrainConfig
from miles_train.grpo import (
    clipped_policy_loss,
    group_advantages,
    kl_k3,
    staleness_weights,
    token_mean,
    truncated_is_weights,
)
from miles_train.types import TrainBatch

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Backend:
    """One data-parallel rank. Every rank receives the whole batch (advantages need whole groups)
    and trains on rows `rank::world_size`; gradients are averaged by FSDP2."""

    name = "fsdp2"

    def __init__(
        self,
        config: TrainConfig,
        model_path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        if config.backend.num_threads is not None:
            torch.set_num_threads(config.backend.num_threads)
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(
                backend, init_method=init_method or "tcp://127.0.0.1:29512", rank=rank, world_size=world_size
            )
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.model = self._load(model_path)
        self.model.train()
        self.pad_token_id = self.model.config.pad_token_id or 0
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.reference = None
        if config.grpo.kl_coef > 0:
            self.reference = self._load(model_path).eval().requires_grad_(False)
        self.step = 0

    def _load(self, model_path: str | Path) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(self.device)
        return apply_fsdp(model, self.config.backend.mixed_precision)

    def _my_rows(self, num_rows: int) -> list[int]:
        return list(range(self.rank, num_rows, self.world_size))

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _all_reduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        grpo = self.config.grpo
        advantages = group_advantages(batch.rewards, batch.group_index, grpo.normalize_std)
        minibatches = [list(range(len(batch)))[m :: grpo.num_minibatches] for m in range(grpo.num_minibatches)]
        sums = dict.fromkeys(
            ["loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio", "logprob_diff", "tis", "tis_clipfrac"], 0.0
        )
        tis_max = 0.0
        ages = batch.staleness if batch.staleness is not None else [0] * len(batch)
        sample_weights = staleness_weights(ages, grpo.staleness, grpo.staleness_decay, grpo.staleness_max)
        grad_norms = []
        old_logprobs = None
        if grpo.old_logprobs == "recompute":
            old_logprobs = self._padded_logprobs(batch)
        if len(batch) < grpo.num_minibatches * self.world_size:
            raise ValueError(
                f"fsdp2: a batch of {len(batch)} samples cannot give each of {self.world_size} ranks a row in "
                f"each of {grpo.num_minibatches} minibatches"
            )
        for rows in minibatches:
            # Token count of this minibatch over all ranks: the denominator of the token mean.
            num_tokens = float(sum(sum(batch.loss_mask[i]) for i in rows))
            local = [rows[i] for i in self._my_rows(len(rows))]
            part = batch.select(local)
            c = collate(part, self.pad_token_id)
            c = _to(c, self.device)
            logprobs, entropy = token_logprobs(self.model, c, batch.temperature, with_entropy=True)
            if old_logprobs is None:
                old = c.rollout_logprobs
            else:  # the whole batch is padded wider than this rank's part: trim the right padding
                old = old_logprobs[local][:, : c.loss_mask.shape[1]].to(self.device)
            adv = advantages[local].to(self.device)[:, None].expand_as(logprobs)
            pg, ratio, clipped = clipped_policy_loss(logprobs, old, adv, grpo.clip_eps, grpo.clip_eps_high)
            tis = torch.ones_like(pg)
            truncated = torch.zeros_like(pg, dtype=torch.bool)
            if grpo.tis_cap is not None:  # old = the trainer's recomputed old-policy logprobs
                tis, truncated = truncated_is_weights(old, c.rollout_logprobs, grpo.tis_cap)
                pg = pg * tis
                tis_max = max(tis_max, float((tis * c.loss_mask).max()))
            pg = pg * sample_weights[local].to(self.device)[:, None]
            per_token = pg
            kl = torch.zeros_like(pg)
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = token_logprobs(self.reference, c, batch.temperature)
                kl = kl_k3(logprobs, ref_logprobs)
                per_token = per_token + grpo.kl_coef * kl
            # FSDP2 averages gradients over ranks; × world_size turns that into the global token mean.
            loss = token_mean(per_token, c.loss_mask, num_tokens) * self.world_size
            loss.backward()
            if self.config.optimizer.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                grad_norms.append(float(norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            m = c.loss_mask
            with torch.no_grad():
                for key, value in (
                    ("loss", per_token),
                    ("pg_loss", pg),
                    ("kl", kl),
                    ("entropy", entropy),
                    ("clipfrac", clipped.float()),
                    ("ratio", ratio),
                    ("logprob_diff", (logprobs - c.rollout_logprobs).abs()),
                    ("tis", tis),
                    ("tis_clipfrac", truncated.float()),
                ):
                    sums[key] += float((value * m).sum())
        total_tokens = float(batch.num_response_tokens)
        reduced = self._all_reduce_sum(list(sums.values()))
        self.step += 1
        metrics = {f"train/{k}": v / max(total_tokens, 1.0) for k, v in zip(sums, reduced, strict=True)}
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["train/num_tokens"] = total_tokens
        metrics["train/advantage_abs_mean"] = float(advantages.abs().mean())
        metrics["train/tis_max"] = self._all_reduce_max(tis_max)
        metrics["train/sample_weight_mean"] = float(sample_weights.mean())
        return metrics

    @torch.no_grad()
    def _padded_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current-policy logprobs of the whole batch, [B, T-1], identical on every rank."""
        rows = self._my_rows(len(batch))
        c = _to(collate(batch.select(rows), self.pad_token_id), self.device)
        logprobs, _ = token_logprobs(self.model, c, batch.temperature)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (rows, logprobs.cpu()))
        width = max(len(ids) for ids in batch.input_ids) - 1
        full = torch.zeros((len(batch), width))
        for part_rows, part in gathered:
            full[part_rows, : part.shape[1]] = part
        return full

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return unpad_response(self._padded_logprobs(batch), batch)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = get_model_state_dict(self.model, options=_FULL)
        if self.rank == 0:
            yield from state.items()

    def save(self, directory: str | Path) -> None:
        """A checkpoint is an HF folder (config + model.safetensors) plus optimizer state."""
        directory = Path(directory)
        model_state = get_model_state_dict(self.model, options=_FULL)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(directory)
            save_file({k: v.contiguous() for k, v in model_state.items()}, str(directory / "model.safetensors"))
            torch.save(optim_state, directory / "optimizer.pt")
            (directory / "trainer_state.json").write_text(json.dumps({"step": self.step, "backend": self.name}))
        dist.barrier()

    def load(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        directory = Path(directory)
        model_state = load_file(str(directory / "model.safetensors"))
        set_model_state_dict(self.model, model_state, options=StateDictOptions(full_state_dict=True))
        optim_state = torch.load(directory / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state, options=StateDictOptions(full_state_dict=True)
        )
        self.step = json.loads((directory / "trainer_state.json").read_text())["step"]

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to(c, device: torch.device):
    if device.type == "cpu":
        return c
    for name, value in vars(c).items():
        setattr(c, name, value.to(device))
    return c
