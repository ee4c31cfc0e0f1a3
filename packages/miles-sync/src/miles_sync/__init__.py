"""miles_sync: the weight contract between trainers and rollout engines.

Senders publish full tensors under HF names and a `weight_version`; receivers load them by handle
and report a fingerprint that must equal the sender's. Exports load lazily (see `lazy_exports.py`).
"""

from miles_sync.lazy_exports import lazy_exports

_EXPORTS = {  # exported name → the submodule that defines it
    name: module
    for module, names in {
        "config": "SyncConfig SyncBase InprocSync DiskSync TensorSync BroadcastSync P2PSync sync_config",
        "fingerprint": "Fingerprinter weight_fingerprint",
        "protocol": "WeightReceiver WeightSender LoadsTensors LoadsFolder JoinsGroup",
        "transports": "TRANSPORTS build_sender read_buckets receive needs_receiver_ranks sends_from_every_rank combine",
        "naming": "TIED_HEAD without_tied_head is_lora lora_wire_name lora_param_name",
        "types": "NamedTensor NamedTensors WeightHandle AnyHandle InprocHandle DiskHandle TensorHandle "
        "BroadcastHandle Rendezvous P2PHandle SenderPart",
    }.items()
    for name in names.split()
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
