"""math-verify in a worker process, so that its time is bounded whatever thread scores.

math-verify bounds its own parsing and comparison with SIGALRM, which only a process's main thread may use; a
rollout scores on other threads (the `fully_async` schedule, Ray's). Here the checks run on the main thread of a
child process (`python -P -m miles_rollout.math_worker`), where math-verify's own limits work, and the parent
waits at most `hard_limit_s` for each answer: a child stuck in code the signal cannot interrupt (sympy in C) is
killed and the sample scores 0 (as math-verify scores what it cannot decide in time); so does a check whose child
dies (a crash in a C extension, the OOM killer). The next check starts a new child.

Protocol: one JSON object per line on the child's stdin and on a copy of its stdout (its stdout itself goes to
stderr, so a library's `print` cannot reach the parent as an answer). The child writes `{"ready": true}` once it
has imported math-verify and checked one answer; then for each `{"id", "label", "response"}` it answers
`{"id", "reward": 0.0 | 1.0}` or `{"id", "label_error": true}` (the label is not math). An answer with another
id, or a line that is not one, ends that child.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

# math-verify's own limits: 5 s for each parse (up to three: the label twice, the answer) and 5 s for each
# comparison of an extracted pair (up to four); the hard limit lets those act first.
HARD_LIMIT_S = 60.0
START_LIMIT_S = 120.0  # importing sympy and math-verify, on a loaded machine


class LabelError(ValueError):
    """The label does not parse as math (a data problem, not a wrong answer)."""


class _ChildGone(Exception):
    """The child exited, or answered out of protocol."""


class MathVerifier:
    """Checks answers against labels in one child process, one check at a time (thread-safe: a thread waits for
    the checks before it)."""

    def __init__(self, hard_limit_s: float = HARD_LIMIT_S) -> None:
        self.hard_limit_s = hard_limit_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._next_id = 0
        self.timeouts = 0  # checks cut by the hard limit
        self.crashes = 0  # checks whose child died or broke the protocol

    def check(self, label: str, response: str) -> float:
        """1.0 when `response`'s answer equals `label` mathematically, else 0.0 (also when the check runs past the
        hard limit or its child dies); LabelError when the label is not math; RuntimeError when no child starts."""
        with self._lock:
            child = self._running()
            self._next_id += 1
            request_id = self._next_id
            try:
                assert child.stdin is not None
                child.stdin.write(json.dumps({"id": request_id, "label": label, "response": response}) + "\n")
                child.stdin.flush()
                line = self._read_line(child, self.hard_limit_s)
                if line is None:
                    self.timeouts += 1
                    log.warning("math_verify: no answer in %.0f s for %.80r: scored 0", self.hard_limit_s, response)
                    self._stop()
                    return 0.0
                answer = json.loads(line)
                if not isinstance(answer, dict) or answer.get("id") != request_id:
                    raise _ChildGone(f"an answer out of protocol: {line[:80]!r}")
            except (_ChildGone, OSError, ValueError) as exc:  # ValueError: a line that is not JSON
                self.crashes += 1
                log.warning("math_verify: the worker failed on %.80r (%s): scored 0", response, exc)
                self._stop()
                return 0.0
            except BaseException:  # interrupted mid-request: the child may still answer it later; start afresh
                self._stop()
                raise
        if answer.get("label_error"):
            raise LabelError(f"the label {label[:60]!r} does not parse as math")
        return float(answer["reward"])

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _running(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop()
        # -P: the working directory (a Ray worker's) is not on the child's path, so no file there shadows a module.
        child = subprocess.Popen([sys.executable, "-P", "-m", "miles_rollout.math_worker"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
        self._child = child
        try:
            started = time.monotonic()
            line = self._read_line(child, START_LIMIT_S)
            if line is None or json.loads(line) != {"ready": True}:
                raise _ChildGone(f"no ready line in {time.monotonic() - started:.0f} s: {line!r:.80}")
        except (_ChildGone, OSError, ValueError) as exc:
            self._stop()
            raise RuntimeError(f"math_verify: the worker process did not start: {exc}") from None
        except BaseException:
            self._stop()
            raise
        return child

    @staticmethod
    def _read_line(child: subprocess.Popen, limit_s: float) -> str | None:
        """The child's next line, or None after `limit_s`; _ChildGone when it has exited. One request is in flight
        at a time and a wrong answer ends the child, so no line waits in the reader's buffer while the selector
        looks at the pipe."""
        assert child.stdout is not None
        with selectors.DefaultSelector() as selector:  # not select(): it fails on descriptors past 1023
            selector.register(child.stdout, selectors.EVENT_READ)
            if not selector.select(limit_s):
                return None
        line = child.stdout.readline()
        if not line:
            raise _ChildGone(f"the worker process exited (code {child.wait()})")
        return line

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(OSError):
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # a request the dead child never read cannot be flushed
                    stream.close()


def _serve() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the protocol

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify(parse("$1$"), parse("1"))  # the first check's lazy setup happens before the parent starts timing
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        label, response = request["label"], request["response"]
        gold = parse(label) or parse(f"${label}$")
        if not gold:
            protocol.write(json.dumps({"id": request["id"], "label_error": True}) + "\n")
            continue
        answer = parse(response)
        reward = float(bool(answer) and verify(gold, answer))
        protocol.write(json.dumps({"id": request["id"], "reward": reward}) + "\n")


if __name__ == "__main__":
    _serve()
