"""Rewards for real tasks: math-verify, a remote reward service over real HTTP, batched and async reward functions."""

import asyncio
import importlib.util
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_rollout.config import RemoteRewardConfig, RolloutConfig
from miles_rollout.math_worker import LabelError, MathVerifier
from miles_rollout.rewards import RewardError, batched, resolve_reward, score_all
from miles_rollout.types import Sample


def sample(response: str, label: str, **metadata) -> Sample:
    return Sample(0, "q", label, [1], [2], [-0.1], [1], response_text=response, metadata=metadata)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed")
def test_math_verify_scores_equal_answers():
    fn = resolve_reward("math_verify")
    cases = [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("so x = 3", "3", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("no idea", "3", 0.0),
    ]
    for response, label, expected in cases:
        assert fn(sample(response, label)) == expected, (response, label)
    with pytest.raises(RewardError, match="the label '' does not parse as math"):
        fn(sample("3", ""))  # an empty label: a data bug, not a wrong answer
    # off the main thread (a rollout thread) too: the checks run in a worker process's main thread
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(sample("\\boxed{6}", "6"))))
    thread.start()
    thread.join()
    assert out == [1.0]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed")
def test_math_verify_bounds_the_time_of_a_check_and_survives_its_worker():
    """A check past the hard limit scores 0, its worker is replaced, and the next check is answered: math-verify's
    own SIGALRM limits cannot stop a rollout thread (this 50-term sum takes it about 3 s). A worker that dies
    during a check scores that sample 0 too, and the next check starts another."""
    verifier = MathVerifier()
    slow = "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(50)) + "}"
    try:
        assert verifier.check("3", "so x = 3") == 1.0
        first = verifier.pid
        verifier.hard_limit_s = 0.5  # for the slow check only: a fresh worker's first checks keep their margin
        started = time.monotonic()
        assert verifier.check("3", slow) == 0.0
        assert time.monotonic() - started < 2.5 and verifier.timeouts == 1 and verifier.pid is None
        verifier.hard_limit_s = 60.0
        assert verifier.check("0.5", "\\boxed{\\frac{1}{2}}") == 1.0 and verifier.pid not in (None, first)
        with pytest.raises(LabelError, match="the label '' does not parse as math"):
            verifier.check("", "3")
        doomed = verifier.pid
        killer = threading.Timer(0.5, os.kill, (doomed, signal.SIGKILL))  # mid-check: the slow one takes ~3 s
        killer.start()
        assert verifier.check("3", slow) == 0.0 and verifier.crashes == 1 and verifier.timeouts == 1
        killer.join()
        assert verifier.check("3", "3") == 1.0 and verifier.pid not in (None, doomed)
    finally:
        verifier.close()


def test_async_and_batched_reward_functions():
    calls = []

    @batched
    def by_batch(samples):
        calls.append(len(samples))
        return [float(len(s.response_text)) for s in samples]

    async def slow(s):
        await asyncio.sleep(0.2)
        return 1.0

    samples = [sample("ab", "x"), sample("abc", "x")]
    assert asyncio.run(score_all(by_batch, samples, "b")) == [2.0, 3.0] and calls == [2]
    loop_start = asyncio.run(_timed(score_all(slow, samples * 5, "s")))
    assert loop_start < 1.5  # ten 0.2 s calls awaited together

    class Scorer:  # an object with an async __call__ (a reward model's client) is awaited as well
        async def __call__(self, s):
            return float(len(s.response_text))

    assert asyncio.run(score_all(Scorer(), samples, "scorer")) == [2.0, 3.0]

    @batched
    def short(samples):
        return [1.0]

    with pytest.raises(RewardError, match=r"reward 'short' \(batched\) returned 1 rewards for 2 samples"):
        asyncio.run(score_all(short, samples, "short"))


async def _timed(coro) -> float:
    start = asyncio.get_running_loop().time()
    await coro
    return asyncio.get_running_loop().time() - start


class RewardService:
    """A real HTTP reward service on a free port: scores len(response) and can fail on purpose."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.fail_first = 0  # answer fail_status to this many requests first
        self.fail_status = 503
        self.mode = "ok"
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.bodies.append({"body": body, "key": self.headers.get("X-Key")})
                if service.fail_first > 0:
                    service.fail_first -= 1
                    return self._send(service.fail_status, b"busy")
                if service.mode == "hang":
                    threading.Event().wait(2)
                if service.mode == "bad":
                    return self._send(400, b"bad samples")
                if service.mode == "garbage":
                    return self._send(200, b"<html>")
                rewards = [float(len(s["response"])) for s in body["samples"]]
                if service.mode == "short":
                    rewards = rewards[:-1]
                return self._send(200, json.dumps({"rewards": rewards}).encode())

            def _send(self, code, payload):
                self.send_response(code)
                if code == 429:
                    self.send_header("Retry-After", "0.3")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def service():
    svc = RewardService()
    yield svc
    svc.server.shutdown()


def remote(url: str, **fields) -> object:
    config = RemoteRewardConfig(url=url, **{"batch_size": 3, "backoff_s": 0.01, **fields})
    return resolve_reward("remote", config)


def test_remote_reward_batches_and_retries(service, monkeypatch):
    fn = remote(service.url, headers={"X-Key": "k1"})
    samples = [sample("a" * i, "x", episode={"num_turns": i}) for i in range(7)]
    assert asyncio.run(score_all(fn, samples, "remote")) == [float(i) for i in range(7)]
    sizes = sorted(len(b["body"]["samples"]) for b in service.bodies)
    assert sizes == [1, 3, 3] and {b["key"] for b in service.bodies} == {"k1"}
    sent = [s for b in service.bodies for s in b["body"]["samples"]]
    assert sorted(s["metadata"]["episode"]["num_turns"] for s in sent) == list(range(7))  # the episode travels
    service.bodies.clear()
    service.fail_first = 2  # two 503s, then answers: retried
    assert asyncio.run(score_all(fn, samples[:2], "remote")) == [0.0, 1.0] and len(service.bodies) == 3
    service.bodies.clear()
    keyed = remote(service.url, headers={"X-Key": "${MILES_TEST_REWARD_KEY}"})  # read from the environment
    with pytest.raises(
        RuntimeError, match=r"headers.X-Key: \$\{MILES_TEST_REWARD_KEY\} names the environment variable"
    ):
        asyncio.run(score_all(keyed, samples[:1], "remote"))
    monkeypatch.setenv("MILES_TEST_REWARD_KEY", "k2")
    assert asyncio.run(score_all(keyed, samples[:1], "remote")) == [0.0] and service.bodies[-1]["key"] == "k2"
    service.bodies.clear()
    service.fail_first, service.fail_status = 1, 429  # too many requests: retried after its Retry-After (0.3 s)
    took = asyncio.run(_timed(score_all(fn, samples[:2], "remote")))
    assert len(service.bodies) == 2 and took >= 0.3


@pytest.mark.parametrize(
    ("mode", "fields", "match"),
    [
        ("hang", {"timeout_s": 0.3, "max_retries": 1}, r"ReadTimeout.*after 2 attempts"),
        ("bad", {}, "HTTP 400: bad samples"),
        ("garbage", {}, r"expected \{\"rewards\": \[...\]\}, got '<html>'"),
        ("short", {}, "2 rewards for 3 samples"),
        ("503", {"max_retries": 2}, r"HTTP 503: busy \(after 3 attempts"),
        ("501", {"max_retries": 2}, r"HTTP 501: busy$"),  # not implemented: no retry changes that
    ],
)
def test_remote_reward_errors_name_the_service(service, mode, fields, match):
    from miles_rollout.remote_reward import RemoteRewardError

    service.mode = mode
    if mode in ("503", "501"):
        service.fail_first, service.fail_status = 100, int(mode)
    fn = remote(service.url, **fields)
    with pytest.raises(RemoteRewardError, match=match) as info:
        asyncio.run(score_all(fn, [sample("a", "x")] * 3, "remote"))
    assert service.url in str(info.value)


def test_remote_reward_settings_are_validated():
    with pytest.raises(ValueError, match="reward: remote needs rollout.remote_reward"):
        RolloutConfig(reward="remote")
    with pytest.raises(ValueError, match="url: 'ftp://x' is not an http"):
        RemoteRewardConfig(url="ftp://x")
    fn = remote("http://127.0.0.1:9/nothing-listens", max_retries=0)
    from miles_rollout.remote_reward import RemoteRewardError

    with pytest.raises(RemoteRewardError, match="ConnectError"):
        asyncio.run(score_all(fn, [sample("a", "x")], "remote"))
