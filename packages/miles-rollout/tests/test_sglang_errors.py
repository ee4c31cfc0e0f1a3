"""Bad input to the sglang engine fails at start-up with a message that names the engine."""

import importlib.util
import json
import shutil

import pytest

from miles_rollout import build_engine
from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.sglang.server import EngineStartError

pytestmark = pytest.mark.sglang


def test_unreachable_url_is_named(tiny_model_dir):
    config = SGLangEngineConfig(type="sglang", urls=["http://127.0.0.1:9/"])
    with pytest.raises(EngineStartError, match=r"sglang engine at http://127.0.0.1:9 is unreachable"):
        build_engine(config, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_model_sglang_cannot_load_fails_at_start_with_its_log(tiny_model_dir, tmp_path):
    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken-model")
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartError) as info:
        build_engine(SGLangEngineConfig(type="sglang", log_dir=str(tmp_path / "logs"), startup_timeout_s=120), broken)
    message = str(info.value)
    assert "sglang engine 0 exited with code" in message
    assert str(tmp_path / "logs" / "sglang-0.log") in message
    assert "NoSuchArchitectureForCausalLM" in message  # SGLang's own words, from the log tail


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_failure_after_launch_leaves_no_server_behind(tiny_model_dir, tmp_path):
    import subprocess

    import torch
    from safetensors.torch import load_file

    # Weights as pytorch_model.bin: SGLang serves them, but the engine checks weights from safetensors
    # files, so construction fails after the server is up.
    folder = shutil.copytree(tiny_model_dir, tmp_path / "bin-model", ignore=shutil.ignore_patterns("*.safetensors"))
    [weights] = tiny_model_dir.glob("*.safetensors")
    torch.save(load_file(str(weights)), folder / "pytorch_model.bin")
    with pytest.raises(EngineStartError, match="no \\*.safetensors weights"):
        build_engine(SGLangEngineConfig(type="sglang", log_dir=str(tmp_path / "logs")), folder)
    running = subprocess.run(["pgrep", "-f", f"--model-path {folder}"], capture_output=True, text=True).stdout
    assert not running.strip(), "the launched server must be stopped"
