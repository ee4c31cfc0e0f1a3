"""Vision-language models in the loop's two halves: the hf engine generates from prompts with images, and the fsdp2
trainer's model, given the same processor inputs, recomputes the engine's logprobs (fp32: to rounding); the images
reach both (another image changes the logprobs); an image placeholder is never sampled, so a response can always
be trained on."""

import asyncio
import io

import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is not installed (the vision extra)")

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_dir(request, tmp_path_factory):
    from miles_control.testing.tiny_models import save_tiny_vision_model

    return save_tiny_vision_model(tmp_path_factory.mktemp(request.param), request.param)


def _png(color: str, size: int = 56) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle([8, 8, 30, 40], fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _generate(vlm_dir, records, max_new_tokens=12, temperature=1.0):
    from miles_rollout.config import HFEngineConfig
    from miles_rollout.engines.hf import HFEngine
    from miles_rollout.prompts import load_encoder
    from miles_rollout.types import GenerateRequest, SamplingParams

    encoder = load_encoder(vlm_dir, "model")
    inputs = [encoder.inputs(r) for r in records]
    engine = HFEngine(vlm_dir, HFEngineConfig(dtype="float32"), seed=0)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True)
    requests = [GenerateRequest(ids, sampling, f"r{i}", mm) for i, (ids, mm) in enumerate(inputs)]
    return inputs, asyncio.run(engine.generate(requests)), encoder


def _train_batch(inputs, results):
    from miles_train.types import TrainBatch

    return TrainBatch(
        input_ids=[ids + r.output_ids for (ids, _), r in zip(inputs, results, strict=True)],
        response_start=[len(ids) for ids, _ in inputs],
        rollout_logprobs=[r.output_logprobs for r in results],
        loss_mask=[[1] * len(r.output_ids) for r in results],
        rewards=[0.0] * len(results),
        group_index=list(range(len(results))),
        multimodal=[mm for _, mm in inputs],
    )


def _trainer_logprobs(vlm_dir, batch, temperature=1.0):
    from miles_train.backends.fsdp2.convert import load_hf_model
    from miles_train.collate import collate, token_logprobs, unpad_response

    model = load_hf_model(vlm_dir, torch.device("cpu")).eval()
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, collate(batch), temperature)
    return unpad_response(logprobs, batch)


def test_the_trainer_recomputes_the_engines_logprobs_of_prompts_with_images(vlm_dir):
    from miles_rollout.types import PromptRecord

    records = [
        PromptRecord("how many?", "1", images=[_png("black")]),
        PromptRecord("and here?", "2", images=[_png("red"), _png("blue", 28)]),  # two images, two sizes
        PromptRecord("1+2=", "3"),  # a text prompt in the same left-padded batch
    ]
    inputs, results, _ = _generate(vlm_dir, records)
    batch = _train_batch(inputs, results)
    recomputed = _trainer_logprobs(vlm_dir, batch)
    for row, result in zip(recomputed, results, strict=True):
        assert len(result.output_ids) == 12
        assert max(abs(a - b) for a, b in zip(row, result.output_logprobs, strict=True)) < 1e-5
    # the images reach the trainer: the same ids with another image's pixels give other logprobs
    other = [(ids, dict(mm, pixel_values=torch.rand_like(mm["pixel_values"]))) if mm else (ids, mm)
             for ids, mm in inputs]  # fmt: skip
    changed = _trainer_logprobs(vlm_dir, _train_batch(other, results))
    assert max(abs(a - b) for a, b in zip(changed[0], recomputed[0], strict=True)) > 1e-3
    assert changed[2] == pytest.approx(recomputed[2], abs=1e-6)  # the text row has no image to change


def test_an_image_placeholder_is_never_sampled(vlm_dir):
    """A random model over a 51-id vocabulary would sample `<|image_pad|>` about once in 51 tokens; a response
    holding one could not be trained on (the model would look for an image's features)."""
    from miles_rollout.types import PromptRecord

    records = [PromptRecord("say", "1", images=[_png("black")]) for _ in range(16)]
    inputs, results, encoder = _generate(vlm_dir, records, max_new_tokens=32, temperature=2.0)
    placeholders = {encoder.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    sampled = [i for r in results for i in r.output_ids]
    assert len(sampled) == 16 * 32 and len(set(sampled)) > 30  # temperature 2: nearly every other id comes up
    assert not placeholders & set(sampled)
    # and the trainer's model gives them no probability either
    recomputed = _trainer_logprobs(vlm_dir, _train_batch(inputs, results), temperature=2.0)
    pairs = zip(recomputed, results, strict=True)
    assert max(abs(a - b) for row, r in pairs for a, b in zip(row, r.output_logprobs, strict=True)) < 1e-5


def test_an_episode_keeps_an_image_observation_token_faithful(vlm_dir):
    """A multi-turn episode whose environment answers with an image: the turn's ids hold the image's placeholders
    (expanded by the processor), the engine's next turn and the trainer both read its pixels, and the trainer's
    logprobs of every model turn are the engine's."""
    from miles_rollout.config import HFEngineConfig, RolloutConfig
    from miles_rollout.engine_client import EngineClient
    from miles_rollout.engines.hf import HFEngine
    from miles_rollout.generate import make_context, multi_turn
    from miles_rollout.prompts import load_encoder
    from miles_rollout.types import PromptRecord, SamplingParams

    config = RolloutConfig.model_validate({
        "engine": {"type": "hf"}, "generate": "multi_turn", "reward": "env",
        "environment": "miles_rollout.tasks.counting:RecountEnvironment",
    })  # fmt: skip
    encoder = load_encoder(vlm_dir, "model")
    context = make_context(config, encoder.tokenizer, encoder)
    client = EngineClient(HFEngine(vlm_dir, HFEngineConfig(dtype="float32"), seed=0))
    # a random model rarely ends a turn with its end token: a digit ends it here (what the environment reads)
    digits = tuple(encoder.tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=digits)
    eos = encoder.tokenizer.eos_token_id
    record = PromptRecord("how many squares?", "2", images=[_png("black")])

    async def episodes():
        samples = []
        for index in range(8):
            ctx = context.__class__(**{**vars(context), "group_index": index})
            samples.append(await multi_turn(record, client, sampling, ctx))
        return samples

    samples = asyncio.run(episodes())
    # an episode whose first answer ended with a stop token got the image observation and answered it
    two = [s for s in samples if s.metadata["episode"]["num_turns"] == 2]
    assert two, [s.metadata["episode"] for s in samples]
    pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for sample in two:
        assert sample.response_ids.count(pad) == 4  # the observation's 56-px image: 4 placeholders, not trained
        assert all(m == 0 for i, m in zip(sample.response_ids, sample.loss_mask, strict=True) if i == pad)
        assert sample.multimodal["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]  # the prompt's, then the turn's
        kinds = sample.multimodal["mm_token_type_ids"]
        ids = sample.prompt_ids + sample.response_ids
        assert kinds == [int(i == pad) for i in ids]
        assert "[image]and here?" in [m["content"] for m in sample.metadata["episode"]["messages"]]
        first_end = next(i for i, t in enumerate(sample.response_ids) if t in digits or t == eos)
        assert sample.loss_mask[: first_end + 1] == [1] * (first_end + 1)  # the first turn, trained
        assert sample.loss_mask[first_end + 1] == 0  # then the environment's turn, with its image
    batch = _train_batch([(s.prompt_ids, s.multimodal) for s in two], [_AsResult(s) for s in two])
    recomputed = _trainer_logprobs(vlm_dir, batch)
    for row, sample in zip(recomputed, two, strict=True):
        trained = [(a, b) for a, b, m in zip(row, sample.rollout_logprobs, sample.loss_mask, strict=True) if m]
        assert max(abs(a - b) for a, b in trained) < 1e-5


class _AsResult:
    """A sample's response as `_train_batch` reads an engine result (its ids and logprobs)."""

    def __init__(self, sample):
        self.output_ids, self.output_logprobs = sample.response_ids, sample.rollout_logprobs


def test_an_observation_image_that_cannot_be_read_ends_its_episode_counted(vlm_dir):
    """At run time a bad image cannot be refused before start: its episode ends as `bad_observation` (the metric
    `rollout/end_bad_observation` counts it), naming the image; the step goes on."""
    from miles_rollout.config import HFEngineConfig, RolloutConfig
    from miles_rollout.engine_client import EngineClient
    from miles_rollout.engines.hf import HFEngine
    from miles_rollout.env import StepResult
    from miles_rollout.generate import make_context, multi_turn
    from miles_rollout.prompts import load_encoder
    from miles_rollout.types import PromptRecord, SamplingParams

    class BrokenScreenshot:
        def reset(self, record):
            return None

        def step(self, action):
            parts = [{"type": "image", "image": b"\x89PNG not an image"}, {"type": "text", "text": "now?"}]
            return StepResult([{"role": "user", "content": parts}])

    config = RolloutConfig.model_validate({"engine": {"type": "hf"}, "generate": "multi_turn", "reward": "env",
                                           "environment": "miles_rollout.tasks.counting:RecountEnvironment"})  # fmt: skip
    encoder = load_encoder(vlm_dir, "model")
    ctx = make_context(config, encoder.tokenizer, encoder)
    ctx.make_environment = BrokenScreenshot  # an environment of this test's own, in place of the configured one
    client = EngineClient(HFEngine(vlm_dir, HFEngineConfig(dtype="float32"), seed=0))
    digits = tuple(encoder.tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=digits)
    sample = asyncio.run(multi_turn(PromptRecord("how many?", "1", images=[_png("red")]), client, sampling, ctx))
    episode = sample.metadata["episode"]
    assert episode["end_reason"] == "bad_observation", episode
    assert "an environment turn's image: not a readable image" in episode["error"]
    assert sample.multimodal["image_grid_thw"].tolist() == [[1, 4, 4]]  # the prompt's image only
