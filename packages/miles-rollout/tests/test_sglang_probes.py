"""The router's health probes against a stand-in HTTP server on loopback that answers /health_generate as SGLang
0.5 does (no sooner than a second after the request). No SGLang is needed: what is tested is when the router
probes, not the server."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_rollout.engines.sglang.router import Router, Slot


class SlowHealth(BaseHTTPRequestHandler):
    probes: list[float] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        SlowHealth.probes.append(time.monotonic())
        time.sleep(1.0)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    SlowHealth.probes = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SlowHealth)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_busy_server_that_answers_is_not_probed_so_a_push_never_waits_for_a_probe(server):
    slot = Slot(index=0, url=server)
    router = Router([slot], recover=lambda s: None, health_interval_s=0.3, health_timeout_s=5.0, busy=threading.Lock())
    try:
        time.sleep(1.5)  # idle: probed every interval (each probe takes a second)
        assert len(SlowHealth.probes) >= 1

        slot.outstanding = 1  # busy, and answering calls
        stop = threading.Event()

        def answering():
            while not stop.wait(0.1):
                slot.answered_at = time.monotonic()

        feeder = threading.Thread(target=answering, daemon=True)
        feeder.start()
        time.sleep(1.2)  # a probe in progress ends
        before = len(SlowHealth.probes)
        time.sleep(2.0)
        assert len(SlowHealth.probes) == before, "a busy server that answers calls was probed"
        began = time.monotonic()
        router.hold(wait_for_probe=True)  # what a push does before pausing busy servers
        assert time.monotonic() - began < 0.2
        router.release_hold()

        stop.set()  # it stops answering: probed again once an interval has passed without an answer
        feeder.join()
        time.sleep(1.5)
        assert len(SlowHealth.probes) > before, "a busy server that stopped answering was never probed"
    finally:
        router.stop()
