"""math-verify in a worker process, so that its time is bounded whatever thread scores.

math-verify bounds its own parsing and comparison with SIGALRM, which only a process's main thread may use; a
rollout scores on other threads (the `fully_async` schedule, Ray's). Here the checks run on the main thread of a
child process (`python -m miles_rollout.math_worker`), where math-verify's own limits work, and the parent waits
at most `hard_limit_s` for each answer: a child stuck in code the signal cannot interrupt (sympy in C) is killed,
the sample scores 0 (as math-verify scores what it cannot decide in time) and the next check starts a new child.

Protocol: one JSON object per line. The child writes `{"ready": true}` once it has imported math-verify; then for
each `{"label", "response"}` it answers `{"reward": 0.0 | 1.0}` or `{"label_error": true}` (the label is not math).
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

HARD_LIMIT_S = 20.0  # math-verify's own limits: 5 s per parse (two) and 5 s to compare
START_LIMIT_S = 120.0  # importing sympy and math-verify, on a loaded machine


class LabelError(ValueError):
    """The label does not parse as math (a data problem, not a wrong answer)."""


class MathVerifier:
    """Checks answers against labels in one child process, one check at a time (thread-safe)."""

    def __init__(self, hard_limit_s: float = HARD_LIMIT_S) -> None:
        self.hard_limit_s = hard_limit_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self.timeouts = 0  # checks cut by the hard limit

    def check(self, label: str, response: str) -> float:
        """1.0 when `response`'s answer equals `label` mathematically, else 0.0; LabelError when the label is not
        math; RuntimeError when the child cannot start or dies."""
        with self._lock:
            child = self._running()
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(json.dumps({"label": label, "response": response}) + "\n")
            child.stdin.flush()
            line = self._read_line(child, self.hard_limit_s)
            if line is None:
                self.timeouts += 1
                log.warning("math_verify: no answer within %.1f s for %.80r: scored 0", self.hard_limit_s, response)
                self._stop()
                return 0.0
            answer = json.loads(line)
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
        child = subprocess.Popen(
            [sys.executable, "-m", "miles_rollout.math_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        if self._read_line(child, START_LIMIT_S) is None:
            child.kill()
            child.wait()
            raise RuntimeError(f"math_verify: the worker process did not start within {START_LIMIT_S:.0f} s")
        self._child = child
        return child

    @staticmethod
    def _read_line(child: subprocess.Popen, limit_s: float) -> str | None:
        """The child's next line, or None after `limit_s`; RuntimeError when it has exited. One request is in
        flight at a time, so no line waits in the reader's buffer while select() looks at the pipe."""
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], limit_s)
        if not ready:
            return None
        line = child.stdout.readline()
        if not line:
            code = child.wait()
            raise RuntimeError(f"math_verify: the worker process exited (code {code})")
        return line

    def _stop(self) -> None:
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.wait()
            for stream in (self._child.stdin, self._child.stdout):
                if stream is not None:
                    stream.close()
            self._child = None


def _serve() -> None:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        label, response = request["label"], request["response"]
        gold = parse(label) or parse(f"${label}$")
        if not gold:
            print(json.dumps({"label_error": True}), flush=True)
            continue
        answer = parse(response)
        print(json.dumps({"reward": float(bool(answer) and verify(gold, answer))}), flush=True)


if __name__ == "__main__":
    _serve()
