"""PPO's critic: a value model trained beside the policy, the same way on every trainer backend.

The value model is the transformer of an HF causal LM (transformers' `AutoModel`: the LM head is not loaded) with a
linear head from each position's last hidden state to one value: V at position t is the value of the state before
the token at t + 1 is generated, so values line up with the next-token logprobs and the loss mask (`collate`).

Every trainer rank holds a full replica, whatever the policy's layout (FSDP2 shards, tensor-parallel splits): each
data-parallel rank computes the loss on its own rows of a minibatch, divided by the token count of the whole
minibatch; the gradients are summed over every rank and divided by the number of ranks that hold the same rows
(tensor-parallel peers), which gives the gradient of the unsplit batch, the same bits on every rank, so the replicas
cannot drift apart even where a backward is not bitwise deterministic (attention kernels on GPU). It has its own
AdamW. Its memory is therefore a
whole fp32 copy of the transformer (and its optimizer state) per rank; sharding it like the policy is not built.

A checkpoint holds it in `<checkpoint>/critic/`: the transformer as an HF folder, `value_head.safetensors` and the
optimizer state. Such a folder can also start a new job's critic (`train.critic.model`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from miles_train.collate import Collated
from miles_train.config import CriticConfig, OptimizerConfig
from miles_train.loss import aggregate, value_loss

log = logging.getLogger(__name__)

CRITIC_DIR = "critic"
VALUE_HEAD = "value_head.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class ValueModel(torch.nn.Module):
    """A transformer and a linear value head; `forward` gives [B, T] values (fp32)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)  # every value starts at 0: the first advantages are the returns
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)


def load_value_model(path: str | Path, device: torch.device) -> ValueModel:
    """The value model of an HF folder: a causal LM's transformer with a zero head, or a saved critic with its head."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"train.critic.model: {folder} is not an HF model folder (no config.json)")
    backbone = AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    model = ValueModel(backbone, backbone.config.hidden_size)
    head = folder / VALUE_HEAD
    if head.is_file():
        model.head.load_state_dict(load_file(str(head)))
    return model.to(device)


class Critic:
    """The value model of one trainer rank, its optimizer, and its data-parallel update."""

    def __init__(
        self,
        config: CriticConfig,
        path: str | Path,
        optimizer: OptimizerConfig,
        device: torch.device,
        replicas: int = 1,
    ) -> None:
        """`replicas`: how many ranks train on the same rows (the tensor-parallel size; 1 for FSDP2)."""
        self.config = config
        self.device = device
        self.replicas = replicas
        self.model = load_value_model(path, device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr or 10 * optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        log.info("critic: value model from %s (%d parameters)", path, sum(p.numel() for p in self.model.parameters()))

    def _values(self, c: Collated) -> torch.Tensor:
        return self.model(c.input_ids, c.attention_mask)[:, :-1]  # [b, T-1]: aligned with the loss mask

    @torch.no_grad()
    def values(self, c: Collated) -> torch.Tensor:
        """[b, T-1] values of the rows of `c`, no gradient (in eval mode: no dropout in the values at rollout)."""
        self.model.eval()
        try:
            return self._values(c)
        finally:
            self.model.train()

    def minibatch_backward(
        self, c: Collated, returns: torch.Tensor, old_values: torch.Tensor, num_tokens: float
    ) -> dict[str, float]:
        """Forward and backward of the value loss of this rank's rows (token mean over the whole minibatch's
        `num_tokens`); the masked sums of the loss, the clip bit and the values."""
        values = self._values(c)
        per_token, clipped = value_loss(values, old_values, returns, self.config.value_clip)
        loss = aggregate(per_token, c.loss_mask, "token_mean", num_tokens, 1.0)
        loss.backward()
        m = c.loss_mask
        with torch.no_grad():
            return {
                "value_loss": float((per_token.detach() * m).sum()),
                "value_clipfrac": float((clipped.float() * m).sum()),
                "value_pred": float((values.detach() * m).sum()),
            }

    def step(self) -> float:
        """Reduce the gradients over every rank (one flat all-reduce), clip, step and zero them; the global norm
        before clipping."""
        params = list(self.model.parameters())
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        if self.replicas > 1:  # each row's loss was counted once by each of its tensor-parallel peers
            flat /= self.replicas
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(p)
            offset += g.numel()
        limit = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: str | Path, rank: int) -> None:
        """Collective: rank 0 writes `<directory>/critic` (the replicas are identical)."""
        from safetensors.torch import save_file

        if rank == 0:
            folder = Path(directory) / CRITIC_DIR
            folder.mkdir(parents=True, exist_ok=True)
            self.model.backbone.save_pretrained(str(folder), safe_serialization=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.model.head.state_dict().items()},
                      str(folder / VALUE_HEAD))  # fmt: skip
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        dist.barrier()

    def load(self, directory: str | Path) -> bool:
        """The value model and optimizer state of a checkpoint; False (and the critic as it is) when the checkpoint
        has none (written by another algorithm)."""
        folder = Path(directory) / CRITIC_DIR
        if not (folder / VALUE_HEAD).is_file():
            return False
        self.model.load_state_dict(load_value_model(folder, torch.device("cpu")).state_dict())  # the head with it
        state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=False)  # moved by load_state_dict
        self.optimizer.load_state_dict(state)
        return True
