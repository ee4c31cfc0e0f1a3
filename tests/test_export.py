"""Issue 39, item 4: `miles export` of a checkpoint of each backend (fsdp2, megatron with TP=2, torchtitan) is an HF
folder that transformers loads with the trainer's logprobs, and that SGLang serves with the same logprobs."""

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_control.service.export import ExportError, export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "miles-train" / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from backend_rank import contract_batch  # noqa: E402
from model_matrix import TOY_PROMPTS, build_model  # noqa: E402
from test_backend_contract import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
LAYOUTS = [("fsdp2", 1), ("megatron-tp2", 2), ("torchtitan", 1)]


def logprobs(model, batch) -> list[list[float]]:
    """Per-token logprobs of each response, teacher-forced through an HF model."""
    out = []
    for ids, start in zip(batch.input_ids, batch.response_start, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[start - 1 : -1], -1).gather(-1, torch.tensor(ids[start:])[:, None])
        out.append(lp.squeeze(-1).tolist())
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each layout's checkpoint after one step (its trainer's logprobs then), exported as an HF folder."""
    work = tmp_path_factory.mktemp("export")
    model = build_model("qwen2.5", "float32", work / "model")
    out = {}
    for variant, world_size in LAYOUTS:
        result = run_ranks(model, world_size, work / variant, variant)
        (checkpoint,) = (work / variant).glob("ckpt-*")
        folder = export_checkpoint(checkpoint, work / f"hf-{variant}", model_folder=model)
        out[variant] = (checkpoint, folder, result["logprobs_after"])
    return model, out


@pytest.mark.parametrize("variant", [v for v, _ in LAYOUTS])
def test_transformers_loads_an_export_with_the_trainers_logprobs(exported, variant):
    model_folder, runs = exported
    checkpoint, folder, trainer = runs[variant]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not {"optimizer.pt", "trainer_state.json"} & names  # the policy only
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.dtype == torch.float32  # the model's own dtype (auto)
    ours = logprobs(model, contract_batch())
    for a, b in zip(ours, trainer, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5), (variant, a, b)
    before = AutoModelForCausalLM.from_pretrained(model_folder)
    assert not torch.equal(model.model.embed_tokens.weight, before.model.embed_tokens.weight)  # trained weights
    assert AutoTokenizer.from_pretrained(folder).encode("12+3=") == AutoTokenizer.from_pretrained(model_folder).encode(
        "12+3="
    )


def test_miles_export_chooses_a_dtype_and_never_overwrites(exported, tmp_path):
    model_folder, runs = exported
    checkpoint = runs["fsdp2"][0]
    cmd = [sys.executable, "-m", "miles_control.cli.main", "export", str(checkpoint), str(tmp_path / "bf16"), "--dtype",
           "bfloat16", "--model", str(model_folder)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16
    fp32 = AutoModelForCausalLM.from_pretrained(runs["fsdp2"][1])
    assert torch.equal(model.lm_head.weight, fp32.lm_head.weight.to(torch.bfloat16))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists and is not an empty folder" in again.stderr
    missing = subprocess.run(cmd[:4] + ["12", str(tmp_path / "x"), "--store", f"sqlite:///{tmp_path}/none.db"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2 and "no job 12" in missing.stderr
    with pytest.raises(ExportError, match="give --model"):
        export_checkpoint(checkpoint, tmp_path / "no-tokenizer")  # a checkpoint holds no tokenizer
    with pytest.raises(ExportError, match="--dtype"):
        export_checkpoint(checkpoint, tmp_path / "int8", model_folder, dtype="int8")


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_sglang_serves_an_export_with_the_logprobs_of_transformers(exported):
    """The megatron TP=2 export (the layout furthest from HF's): SGLang's logprob of every token it generates equals
    the teacher-forced one of transformers on the exported folder, which equals the trainer's (above)."""
    from miles_rollout.config import SGLangEngineConfig
    from miles_rollout.engines import build_engine
    from miles_rollout.types import GenerateRequest, SamplingParams

    folder = exported[1]["megatron-tp2"][1]
    engine = build_engine(SGLangEngineConfig(type="sglang", max_total_tokens=4096), folder, seed=0)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
        requests = [GenerateRequest(p, sampling, request_id=f"r{i}") for i, p in enumerate(TOY_PROMPTS)]
        results = asyncio.run(engine.generate(requests))
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for request, result in zip(requests, results, strict=True):
        assert result.output_ids
        ids = torch.tensor([request.input_ids + result.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(request.input_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(result.output_logprobs), expected, atol=1e-4)
