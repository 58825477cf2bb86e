"""What a receiver tracks of each transfer: its chunks and the proxy's word on its prefill."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestProgress:
    """What has landed for one reservation."""

    request_id: str
    expected: frozenset[int]
    landed: set[int] = field(default_factory=set)  # notified, not yet verified
    filled: set[int] = field(default_factory=set)  # verified and indexed
    failed: set[int] = field(default_factory=set)
    expired: bool = False
    parts: dict[int, int] = field(default_factory=dict)  # leading layers landed (WritePart)
    streamed: set[int] = field(default_factory=set)  # verified by the consumer as it unpacks
    sealed: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Streamed chunks whose WriteDone came: (checksum, generation, the first byte
    its last write carried), for the consumer."""
    verifying: set[int] = field(default_factory=set)  # the server's verifier hashes them now

    @property
    def complete(self) -> bool:
        return self.expected <= self.filled

    @property
    def finished(self) -> bool:
        """Nothing more will change: complete, or a chunk failed, or expired."""
        return self.complete or bool(self.failed) or self.expired


@dataclass(frozen=True)
class PrefillNote:
    """What the proxy last said of a transfer's prefill (``PrefillState``):
    ``state`` (running, done, failed), when it said it (monotonic), and
    until when a ``running`` holds."""

    state: str
    at: float
    until: float
    reason: str = ""
