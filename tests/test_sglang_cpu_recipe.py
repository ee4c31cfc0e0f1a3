"""The CPU recipe of infra/cpu starts a real SGLang server on the built-in model, and SGLang's
logprobs agree with the in-process hf engine for the same tokens (the base of the sglang engine)."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from miles_rollout.engines.sglang.server import cpu_shim_path

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
sglang = pytest.importorskip("sglang", reason="SGLang is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def model_dir():
    from miles_control.job.assets import build_builtin_model
    from miles_control.spec.config import BuiltinModelConfig

    return build_builtin_model(BuiltinModelConfig())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(cpu_shim_path())}
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        "65536",
        "--sleep-on-idle",
        "--skip-server-warmup",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"SGLang exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/model_info", timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"SGLang did not start within 180 s; log {log}")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_sglang_greedy_tokens_and_logprobs_match_hf_engine(server, model_dir):
    from transformers import AutoTokenizer

    from miles_rollout import GenerateRequest, HFEngineConfig, SamplingParams, build_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in ("37+58=", "76+94=", "10+10=", "99+1=")]
    hf = build_engine(HFEngineConfig(), model_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    expected = asyncio.run(hf.generate([GenerateRequest(p, greedy) for p in prompts]))
    max_diff = 0.0
    for ids, ref in zip(prompts, expected, strict=True):
        out = post(
            f"{server}/generate",
            {"input_ids": ids, "return_logprob": True, "sampling_params": {"temperature": 0, "max_new_tokens": 6}},
        )
        assert out["output_ids"] == ref.output_ids
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        max_diff = max(max_diff, *(abs(a - b) for a, b in zip(logprobs, ref.output_logprobs, strict=True)))
    print(f"max abs logprob diff, sglang vs hf engine (fp32): {max_diff:.2e}")
    assert max_diff < 0.01, max_diff  # fp32 on both sides; STACK.md measured 0.0044 on another model
