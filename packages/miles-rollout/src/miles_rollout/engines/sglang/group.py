"""The collective-group way in (`broadcast`): the servers join the trainer's weight group and take each bucket as
it is broadcast, while this process joins too and receives its own copy (what the check and recovery need).

Ranks: 0 the trainer, 1 this process, then each server's `rank_offset + tp_rank`. A quarantined server cannot
take its ranks, so this process stands in for them (and the server gets the weights when it is re-admitted).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from miles_rollout.engines.sglang.calls import ServerCalls, tp_size
from miles_rollout.engines.sglang.pause import PauseControl
from miles_rollout.engines.sglang.router import Slot
from miles_sync import BroadcastHandle, NamedTensor
from miles_sync.protocol import Buckets


def group_ranks(slots: list[Slot]) -> tuple[dict[int, int], int]:
    """Each server's first rank in the weight group (by slot index) and the ranks the group needs in all."""
    offsets, next_rank = {}, 2
    for slot in slots:
        offsets[slot.index] = next_rank
        next_rank += tp_size(slot)
    return offsets, next_rank


def receive_through_group(
    calls: ServerCalls,
    slots: list[Slot],
    pause: PauseControl,
    handle: BroadcastHandle,
    receive_as: Callable[[int], Buckets],
    offsets: dict[int, int],
) -> list[NamedTensor]:
    """Every admitted server joins `handle.group` and loads each bucket (`/update_weights_from_distributed`) while
    this process receives as rank 1 (and as the ranks of quarantined servers); returns this process's copy. On a
    failure the servers' calls end, then each closes its update and leaves the group, so that the engine can load
    the previous version into them."""
    group, layout = handle.group, handle.layout
    admitted = [s for s in slots if s.admitted]
    standins = [r for s in slots if not s.admitted for r in range(offsets[s.index], offsets[s.index] + tp_size(s))]
    name = group.group_name
    pool = ThreadPoolExecutor(max_workers=len(admitted) + len(standins) + 1)
    sessions: set[str] = set()  # servers inside /begin_weight_update … /end_weight_update
    try:
        # Joining blocks until every rank is there, so all joins run at once.
        join_body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "world_size": group.world_size,
            "group_name": name,
            "backend": group.backend,
        }
        joins = [
            pool.submit(
                calls.post,
                s.url,
                "/init_weights_update_group",
                {**join_body, "rank_offset": offsets[s.index]},
                group.timeout_s,
            )
            for s in admitted
        ]
        mine = receive_as(1)
        theirs = [receive_as(r) for r in standins]
        received: list[NamedTensor] = []
        for index, bucket_layout in enumerate(layout):
            last = index == len(layout) - 1
            names, dtypes, shapes = (list(x) for x in zip(*bucket_layout, strict=True))
            body = {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": name,
                "load_format": "flattened_bucket",
            }
            if last:
                body["weight_version"] = str(handle.weight_version)
            loads = [
                pool.submit(
                    _load_distributed,
                    calls,
                    s.url,
                    {**body, **pause.cache_flush_flag(s, last)},
                    joins[i],
                    index,
                    sessions,
                )
                for i, s in enumerate(admitted)
            ]
            stand = [pool.submit(next, it) for it in theirs]
            received += next(mine)  # this process's share of the collective
            for f in stand + loads:
                f.result(timeout=group.timeout_s)
        for s in admitted:
            calls.post(s.url, "/destroy_weights_update_group", {"group_name": name})
    except BaseException:
        # Let the servers' calls in flight end (a collective that lost a rank ends at the group's timeout), then
        # close their update and leave the group, so that the engine can load the previous version (restore).
        pool.shutdown(wait=True, cancel_futures=True)
        for url in [s.url for s in admitted]:
            closing = [("/end_weight_update", {})] if url in sessions else []
            for path, body in [*closing, ("/destroy_weights_update_group", {"group_name": name})]:
                try:
                    calls.post(url, path, body)
                except Exception:  # noqa: BLE001 - the restore that follows checks the server
                    pass
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return received


def _load_distributed(calls: ServerCalls, url: str, body: dict, joined: Future, index: int, sessions: set[str]) -> None:
    """One bucket into one server, once it joined the group; the first opens its update, the last closes it."""
    joined.result()
    if index == 0:
        sessions.add(url)  # before the call: an answer lost on the way still leaves the update open
        calls.post(url, "/begin_weight_update")
    try:
        calls.post(url, "/update_weights_from_distributed", body)
    finally:
        if "weight_version" in body:  # the last bucket
            sessions.discard(url)
            calls.post(url, "/end_weight_update")
