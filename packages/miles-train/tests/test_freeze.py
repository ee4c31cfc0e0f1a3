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
from miles_train.freeze import check_patterns, checkpoint_names, matches

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


def test_the_checkpoint_names_are_read_from_its_headers(tiny_model_dir):
    names = checkpoint_names(tiny_model_dir)
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
    out, port = tmp_path / "freeze.pt", free_port()
    procs = [
        subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(tiny_model_dir), str(r), "2", str(port), str(out),
                          json.dumps(PATTERNS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    assert all(m["train/grad_norm"] > 0 for m in record["metrics"])
