"""Router over two real SGLang servers: spreading, quarantine and re-admission, kill -9 recovery."""

import asyncio
import importlib.util
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_control.job.recorder import Recorder
from miles_control.job.runtime.rollout_worker import RolloutWorker
from miles_control.service.store import Store
from miles_rollout import FinishReason, GenerateRequest, SamplingParams, build_engine
from miles_rollout.config import SGLangEngineConfig
from miles_sync import DiskSync, build_sender

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = SGLangEngineConfig(
        type="sglang",
        num_engines=2,
        max_total_tokens=8192,
        max_requests_per_call=4,
        health_interval_s=1.0,
        health_timeout_s=3.0,
    )
    eng = build_engine(config, tiny_model_dir, seed=0)
    yield eng
    eng.shutdown()


def requests(n: int, sampling: SamplingParams) -> list[GenerateRequest]:
    return [GenerateRequest([3 + i % 10, 13, 4 + i % 7, 16], sampling, request_id=f"r{i}") for i in range(n)]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.2)


def test_least_outstanding_spreads_calls_over_both_servers(engine):
    before = [s.served for s in engine.slots]
    results = asyncio.run(engine.generate(requests(32, SamplingParams(max_new_tokens=20, ignore_eos=True))))
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(32))
    served = [s.served - b for s, b in zip(engine.slots, before, strict=True)]
    assert sum(served) == 8  # 32 requests in calls of 4
    assert min(served) >= 3, f"calls were not spread: {served}"


def test_paused_servers_are_not_mistaken_for_unhealthy(engine, tiny_model_dir, tmp_path):
    """A paused server does not answer /health_generate; pushes must not get it quarantined."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sender = build_sender(DiskSync(dir=str(tmp_path / "w")))
    events = [len(s.events) for s in engine.slots]

    async def push(version: int) -> None:
        await engine.pause("in_place")
        engine.receive(sender.publish([(n, p.detach() + version / 100) for n, p in model.named_parameters()], version))
        await asyncio.sleep(4.0)  # several health ticks (1 s) longer than the probe limit (3 s) while paused
        await engine.resume()

    for version in (10, 11):
        asyncio.run(push(version))
    assert [len(s.events) for s in engine.slots] == events, [s.events for s in engine.slots]
    assert all(s.admitted for s in engine.slots)
    out = asyncio.run(engine.generate(requests(8, SamplingParams(max_new_tokens=3))))
    assert all(r.weight_versions == [11] for r in out)
    sender.close()


def test_unhealthy_server_is_quarantined_then_readmitted(engine):
    victim, other = engine.slots[1], engine.slots[0]
    pgid = victim.server.process.pid
    os.killpg(pgid, signal.SIGSTOP)  # alive but not answering
    try:
        wait_for(lambda: not victim.admitted, 30, "the stopped server to be quarantined")
        served = victim.served
        results = asyncio.run(engine.generate(requests(12, SamplingParams(max_new_tokens=5))))
        assert len(results) == 12 and victim.served == served  # all went to the healthy server
        assert other.admitted
    finally:
        os.killpg(pgid, signal.SIGCONT)
    wait_for(lambda: victim.admitted, 60, "the server to be re-admitted")
    assert victim.restarts == 0  # it came back on its own; nothing was restarted
    assert any("quarantined" in e for e in victim.events) and "re-admitted" in victim.events[-1]
    served = victim.served
    asyncio.run(engine.generate(requests(16, SamplingParams(max_new_tokens=5))))
    assert victim.served > served  # it takes work again


def test_kill_9_mid_rollout_restarts_and_loses_nothing(engine, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = [(n, p.detach() + 0.02) for n, p in model.named_parameters()]
    sender = build_sender(DiskSync(dir=str(tmp_path / "w")))
    handle = sender.publish(weights, weight_version=3)
    assert engine.receive(handle) == handle.fingerprint

    victim = engine.slots[1]
    restarts = victim.restarts
    long = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True)
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(engine.generate(requests(24, long)))))
    worker.start()
    wait_for(lambda: victim.outstanding > 0, 30, "requests in flight on the victim")
    time.sleep(0.5)
    crashed_log = victim.server.log_path
    logged = crashed_log.read_text()
    os.kill(victim.server.process.pid, signal.SIGKILL)
    worker.join(timeout=600)
    assert not worker.is_alive()

    results = out["r"]
    ids = [r.request_id for r in results]
    assert len(ids) == len(set(ids)) == 24 and set(ids) == {f"r{i}" for i in range(24)}  # none lost, none twice
    assert all(r.finish_reason == FinishReason.LENGTH and len(r.output_ids) == 300 for r in results)
    assert all(r.weight_versions == [3] for r in results)

    wait_for(lambda: victim.admitted and victim.restarts == restarts + 1, 180, "the killed server to come back")
    # The restarted server logs to a file of its own: the killed one's log is kept whole (the crash's cause).
    assert victim.server.log_path == crashed_log.with_name(f"sglang-1.restart-{restarts + 1}.log")
    assert crashed_log.read_text().startswith(logged) and victim.server.log_path.stat().st_size > 0
    # ... and the restart is reported for the driver to record: an event and the rollout/engine_restarts metric.
    reported = RolloutWorker.engine_restarts(SimpleNamespace(engine=engine))  # the rollout actor's method
    assert [(r.index, r.restart, r.exit_code) for r in reported] == [(1, restarts + 1, -signal.SIGKILL)]
    assert reported[0].crashed_log == str(crashed_log) and reported[0].log == str(victim.server.log_path)
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    recorder = Recorder(store, store.create_job("restarts", {}))
    assert recorder.engine_restarts(4, reported) == {"rollout/engine_restarts": 1.0}
    [event] = [e for e in store.events(recorder.job_id) if e.kind == "engine_restart"]
    assert event.step == 4 and "sglang server 1 killed by signal 9" in event.message
    assert event.data["log"] == str(victim.server.log_path) and event.data["crashed_log"] == str(crashed_log)
    assert recorder.engine_restarts(5, RolloutWorker.engine_restarts(SimpleNamespace(engine=engine))) == {
        "rollout/engine_restarts": 1.0
    }  # taken once; the count runs on
    # The restarted server was given version 3 before it served: checksums verified, version label set.
    assert engine.weight_fingerprint() == handle.fingerprint
    after = asyncio.run(engine.generate(requests(16, SamplingParams(max_new_tokens=3))))
    assert all(r.weight_versions == [3] for r in after)
    sender.close()
