"""miles_sync: the weight contract between trainers and rollout engines.

Senders publish full tensors under HF names and a `weight_version`; receivers load them by handle
and report a fingerprint that must equal the sender's. Exports load lazily (see `lazy.py`).
"""

from miles_sync.lazy import lazy_exports

_EXPORTS = {
    "SyncConfig": "config",
    "SyncBase": "config",
    "InprocSync": "config",
    "DiskSync": "config",
    "TensorSync": "config",
    "BroadcastSync": "config",
    "P2PSync": "config",
    "sync_config": "config",
    "Fingerprinter": "fingerprint",
    "weight_fingerprint": "fingerprint",
    "WeightReceiver": "protocol",
    "WeightSender": "protocol",
    "LoadsTensors": "protocol",
    "LoadsFolder": "protocol",
    "JoinsGroup": "protocol",
    "TRANSPORTS": "transports",
    "build_sender": "transports",
    "read_buckets": "transports",
    "receive": "transports",
    "needs_receiver_ranks": "transports",
    "sends_from_every_rank": "transports",
    "combine": "transports",
    "TIED_HEAD": "naming",
    "without_tied_head": "naming",
    "NamedTensor": "types",
    "NamedTensors": "types",
    "WeightHandle": "types",
    "AnyHandle": "types",
    "InprocHandle": "types",
    "DiskHandle": "types",
    "TensorHandle": "types",
    "BroadcastHandle": "types",
    "Rendezvous": "types",
    "P2PHandle": "types",
    "SenderPart": "types",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
