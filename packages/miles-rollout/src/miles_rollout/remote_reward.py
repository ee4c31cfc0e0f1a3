"""`rollout.reward: remote`: rewards from an HTTP service (a reward model, a verifier, a sandbox), in batches.

The protocol is Miles' own, small enough to serve from any web framework:

    POST <url>   {"samples": [{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}, ...]}
    200          {"rewards": [0.0, 1.0, ...]}            one finite number per sample, in order

`metadata` holds the prompt record's extra fields and, for an episode, `metadata["episode"]` (its transcript).
A step's samples go in requests of `batch_size`, at most `max_concurrent_requests` at a time. A request that
times out, cannot connect or is answered 408, 429 or 5xx (but 501, 505) is retried `max_retries` times (waiting
`backoff_s`, doubled each time, or the answer's `Retry-After` seconds when longer, up to 60); another 4xx answer,
or an answer that is not one number per sample, fails at once. Errors name the URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from miles_rollout.config import RemoteRewardConfig
from miles_rollout.headers import resolve_headers
from miles_rollout.types import Sample

log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward service could not score a batch; the message names the URL and what went wrong."""


def _payload(sample: Sample) -> dict[str, Any]:
    return {"prompt": sample.prompt, "response": sample.response_text, "label": sample.label,
            "metadata": sample.metadata}  # fmt: skip


class RemoteReward:
    """A batched, async reward function (`rewards.score_all` calls it with a step's samples)."""

    batched = True

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config
        self.num_requests = 0  # sent, retries included

    async def __call__(self, samples: list[Sample]) -> list[float]:
        size = self.config.batch_size
        slots = asyncio.Semaphore(self.config.max_concurrent_requests)
        timeout = httpx.Timeout(self.config.timeout_s)
        async with httpx.AsyncClient(timeout=timeout, headers=resolve_headers(self.config.headers)) as client:
            chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
            answers = await asyncio.gather(*[self._post(client, slots, chunk) for chunk in chunks])
        return [reward for answer in answers for reward in answer]

    async def _post(self, client: httpx.AsyncClient, slots: asyncio.Semaphore, chunk: list[Sample]) -> list[float]:
        url, body = self.config.url, {"samples": [_payload(s) for s in chunk]}
        wait = self.config.backoff_s
        for attempt in range(self.config.max_retries + 1):
            last = attempt == self.config.max_retries
            try:
                async with slots:
                    self.num_requests += 1
                    response = await client.post(url, json=body)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.status_code not in _RETRIED and (
                    response.status_code < 500 or response.status_code in _FINAL
                ):
                    return self._rewards(response, len(chunk))
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
                wait = max(wait, _retry_after(response))
            if last:
                raise RemoteRewardError(
                    f"reward service {url}: {problem} (after {attempt + 1} attempts; rollout.remote_reward.max_retries"
                    f" {self.config.max_retries}, timeout_s {self.config.timeout_s})"
                )
            log.warning("reward service %s: %s; retrying in %.1f s", url, problem, wait)
            await asyncio.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def _rewards(self, response: httpx.Response, expected: int) -> list[float]:
        url = self.config.url
        if response.status_code >= 400:
            raise RemoteRewardError(f"reward service {url}: HTTP {response.status_code}: {response.text[:200]}")
        try:
            rewards = response.json()["rewards"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RemoteRewardError(
                f'reward service {url}: expected {{"rewards": [...]}}, got {response.text[:200]!r}'
            ) from None
        if not isinstance(rewards, list) or len(rewards) != expected:
            got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
            raise RemoteRewardError(f"reward service {url}: {got} rewards for {expected} samples")
        return rewards


_RETRIED = (408, 429)  # request timeout, too many requests: "try again later"
_FINAL = (501, 505)  # not implemented, HTTP version not supported: no retry will change them


def _retry_after(response: httpx.Response) -> float:
    """The seconds a `Retry-After: N` header asks for (at most 60; a date or nothing: 0)."""
    try:
        return min(max(float(response.headers.get("Retry-After", "")), 0.0), 60.0)
    except ValueError:
        return 0.0
