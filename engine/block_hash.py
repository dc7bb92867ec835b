"""What identifies a block of KV cache for prefix caching.

A block's keys and values are determined by every token up to its end and by the images whose features those
tokens carry. So a full block's hash is SHA-256 over: the previous block's hash (which covers everything
before), the block's token ids, and, for each encoder input (a tile or an image) with placeholders in the block,
the input's content hash and its first placeholder's position. Positions of every kind follow from these (M-RoPE
positions from the tokens and the image grids, which the content hash covers). One engine serves one model, so
the model needs no place in the hash.

A request's `cache_salt` (vLLM's name and meaning) is folded into the first block's parent and into each of its
encoder inputs' hashes: requests with different salts share no cached block and no vision features (the encoder
output cache is keyed by those hashes), so a client cannot learn from `cached_tokens` or timings whether another
sent the same prefix or image. Requests without a salt share the unsalted cache.
"""

from __future__ import annotations

import hashlib
from array import array

import torch

from engine.request import MultimodalPrompt, Request

PREFIX_ROOT = b"vlmcap-prefix"  # the first block's parent
MAX_CACHE_SALT = 256  # characters; a salt is an identity (a tenant's name), not data. The API's bound too


def content_hash(encoder_input: dict[str, torch.Tensor]) -> bytes:
    """SHA-256 of an encoder input's tensors (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name in sorted(encoder_input):
        value = encoder_input[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(repr(value).encode())
    return digest.digest()


def _salted(root: bytes, salt: str | None) -> bytes:
    """`root` as is without a salt, else SHA-256 of `root`, the salt's length and the salt (length-prefixed, so
    no two salts hash alike)."""
    if salt is None:
        return root
    encoded = salt.encode()
    return hashlib.sha256(root + len(encoded).to_bytes(8, "little") + encoded).digest()


def add_input_hashes(mm: MultimodalPrompt, cache_salt: str | None = None) -> None:
    """Each encoder input's hash: its content's, salted by the request's `cache_salt`."""
    mm.input_hashes = [_salted(content_hash(inputs), cache_salt) for inputs in mm.encoder_inputs]


def full_block_hashes(request: Request, block_size: int, num_tokens: int) -> list[bytes]:
    """Hashes of the request's first `num_tokens // block_size` blocks (its token ids up to `num_tokens` must be
    known), extending `request.block_hashes`, which keeps those already computed."""
    hashes = request.block_hashes
    mm = request.mm
    if mm is not None and len(mm.input_hashes) != mm.num_inputs:  # `Engine.add_request` computes them off the lock
        add_input_hashes(mm, request.cache_salt)
    for index in range(len(hashes), num_tokens // block_size):
        start = index * block_size
        digest = hashlib.sha256(hashes[-1] if hashes else _salted(PREFIX_ROOT, request.cache_salt))
        digest.update(array("q", request.token_ids_between(start, start + block_size)).tobytes())
        if mm is not None:
            for index in mm.inputs_in(start, start + block_size):
                digest.update(mm.input_hashes[index])
                digest.update(mm.input_first_position(index).to_bytes(8, "little"))
        hashes.append(digest.digest())
    return hashes
