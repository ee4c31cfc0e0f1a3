"""rollout.dynamic_sampling: groups whose rewards all agree never reach the trainer, the step keeps its number of
groups, the surplus is aborted and everything is counted; rollout.overlong_penalty by hand.

The selection is checked on the real hf engine (every group of a launch finishes together there), and the abort of
the surplus on a scripted engine whose requests finish one group at a time (named as a test double: it stands in
for SGLang's concurrent calls, whose own `abort_requests` is in test_engine_contract.py)."""

import asyncio
import itertools

import pytest
from transformers import AutoTokenizer

from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, build_engine
from miles_rollout.config import DynamicSamplingConfig, OverlongPenaltyConfig, SamplingConfig
from miles_rollout.types import FinishReason, GenerateResult, Sample, SampleStatus


def prompts(kinds: str):
    """An endless prompt stream: `v` a prompt whose samples score differently, `u` one whose samples all agree."""
    records = (PromptRecord(f"{i}+1=", str(i), metadata={"kind": k}) for i, k in enumerate(itertools.cycle(kinds)))

    def draw(n: int) -> list[PromptRecord]:
        draw.count += n
        return list(itertools.islice(records, n))

    draw.count = 0
    return draw


def split_reward():
    """`v` prompts: 0, 1, 0, 1 … in scoring order (a group of 4 always varies); `u` prompts: always 0.5."""
    counter = itertools.count()

    def reward(sample: Sample) -> float:
        return float(next(counter) % 2) if sample.metadata["kind"] == "v" else 0.5

    return reward


def manager(engine, tokenizer, **ds) -> RolloutManager:
    config = RolloutConfig(
        num_samples_per_prompt=4,
        sampling=SamplingConfig(max_new_tokens=3),
        dynamic_sampling=DynamicSamplingConfig(**ds),
    )
    made = RolloutManager(engine, tokenizer, config)
    made.reward_fn = split_reward()
    return made


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return build_engine(HFEngineConfig(), tiny_model_dir, seed=1), AutoTokenizer.from_pretrained(tiny_model_dir)


def groups_of(batch) -> dict[int, list[Sample]]:
    out: dict[int, list[Sample]] = {}
    for s in batch.samples:
        out.setdefault(s.group_index, []).append(s)
    return out


def test_only_informative_groups_fill_the_step(hf):
    draw = prompts("uuv")  # one prompt in three is informative
    batch, chosen = asyncio.run(manager(*hf, oversample=2.0, max_rounds=10).generate_step(draw, 3))
    groups = groups_of(batch)
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 4 for g in groups.values())
    assert all(len({s.reward for s in g}) > 1 for g in groups.values())  # no zero-variance group
    assert [r.metadata["kind"] for r in chosen] == ["v"] * 3
    assert [groups[i][0].prompt for i in range(3)] == [r.prompt for r in chosen]  # group i is prompt i
    m = batch.metrics
    assert m["rollout/prompts_drawn"] == draw.count  # 6 (2 × 3 missing), then 2 × the groups still missing …
    dropped = m["rollout/ds_dropped_groups"]
    assert dropped == draw.count - 3 - m["rollout/ds_surplus_groups"] and dropped >= 4
    assert m["rollout/ds_used_samples"] == 12 and m["rollout/ds_padded_groups"] == 0
    assert m["rollout/ds_generated_samples"] == 4 * (3 + dropped + m["rollout/ds_surplus_groups"])


def test_a_step_that_stays_short_is_padded_and_counted(hf):
    draw = prompts("u")
    batch, chosen = asyncio.run(manager(*hf, oversample=1.0, max_rounds=2).generate_step(draw, 2))
    assert len(groups_of(batch)) == 2 and len(chosen) == 2
    m = batch.metrics
    assert m["rollout/ds_launches"] == 2 and draw.count == 4  # 2 missing, then 2 still missing: both spent
    assert m["rollout/ds_padded_groups"] == 2 and m["rollout/ds_dropped_groups"] == 2


class StaggeredEngine:
    """Test double: request i of group g answers after 0.05 × (g + 1) s with one token; `abort_requests` ends the
    named ones at once with finish reason abort (as SGLang's /abort_request does)."""

    name = "staggered"
    max_concurrent_calls = None
    weight_version = 0

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self._events: dict[str, asyncio.Event] = {}

    async def generate(self, requests):
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, request):
        group = int(request.request_id.split(":")[2].split("-")[0])  # client prefix : count : group-sample
        event = self._events.setdefault(request.request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=0.05 * (group + 1))
            return GenerateResult(request.request_id, [5], [-0.1], FinishReason.ABORT, [0])
        except TimeoutError:
            return GenerateResult(request.request_id, [5, 6], [-0.1, -0.2], FinishReason.STOP, [0])

    async def abort_requests(self, request_ids):
        self.aborted += request_ids
        for rid in request_ids:
            self._events.setdefault(rid, asyncio.Event()).set()


def test_the_surplus_is_aborted_in_the_engine_once_the_step_is_full(tiny_model_dir):
    engine = StaggeredEngine()
    made = manager(engine, AutoTokenizer.from_pretrained(tiny_model_dir), oversample=3.0, max_rounds=1)
    batch, chosen = asyncio.run(made.generate_step(prompts("v"), 2))  # 6 groups launched, 2 needed
    assert [r.prompt for r in chosen] == ["0+1=", "1+1="]  # the first to finish
    assert all(s.status != SampleStatus.ABORTED for s in batch.samples)
    m = batch.metrics
    assert m["rollout/ds_surplus_groups"] == 4 and m["rollout/ds_aborted_requests"] == 16
    assert len(engine.aborted) == 16 and m["rollout/ds_generated_samples"] == 8


def test_overlong_penalty_by_hand(hf):
    config = RolloutConfig(
        num_samples_per_prompt=1,
        sampling=SamplingConfig(max_new_tokens=10),
        overlong_penalty=OverlongPenaltyConfig(buffer=4, factor=0.5),
    )
    made = RolloutManager(hf[0], hf[1], config)
    sample = Sample(0, "p", "l", [1], [], [], [])
    # no penalty up to 10 − 4 = 6 tokens; then 0.5 × (length − 6) / 4; 0.5 at 10
    for length, penalty in ((3, 0.0), (6, 0.0), (7, 0.125), (9, 0.375), (10, 0.5)):
        sample.response_ids = [5] * length
        assert made._overlong(sample) == pytest.approx(penalty)
    with pytest.raises(ValueError, match="overlong_penalty.buffer: 12 is more than sampling.max_new_tokens"):
        RolloutConfig(sampling=SamplingConfig(max_new_tokens=10), overlong_penalty=OverlongPenaltyConfig(buffer=12))
    with pytest.raises(ValueError, match="num_samples_per_prompt ≥ 2"):
        RolloutConfig(num_samples_per_prompt=1, dynamic_sampling=DynamicSamplingConfig())
