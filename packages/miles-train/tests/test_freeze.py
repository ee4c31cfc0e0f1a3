"""train.freeze: the parameters its patterns name take no gradient and no optimizer state and never change, on
fsdp2 over two ranks; patterns are checked against the checkpoint's names before start and against the trainer's
model when it loads; backends that cannot map the names, and LoRA, are refused naming the field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from miles_control.testing.servers import free_port
from miles_train import TrainConfig
from miles_train.freeze import check_patterns, matches, parameter_names

RANK_SCRIPT = Path(__file__).with_name("freeze_rank.py")
PATTERNS = ["model.embed_tokens.*", "model.layers.0.*"]


def test_patterns_match_shell_style_and_a_pattern_that_matches_nothing_is_named():
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert matches(names, ["model.layers.?.mlp.*", "*.embed_tokens.*"]) == [names[1:], names[:1]]
    assert check_patterns(names, PATTERNS) == set(names[:2])
    with pytest.raises(ValueError, match=r"train.freeze\[1\]: 'visual\.\*' matches no parameter of the model"):
        check_patterns(names, ["model.layers.0.*", "visual.*"])
    with pytest.raises(ValueError, match="freeze every parameter"):
        check_patterns(names, ["*"])


def test_a_tied_head_is_named_as_the_embedding():
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match=r"ties its head to the embedding: model.embed_tokens.\* freezes both"):
        check_patterns(names, ["lm_head.*"])


def test_the_parameter_names_are_the_trainers_without_reading_a_weight(tiny_model_dir):
    """Built on the meta device from config.json: the same names the trainer's model has."""
    from transformers import AutoModelForCausalLM

    names = parameter_names(tiny_model_dir)
    assert names == [n for n, _ in AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).named_parameters()]
    assert "model.embed_tokens.weight" in names and any(n.startswith("model.layers.0.") for n in names)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"backend": "megatron", "freeze": ["model.layers.0.*"]}, "train.freeze: backend megatron"),
        ({"backend": "torchtitan", "freeze": ["model.layers.0.*"]}, "train.freeze: backend torchtitan"),
        ({"freeze": ["model.layers.0.*"], "lora": {}}, "train.freeze with train.lora"),
    ],
)
def test_a_freeze_a_backend_cannot_run_is_refused_naming_the_field(train, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig.model_validate(train)


@pytest.mark.slow
def test_frozen_parameters_never_change_and_hold_no_optimizer_state(tiny_model_dir, tmp_path):
    """Two steps, a checkpoint, a fresh trainer resuming from it and a third step: the frozen weights are the
    checkpoint's bit for bit throughout, the optimizer holds the trained ones only, before and after the resume."""
    out, ports = tmp_path / "freeze.pt", [str(free_port()), str(free_port())]
    procs = [
        subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(tiny_model_dir), str(r), "2", ports[0], str(out),
                          json.dumps(PATTERNS), str(tmp_path / "ckpt"), ports[1]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    record = torch.load(out, weights_only=False)
    frozen = set(record["frozen"])
    assert "model.embed_tokens.weight" in frozen and all(
        n == "model.embed_tokens.weight" or n.startswith("model.layers.0.") for n in frozen
    )
    assert record["optimizer_params"] == record["trainable"] == record["with_state"]
    assert record["trainable"] == len(record["before"]) - len(frozen)  # the tiny model's head is untied: exported
    for name, before in record["before"].items():
        changed = not torch.equal(before, record["after"][name])
        assert changed == (name not in frozen), name  # frozen: bit for bit the same; every other weight moved
    assert all(m["train/grad_norm"] > 0 for m in record["metrics"] + [record["resumed_metrics"]])
    assert record["resumed_with_state"] == record["with_state"]  # the optimizer state resumed, of the trained ones
    for name, saved in record["after"].items():
        assert torch.equal(record["loaded"][name], saved), name  # the checkpoint holds every weight
        moved = not torch.equal(record["third"][name], saved)
        assert moved == (name not in frozen), name
