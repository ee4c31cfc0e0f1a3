"""Rollout routing replay (train.routing_replay) and the routing agreement, on a tiny Qwen3-MoE as transformers
builds it: the routers take the engine's experts where it gave some, weigh them with their own probabilities (the
router still learns), and count how often their own choice was the engine's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_control.testing.tiny_models import tiny_model
from miles_train.collate import collate
from miles_train.routing import Agreement, engine_routing, routers
from miles_train.types import TrainBatch


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_model(request.param, vocab_size=19)).eval()


def own_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, layers × top_k]: the experts the model's routers choose, as an engine would return them."""
    found, chosen = routers(model), {}
    hooks = [r.register_forward_hook(lambda m, i, out, layer=layer: chosen.__setitem__(layer, out[2]))
             for layer, r in found.items()]  # fmt: skip
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    b, t = ids.shape
    return torch.stack([chosen[layer].view(b, t, -1) for layer in sorted(chosen)], dim=2).view(b, t, -1)


def test_the_engines_routing_is_replayed_and_its_agreement_counted(moe):
    ids = torch.tensor([[3, 5, 7, 9, 11, 2], [4, 6, 8, 10, 12, 14]])
    engine = own_routing(moe, ids)
    assert len(routers(moe)) == 2 and engine.shape == (2, 6, 2 * 2)
    with torch.no_grad():
        plain = moe(input_ids=ids).logits
    agreement = Agreement()
    with torch.no_grad(), engine_routing(moe, engine, replay=True, agreement=agreement):
        same = moe(input_ids=ids).logits
    assert agreement.value == 1.0 and agreement.total == 2 * 6 * 2
    torch.testing.assert_close(same, plain)  # the engine chose what the trainer would: nothing changes

    other = engine.clone()
    other[0, 2, :2] = (other[0, 2, :2] + 1) % 4  # layer 0 of one position: other experts than the router's
    other[1, 4, 2:] = -1  # a position the engine gave nothing for, in layer 1: the trainer's own choice
    for replay in (False, True):
        agreement = Agreement()
        with torch.no_grad(), engine_routing(moe, other, replay=replay, agreement=agreement):
            logits = moe(input_ids=ids).logits
        assert agreement.total == 2 * 6 * 2 - 1 and agreement.same == agreement.total - 1
        if replay:  # position 2 of row 0 went through other experts: its logits (and only from there on) move
            assert not torch.allclose(logits[0, 2], plain[0, 2])
            torch.testing.assert_close(logits[0, :2], plain[0, :2])
            torch.testing.assert_close(logits[1], plain[1])
        else:
            torch.testing.assert_close(logits, plain)
    assert all("forward" not in vars(r) for r in routers(moe).values())  # the routers are themselves again


def test_the_router_still_learns_under_replay(moe):
    ids = torch.tensor([[3, 5, 7, 9]])
    engine = (own_routing(moe, ids) + 1) % 4  # every position elsewhere
    moe.zero_grad()
    with engine_routing(moe, engine, replay=True, agreement=Agreement()):
        moe(input_ids=ids).logits.sum().backward()
    for router in routers(moe).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_collate_lays_the_rows_routing_out_by_position():
    batch = TrainBatch(
        input_ids=[[1, 2, 3, 4], [1, 2, 3]],
        response_start=[2, 2],
        rollout_logprobs=[[0.0, 0.0], [0.0]],
        loss_mask=[[1, 1], [1]],
        rewards=[1.0, 0.0],
        group_index=[0, 0],
        routed_experts=[torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int16), None],
    )
    c = collate(batch)
    assert c.routed_experts is not None and c.routed_experts.shape == (2, 4, 2)
    assert c.routed_experts[0, :3].tolist() == [[0, 1], [2, 3], [1, 0]]
    assert (c.routed_experts[0, 3] == -1).all() and (c.routed_experts[1] == -1).all()
    assert batch.select([1]).routed_experts == [None]
    assert collate(batch.select([1])).routed_experts is None
