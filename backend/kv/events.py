"""KV-cache events for prefix-aware routing, as vLLM publishes them (`kv_events_config`, vLLM's
`--kv-events-config` keys; docs/gateway.md).

What enters and leaves the prefix cache becomes vLLM's events, BlockStored, BlockRemoved and
AllBlocksCleared, in one `KVEventBatch` per engine step that changed the cache. A router (the llm-d
KV-cache indexer behind the inference gateway's endpoint picker) subscribes and learns which replica
holds which prompt prefix.

The parts, each on its side of the engine's hot path:
- `KVEventCollector`, a BlockListener (backend/kv/block_manager.py): on the engine thread it only
  appends what the block manager tells it, and hands a step's records over at the step's end;
- `VllmEventEncoder`: records -> vLLM's events, with vLLM's block hashes (below);
- the publisher thread (backend/kv/event_publisher.py): msgpack over ZMQ PUB, a sequence number per
  batch, a bounded buffer of past batches served on a replay (ROUTER) socket.

Block hashes are vLLM's `sha256_cbor` chain, independent of our own cache keys
(block_manager.block_key): block i hashes `(hash of block i-1, tuple(its token ids), extra_keys)`,
serialized as canonical CBOR, with SHA-256; block 0's parent is NONE_HASH = sha256_cbor(seed), the
seed being PYTHONHASHSEED when set, else vLLM's fixed "vllm-none-hash"; extra_keys is
`(lora_name,)` under a LoRA adapter, else None. As vLLM does by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), events carry each hash as the unsigned 64-bit integer of
its last 8 bytes (big-endian), which is also what the indexer keeps of a byte hash.
"""
from __future__ import annotations

import hashlib
import os
import struct
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

from backend.kv.block_manager import BlockListener

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset (sha256 hashes)
# -- vLLM's block hashes --------------------------------------------------------------------------

def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949) of what vLLM's hash input holds: ints, bytes, str, None, tuples and
    lists. The same bytes as cbor2.dumps(value, canonical=True), which vLLM calls."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise OverflowError(f"{n} does not fit CBOR's 64-bit lengths")


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def none_hash_seed() -> str:
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def external_hash(digest: bytes) -> int:
    """A 32-byte block hash as events carry it: its last 8 bytes, big-endian (vLLM's int hashes)."""
    return int.from_bytes(digest[-8:], "big")


class VllmEventEncoder:
    """Collector records -> vLLM's events, in its array layout (msgspec's array_like tagged
    structs, trailing defaults left out): ["BlockStored", block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name], ["BlockRemoved", block_hashes, medium],
    ["AllBlocksCleared"]. Runs on the publisher thread: the hashing happens there.

    Our key -> vLLM digest for every cached block (`_live`, at most the cache's blocks), and for as
    many recently removed ones (`_recent`): a sequence may still extend a block whose key another
    block held and gave up, and its next block's hash needs that parent's."""

    def __init__(self, block_size: int, medium: str, capacity: int, seed: Optional[str] = None):
        self.block_size = block_size
        self.medium = medium
        self.none_hash = sha256_cbor(none_hash_seed() if seed is None else seed)
        self.capacity = max(1, capacity)
        self._live: dict[bytes, bytes] = {}
        self._recent: OrderedDict[bytes, bytes] = OrderedDict()
        self.num_unchained = 0  # stored runs left out: their parent's hash was no longer known

    def events(self, records: Sequence[tuple]) -> list[list]:
        out = []
        for record in records:
            event = getattr(self, "_" + record[0])(*record[1:])
            if event is not None:
                out.append(event)
        return out

    def _stored(self, keys: list[bytes], parent: bytes, root: bytes, token_ids: list[int],
                lora_name: Optional[str]) -> Optional[list]:
        if parent == root:
            digest, parent_hash = self.none_hash, None
        else:
            digest = self._live.get(parent) or self._recent.get(parent)
            if digest is None:
                self.num_unchained += 1
                return None
            parent_hash = external_hash(digest)
        extra = (lora_name,) if lora_name else None
        bs, hashes = self.block_size, []
        for i, key in enumerate(keys):
            digest = sha256_cbor((digest, tuple(token_ids[i * bs:(i + 1) * bs]), extra))
            self._live[key] = digest
            hashes.append(external_hash(digest))
        return ["BlockStored", hashes, parent_hash, list(token_ids), bs, None, self.medium, lora_name]

    def _removed(self, keys: list[bytes]) -> Optional[list]:
        hashes = []
        for key in keys:
            digest = self._live.pop(key, None)
            if digest is not None:  # None: its store was left out (unchained), so is its removal
                hashes.append(external_hash(digest))
                self._remember(key, digest)
        return ["BlockRemoved", hashes, self.medium] if hashes else None

    def _cleared(self) -> list:
        for key, digest in self._live.items():
            self._remember(key, digest)
        self._live.clear()
        return ["AllBlocksCleared"]

    def _remember(self, key: bytes, digest: bytes) -> None:
        self._recent[key] = digest
        self._recent.move_to_end(key)
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)


class KVEventCollector(BlockListener):
    """The engine-thread side: the block manager's notifications as records, handed to `submit`
    once per step (`end_step`), which must not block (the publisher's queue put)."""

    def __init__(self, submit: Callable[[float, list[tuple]], None],
                 lora_name_of: Callable[[bytes], Optional[str]] = lambda root: None):
        self.submit = submit
        self.lora_name_of = lora_name_of
        self._names: dict[bytes, Optional[str]] = {b"": None}
        self._records: list[tuple] = []

    def blocks_stored(self, blocks, keys, parent, root, token_ids) -> None:
        name = self._names.get(root, "")
        if name == "":
            name = self._names[root] = self.lora_name_of(root)
        self._records.append(("stored", keys, parent, root, list(token_ids), name))

    def blocks_removed(self, blocks, keys) -> None:
        self._records.append(("removed", keys))

    def cache_cleared(self) -> None:
        self._records.append(("cleared",))

    def end_step(self) -> None:
        if self._records:
            records, self._records = self._records, []
            self.submit(time.time(), records)
