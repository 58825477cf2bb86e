"""A transfer server's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerStats:
    """Counters of a TransferServer (monotonic).

    ``protocol_errors``: frames and notifications that failed to decode
    (``oversized`` of them were over ``max_message_bytes``);
    ``bad_signatures``: ones with a missing, unexpected or wrong HMAC tag;
    ``refused``: well-formed requests refused (pool full, no Hello...;
    ``faults_injected`` of them on purpose); ``disconnects``: control
    connections closed, by the peer or by ZMQ over a frame past its size
    cap; ``peers_pruned``: peers forgotten after ``peer_idle_s`` without a
    message (they say Hello again); ``internal_errors``: bugs caught so the server keeps serving (0
    unless something is wrong). ``refused_writes``: data-plane writes whose
    bytes were refused before they reached the pool, because they named no
    live reservation, a slot it does not hold or a stale generation (planes
    that see writes arrive: TCP, loopback; their notifications are dropped
    too); ``late_writes``: notifications for reservations already gone or
    chunks no longer waiting for bytes. ``lookups``: reuse-tier lookups
    asked over the socket; ``lookups_in_process``: ones a scheduler in this
    process asked on its own thread (``answer_here``). ``prefill_notes``: the proxy's words
    on prefills that were kept; ``prefill_notes_late``: ones that came after
    the transfer's note was final or released (ignored); ``reserves_late``:
    Reserves refused because the transfer's load had already ended (the
    consumer released it before its Reserve came). ``parts_landed``: layer
    groups of chunks notified as landed (``WritePart``) before their chunk's
    ``WriteDone``. ``chunks_read`` / ``bytes_read``: offered chunks this
    receiver READ from its sender's cache (direct reads; verified like
    written chunks, in ``chunks_filled``); ``parts_read``: layer groups
    of offered chunks READ before the rest of the chunk was final (counted
    in ``parts_landed`` too; their bytes in ``bytes_read``);
    ``read_failures``: offered
    chunks whose READ failed, timed out or was ended by its consumer;
    ``offers_refused``: Offers refused (no such pending chunk, a stale
    generation, a cache map that does not fit, a receiver that does not
    read). ``loop_wakeups``: times the loop woke to poll (a message, a
    notification poll, a tick): about 2 a second on a server that holds
    nothing that runs out (``server.EMPTY_POLL_MS``).
    """

    hellos: int = 0
    reservations: int = 0
    refused: int = 0
    protocol_errors: int = 0
    chunks_filled: int = 0
    bytes_filled: int = 0
    checksum_failures: int = 0
    late_writes: int = 0
    refused_writes: int = 0
    cancels: int = 0
    expired: int = 0
    lookups: int = 0
    lookups_in_process: int = 0
    bad_signatures: int = 0
    oversized: int = 0
    disconnects: int = 0
    peers_pruned: int = 0
    internal_errors: int = 0
    faults_injected: int = 0
    prefill_notes: int = 0
    prefill_notes_late: int = 0
    reserves_late: int = 0
    parts_landed: int = 0
    chunks_read: int = 0
    parts_read: int = 0
    bytes_read: int = 0
    read_failures: int = 0
    offers_refused: int = 0
    loop_wakeups: int = 0
