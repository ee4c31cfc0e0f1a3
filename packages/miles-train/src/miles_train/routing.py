"""Rollout routing replay (`train.routing_replay`) and the routing agreement between engine and trainer.

A mixture of experts routes each token to its top-k experts. The engine's router and the trainer's see the same
weights but not the same arithmetic (another kernel, bf16 rounding, another batch), and a near-tie between two
experts' scores can fall either way: the token then goes through other experts in the trainer than at rollout, the
largest source of train/inference mismatch in MoE RL. The engine returns the experts it chose for every position
(SGLang's `return_routed_experts`); with `routing_replay` the trainer's routers take those experts, and weigh them
with their own (differentiable) probabilities, so the router still learns. Either way the trainer counts how often
its own top-k agrees with the engine's (`train/routing_agreement`).

The routers are transformers' top-k router modules, found by what they hold (`top_k`, a weight row per expert) and
checked by what they return (router logits, the chosen experts' weights, their indices), whether they weigh experts
by softmax (Qwen3-MoE, Mixtral) or by sigmoid with a scale (DeepSeek-V3),
megatron-core's `TopKRouter` (its `router_replay` hook chooses the top-k; tokens in its [sequence, batch] order) or
torchtitan's `TokenChoiceTopKRouter` (forward → the chosen experts' scores, their indices, every expert's score),
found by module name `…layers.<i>…`.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's top-k routers by layer index (empty for a dense model): megatron-core's and torchtitan's, and
    transformers' by what they are (`is_topk_router`), whatever their class is called (`Qwen3MoeTopKRouter`,
    `DeepseekV3TopkRouter`, ...)."""
    found = {}
    for name, module in model.named_modules():
        if _is_megatron(module) or _is_torchtitan(module) or is_topk_router(module):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"routing replay: router {name} ({type(module).__name__}) is not in a numbered layer")
            found[int(match.group(1))] = module
    return found


def is_topk_router(module: torch.nn.Module) -> bool:
    """transformers' top-k router, by what it holds: a `top_k` and one weight row per expert ([experts, hidden]).
    What it returns (router logits, the chosen experts' weights, their indices) is checked at its first forward."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(getattr(module, "top_k", None), int)
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and not isinstance(module, torch.nn.Linear | torch.nn.Embedding)
    )


class Agreement:
    """Positions × layers where the trainer's own top-k equals the engine's, and how many were compared."""

    def __init__(self) -> None:
        self.same = 0.0
        self.total = 0.0

    def reset(self) -> None:
        self.same = self.total = 0.0

    @property
    def value(self) -> float | None:
        return self.same / self.total if self.total else None


@contextlib.contextmanager
def engine_routing(
    model: torch.nn.Module, routed: torch.Tensor | None, replay: bool, agreement: Agreement
) -> Iterator[None]:
    """Within the block, every router of `model` compares its top-k with the engine's (`routed`: [B, T, layers ×
    top_k], −1 where the engine gave none) and, with `replay`, routes each position to the engine's experts. Without
    `routed` (a dense model, or an engine that returned no routing) nothing changes."""
    found = routers(model) if routed is not None else {}
    if routed is not None and not found:
        raise ValueError(
            f"routing replay: the engine returned each token's experts, but {type(model).__name__} has no top-k "
            "router miles can find (a module with `top_k` and a weight row per expert)"
        )
    if not found:
        yield
        return
    assert routed is not None
    first = next(iter(found.values()))
    top_k = first.topk if _is_megatron(first) else first.top_k  # torchtitan's router: top_k too
    routed = routed.view(*routed.shape[:2], -1, top_k)  # [B, T, layers, top_k]
    column = routing_columns(sorted(found), routed.shape[2])
    patched = []
    for layer, module in found.items():
        engine_layer = routed[:, :, column[layer]]
        own_forward = vars(module).get("forward")  # an instance's own forward (hooks), if any
        patched.append((module, own_forward, getattr(module, "router_replay", None)))
        if _is_megatron(module):
            _MegatronReplay(engine_layer, replay, agreement).install(module)
        elif _is_torchtitan(module):
            module.forward = _torchtitan_replaying(module, engine_layer, replay, agreement)
        else:
            module.forward = types.MethodType(_replaying(engine_layer, replay, agreement), module)
    try:
        yield
    finally:
        for module, own, router_replay in patched:
            if own is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own
            if _is_megatron(module):
                module.router_replay = router_replay


def routing_columns(layers: list[int], num_columns: int) -> dict[int, int]:
    """Which of the engine's routing columns each router layer reads. An engine packs the layers that have experts in
    order (the hf engine: a model whose first layers are dense has fewer columns than layers), or gives every layer
    its column (its index); layers without experts are skipped by position either way."""
    if num_columns == len(layers):
        return {layer: i for i, layer in enumerate(layers)}
    if num_columns > layers[-1]:
        return {layer: layer for layer in layers}
    raise ValueError(
        f"routing replay: the engine's routing has {num_columns} layers; the model has routers in layers {layers} "
        f"({len(layers)} of them)"
    )


def _is_megatron(module: torch.nn.Module) -> bool:
    """megatron-core's top-k router: it asks its `router_replay` (None by default) for the top-k."""
    return hasattr(module, "router_replay") and hasattr(module, "topk") and hasattr(module, "gating")


def _is_torchtitan(module: torch.nn.Module) -> bool:
    """torchtitan's token-choice top-k router."""
    return type(module).__name__ == "TokenChoiceTopKRouter" and hasattr(module, "route_norm")


def _torchtitan_replaying(router: Any, engine: torch.Tensor, replay: bool, agreement: Agreement) -> Any:
    """torchtitan's router forward, its top-k compared with the engine's ([B, T, top_k]) and, with `replay`, replaced
    where given: the chosen experts' scores taken from every expert's (softmax) scores, renormalised and scaled as the
    router does."""

    forward = router.forward

    def replaying(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        top_scores, own, scores = forward(x, *args, **kwargs)
        k = own.shape[-1]
        chosen = _choose(own.reshape(-1, k), engine.reshape(-1, k).long(), replay, agreement).view_as(own)
        if not replay:
            return top_scores, own, scores
        weights = scores.gather(-1, chosen)
        if router.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.route_scale, chosen, scores

    return replaying


def _choose(own: torch.Tensor, theirs: torch.Tensor, replay: bool, agreement: Agreement) -> torch.Tensor:
    """The experts each position goes to (`own`, `theirs`: [positions, top_k], −1 rows where the engine gave none):
    the engine's where given and `replay`, else the router's own; counts where both agree."""
    theirs = theirs.to(own.device)
    if theirs.shape != own.shape:
        raise ValueError(f"routing replay: the engine's routing is {tuple(theirs.shape)} for {tuple(own.shape)} "
                         "positions × experts")  # fmt: skip
    given = (theirs >= 0).all(dim=-1)
    with torch.no_grad():
        same = (own.sort(dim=-1).values == theirs.sort(dim=-1).values).all(dim=-1) & given
        agreement.same += float(same.sum())
        agreement.total += float(given.sum())
    return torch.where(given[:, None], theirs, own) if replay else own


class _MegatronReplay:
    """Stands in for megatron's RouterReplay on one router for one forward: the router's own top-k, compared with
    the engine's and replaced by it where given. Megatron's router flattens its [sequence, batch] input (the batch
    possibly padded, see the megatron backend), so the engine's [B, T] rows are laid out in that order."""

    def __init__(self, engine: torch.Tensor, replay: bool, agreement: Agreement) -> None:
        self.engine, self.replay, self.agreement = engine, replay, agreement
        self.shape: tuple[int, int] | None = None

    def install(self, router: torch.nn.Module) -> None:
        forward = router.forward

        def noting_shape(input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.shape = (input.shape[0], input.shape[1])  # [sequence, batch, hidden]
            return forward(input, *args, **kwargs)

        router.forward = noting_shape
        router.router_replay = self

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron's hook: (the chosen experts' scores, their indices) for `scores` [positions, experts]."""
        assert self.shape is not None and default_compute_topk is not None
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        seq, rows = self.shape
        engine = self.engine.to(own.device)
        padded = engine.new_full((rows, seq, engine.shape[-1]), -1)
        padded[: engine.shape[0], : engine.shape[1]] = engine[:rows, :seq]
        chosen = _choose(own, padded.transpose(0, 1).reshape(-1, engine.shape[-1]).long(), self.replay, self.agreement)
        return scores.gather(1, chosen), chosen


def _replaying(engine: torch.Tensor, replay: bool, agreement: Agreement) -> Any:
    """A transformers router's forward (class-level: (router logits, the chosen experts' weights, their indices)), its
    top-k compared with the engine's (`engine`: [B, T, top_k]) and, with `replay`, replaced where given: the
    engine's experts weighed as the router weighs its own (softmax or sigmoid scores, found by reproducing the
    router's own weights; renormalised with `norm_topk_prob`; scaled by `routed_scaling_factor`)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = type(self).forward(self, hidden_states)
        if not (isinstance(out, tuple) and len(out) == 3 and not out[2].is_floating_point()):
            raise ValueError(f"routing replay: router {type(self).__name__} does not return (logits, weights, "
                             "indices) as transformers' top-k routers do")  # fmt: skip
        logits, weights, own = out
        chosen = _choose(own, engine.reshape(-1, engine.shape[-1]).long(), replay, agreement)
        if not replay:
            return out
        weigh = _weighing(self, logits, weights, own)
        return logits, weigh(chosen).to(weights.dtype), chosen

    return forward


def _weighing(router: torch.nn.Module, logits: torch.Tensor, weights: torch.Tensor, own: torch.Tensor) -> Any:
    """How `router` weighs chosen experts, found from its own output: the scoring (softmax over the experts, or
    each expert's sigmoid) whose weights for its own choice are the ones it returned."""
    renormalise = getattr(router, "norm_topk_prob", True)  # Mixtral's router always renormalises
    scale = getattr(router, "routed_scaling_factor", 1.0)
    for score in (lambda x: torch.softmax(x, dim=-1), torch.sigmoid):
        scores = score(logits.float())

        def weigh(chosen: torch.Tensor, scores: torch.Tensor = scores) -> torch.Tensor:
            picked = scores.gather(-1, chosen)
            if renormalise:
                picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
            return picked * scale

        if torch.allclose(weigh(own).to(weights.dtype).float(), weights.float(), rtol=1e-3, atol=1e-5):
            return weigh
    raise ValueError(
        f"routing replay: router {type(router).__name__} weighs its experts neither by softmax nor by sigmoid scores "
        "(with norm_topk_prob and routed_scaling_factor): miles cannot weigh the engine's choice as it would"
    )
