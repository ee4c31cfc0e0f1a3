"""RolloutBatch → TrainBatch: partial rollouts give each token its own age."""

import pytest

from miles_control.job.convert import to_train_batch
from miles_rollout.types import RolloutBatch, Sample, SampleStatus, SamplingParams


def sample(response: list[int], versions: list[int], token_versions: list[int], **kw) -> Sample:
    return Sample(
        group_index=0,
        prompt="p",
        label="l",
        prompt_ids=[5, 6],
        response_ids=response,
        rollout_logprobs=[-1.0] * len(response),
        loss_mask=[1] * len(response),
        weight_versions=versions,
        token_versions=token_versions,
        **kw,
    )


def test_a_sample_continued_across_pushes_gives_each_token_its_age():
    continued = sample([7, 8, 9, 10], [3, 4, 5], [3, 3, 4, 5])  # begun under 3, continued under 4, then 5
    whole = sample([7, 8], [5], [5, 5])
    unknown = sample([9], [4], [])  # a generate function that did not say: the sample's own age
    batch = RolloutBatch([continued, whole, unknown], sampling=SamplingParams())
    trained = to_train_batch(batch, [s.staleness(6) for s in batch.samples])
    assert trained.staleness == [3, 1, 2]
    assert trained.token_staleness == [[3, 3, 2, 1], [1, 1], [2]]
    assert trained.input_ids[0] == [5, 6, 7, 8, 9, 10]  # the engine's ids, both parts, untouched


def test_without_a_continued_sample_there_is_no_per_token_age():
    batch = RolloutBatch([sample([7, 8], [2], [2, 2]), sample([9], [1], [1])], sampling=SamplingParams())
    assert to_train_batch(batch, [1, 2]).token_staleness is None
    assert to_train_batch(batch).token_staleness is None  # sync: no staleness at all


def test_aborted_samples_leave_with_their_ages():
    dropped = sample([7], [1], [1], status=SampleStatus.ABORTED)
    kept = sample([8, 9], [1, 2], [1, 2])
    trained = to_train_batch(RolloutBatch([dropped, kept], sampling=SamplingParams()), [1, 1])
    assert trained.token_staleness == [[1, 0]]


def test_a_train_batch_refuses_ages_that_do_not_match_its_tokens():
    from miles_train.types import TrainBatch

    with pytest.raises(ValueError, match="row 0: 1 token_staleness entries for 2 response tokens"):
        TrainBatch([[1, 2, 3]], [1], [[-1.0, -1.0]], [[1, 1]], [0.0], [0], staleness=[0], token_staleness=[[0]])
