"""What, besides its token ids, makes a request's KV what it is.

Two requests with the same token ids have the same KV only when they run
the same weights (the layout fingerprint covers the model, see
:meth:`fabric.kv.layout.KVLayout.fingerprint`) *and* agree on everything
the request itself adds. :class:`KeyIdentity` is that second part:

    lora        adapter name and a digest of its files ("" = base model)
    cache_salt  the tenant's salt (vLLM keeps salted prompts apart)
    mm          multimodal items: (identifier, offset, length), by offset

It enters the chunk keys (:func:`fabric.kv.keys.chunk_keys`) in two places::

    key_{-1} = ROOT_KEY                        (empty lora and salt)
             = blake3("fabric-identity/1" || lora || salt)[:16]   (otherwise)
    key_i    = blake3(key_{i-1} || tokens_i || fingerprint
                      [|| "mm" || items overlapping chunk i])[:16]

so a salt or an adapter changes every key, and an image changes the key of
the chunk holding its placeholder tokens and, by the chain, every later one
(a text prefix before the image is still shared). An empty identity gives
the keys of earlier releases.

It travels on the wire as :meth:`encode` bytes (msgpack, bounded); a
receiver decodes it with :meth:`decode`, which refuses anything malformed.
"""

from __future__ import annotations

import struct

import blake3
import msgspec

from fabric.errors import ProtocolError

MAX_IDENTITY_BYTES = 64 * 1024
_ROOT_DOMAIN = b"fabric-identity/1"
_MM_DOMAIN = b"mm"
_U32 = struct.Struct("<I")


class KeyIdentity(msgspec.Struct, frozen=True, array_like=True):
    """A request's KV identity beyond model and tokens (see the module doc)."""

    lora: str = ""
    cache_salt: str = ""
    mm: tuple[tuple[str, int, int], ...] = ()

    @property
    def empty(self) -> bool:
        """True for a base-model request without salt or multimodal items."""
        return not (self.lora or self.cache_salt or self.mm)

    def root(self, default: bytes) -> bytes:
        """The chain's first ``prev`` key: ``default`` unless lora or salt is set."""
        if not (self.lora or self.cache_salt):
            return default
        hasher = blake3.blake3(_ROOT_DOMAIN)
        for part in (self.lora, self.cache_salt):
            data = part.encode("utf-8")
            hasher.update(_U32.pack(len(data)))
            hasher.update(data)
        return hasher.digest(len(default))

    def chunk_extra(self, index: int, chunk_tokens: int) -> bytes:
        """Bytes chunk ``index`` mixes in: the mm items its tokens overlap."""
        start, end = index * chunk_tokens, (index + 1) * chunk_tokens
        parts = [
            _U32.pack(offset) + _U32.pack(length) + _u32_str(ident)
            for ident, offset, length in self.mm
            if offset < end and offset + length > start
        ]
        return _MM_DOMAIN + b"".join(parts) if parts else b""

    def encode(self) -> bytes:
        """Wire form (msgpack); b"" for an empty identity."""
        return b"" if self.empty else _encoder.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> KeyIdentity:
        """Inverse of :meth:`encode`; :class:`ProtocolError` on anything malformed."""
        if not data:
            return BASE
        if len(data) > MAX_IDENTITY_BYTES:
            raise ProtocolError(f"identity of {len(data)} bytes exceeds {MAX_IDENTITY_BYTES}")
        try:
            identity = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable identity: {exc}") from exc
        for _, offset, length in identity.mm:
            if not (0 <= offset < 2**31 and 0 < length < 2**31):
                raise ProtocolError(f"identity: mm item at {offset}+{length} out of range")
        return identity


def _u32_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return _U32.pack(len(data)) + data


BASE = KeyIdentity()
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KeyIdentity)
