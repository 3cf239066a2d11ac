"""KV blocks, the free-block queue and block hashing.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``,
``FreeKVCacheBlockQueue``, ``hash_block_tokens``, ``NONE_HASH``) of vLLM 0.33.0
for a single full-attention KV-cache group.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

# vLLM 0.33.0 derives NONE_HASH from the fixed seed "vllm-none-hash" for sha256
# (spec 10.7), so hashes are reproducible across processes. Ours are not
# byte-identical to vLLM's (different serialisation) and need not be: they are
# only compared with each other.
NONE_HASH: bytes = hashlib.sha256(b"vllm-none-hash").digest()


def hash_block_tokens(parent_block_hash: bytes | None, block_token_ids: Iterable[int],
                      extra_keys: tuple | None = None) -> bytes:
    """Chained hash of one full block: H(parent or NONE_HASH, tokens, extra keys).

    Returns 32 bytes (sha256). The only extra keys modelled are multimodal
    ones, ``("mm", identifier, item offset - block start)`` per item
    overlapping the block (vLLM ``_gen_mm_extra_hash_keys``); None (text-only
    blocks) hashes exactly as before they existed. No LoRA, no cache salt.
    """
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    h.update(array("q", block_token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def mm_extra_keys(start: int, end: int, mm_positions: tuple[tuple[int, int], ...],
                  mm_hashes: tuple[str, ...]) -> tuple | None:
    """The multimodal extra keys of the block of tokens ``[start, end)``:
    ``("mm", identifier, offset - start)`` for each item overlapping it, in
    item order; None when no item does."""
    keys = tuple(("mm", mm_hash, offset - start)
                 for (offset, length), mm_hash in zip(mm_positions, mm_hashes)
                 if offset < end and start < offset + length)
    return keys or None


def hash_request_blocks(token_ids: list[int], block_size: int, block_hashes: list[bytes],
                        mm_positions: tuple[tuple[int, int], ...] = (),
                        mm_hashes: tuple[str, ...] = ()) -> None:
    """Extend ``block_hashes`` in place with the hashes of newly full blocks
    (with multimodal extra keys for blocks overlapping an item)."""
    start = len(block_hashes) * block_size
    if not mm_positions and start + block_size <= len(token_ids):
        # Text only: every new full block's tokens packed at once, then one
        # sha256 per block over its slice (the bytes ``hash_block_tokens``
        # packs per block, so the same hashes; a prompt's hundreds of blocks
        # without an array per block).
        end = len(token_ids) - (len(token_ids) - start) % block_size
        data = array("q", token_ids[start:end]).tobytes()
        parent = block_hashes[-1] if block_hashes else NONE_HASH
        width = 8 * block_size
        sha256 = hashlib.sha256
        for offset in range(0, len(data), width):
            h = sha256(parent)
            h.update(data[offset:offset + width])
            parent = h.digest()
            block_hashes.append(parent)
        return
    while start + block_size <= len(token_ids):
        parent = block_hashes[-1] if block_hashes else None
        extra = (mm_extra_keys(start, start + block_size, mm_positions, mm_hashes)
                 if mm_positions else None)
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
        start += block_size


@dataclass(eq=False)
class KVCacheBlock:
    """One physical KV block: ``block_size`` token slots.

    ``ref_cnt`` counts the block tables holding it; ``block_hash`` is set only
    while the block is full and registered in the prefix cache.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is allocated (and evicted) first.

    vLLM uses a hand-written doubly linked list; an insertion-ordered dict
    gives the same O(1) popleft, append, prepend and remove-from-the-middle.
    Invariant: a block is in this queue iff its ref_cnt is 0 and it is not the
    null block.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVCacheBlock:
        return self._queue.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head. Raises ValueError if fewer are free."""
        if n > len(self._queue):
            raise ValueError(f"cannot pop {n} blocks, only {len(self._queue)} free")
        popitem = self._queue.popitem
        return [popitem(False)[1] for _ in range(n)]  # (False: last=False, the head)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from wherever it sits (a prefix hit on a free block)."""
        del self._queue[block.block_id]

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append to the tail in the given order (reused last)."""
        for block in blocks:
            self._queue[block.block_id] = block

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, keeping their order: blocks[0] is next out."""
        for block in reversed(blocks):
            self._queue[block.block_id] = block
            self._queue.move_to_end(block.block_id, last=False)

    def block_ids(self) -> list[int]:
        """Free block ids, head first."""
        return list(self._queue)
