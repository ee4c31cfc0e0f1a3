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
