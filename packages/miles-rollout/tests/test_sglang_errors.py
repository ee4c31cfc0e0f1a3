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


# Stands in for the SGLang launcher in the test below: it binds its port the way uvicorn does, and fails as
# uvicorn does (exit code 3, "[Errno 98] ... address already in use") when another process holds it.
FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
try:
    server = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    sys.exit(3)
server.serve_forever()
"""


def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_another(tmp_path, monkeypatch):
    """SGLang binds its port only after loading the model; a port taken meanwhile is retried on a new one. The
    launcher is a stand-in here (the retry is Miles' code; what SGLang prints on a taken port is uvicorn's)."""
    import socket
    import sys

    from miles_rollout.engines.sglang import server as server_module

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = iter([taken])
    real_free_port = server_module.free_port
    monkeypatch.setattr(server_module, "free_port", lambda: next(ports, None) or real_free_port())
    monkeypatch.setattr(
        server_module,
        "server_command",
        lambda m, c, d, port, s, g: ([sys.executable, "-c", FAKE_SERVER, str(port)], {}),
    )
    try:
        server = server_module.SGLangServer("/m", SGLangEngineConfig(type="sglang"), "float32", 0, tmp_path)
        assert server.port == taken
        server.wait_ready(30)
        assert server.port != taken and server.url.endswith(f":{server.port}") and server.alive()
        failed = tmp_path / f"sglang-0.port-{taken}.log"
        assert "address already in use" in failed.read_text()  # the first attempt's log is kept
        server.stop()
    finally:
        held.close()
