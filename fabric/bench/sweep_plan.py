"""What a transfer sweep measures: grids of points, grouped by receiver.

A :class:`SweepPoint` is one combination of the axes (geometry, chunk size,
chunks per WRITE, fabric's transport, memory kind, NIXL progress thread). A
:class:`Grid` is the cartesian product of some values of each axis; a plan
is the union of its grids' points, minus the points this machine cannot run
(each listed in ``skipped`` with the reason), ordered so that one receiver
process serves every point of a (geometry, memory, progress) suite and
fabric's store is rebuilt only when the chunk size or transport changes.

NOTE: the progress-thread setting is NIXL's; fabric's TCP transport does not
have one, so TCP points run with it off only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import model_validator

from fabric.bench.geometry import PRESETS
from fabric.errors import ConfigError
from fabric.settings import Settings

TRANSPORTS = ("nixl", "tcp")
MEMORY_KINDS = ("dram", "vram")
PATHS = ("full", "direct", "raw", "page", "push", "memcpy")
CHUNK_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
HEADLINE_GEOMETRY = "llama3-8b"
HEADLINE_CHUNK = 256


def _check_values(name: str, values: Iterable[str], known: tuple[str, ...]) -> None:
    for value in values:
        if value not in known:
            raise ConfigError(f"{name}: unknown {value!r} (known: {', '.join(known)})")


@dataclass(frozen=True, order=True)
class SweepPoint:
    """One measured combination of the sweep's axes."""

    geometry: str
    memory: str
    progress_thread: bool
    transport: str
    chunk_tokens: int
    batch: int

    @property
    def suite_key(self) -> tuple[str, str, bool]:
        """Points with the same key share one receiver process."""
        return (self.geometry, self.memory, self.progress_thread)

    @property
    def baseline_key(self) -> tuple[str, str, bool, int, int]:
        """raw, page and memcpy do not involve fabric's transport."""
        return (*self.suite_key, self.chunk_tokens, self.batch)

    def label(self) -> str:
        prog = "on" if self.progress_thread else "off"
        return (
            f"{self.geometry} {self.chunk_tokens}t x{self.batch} {self.transport} "
            f"{self.memory} progress-{prog}"
        )


class Grid(Settings):
    """The cartesian product of the values of each axis."""

    geometries: tuple[str, ...] = tuple(PRESETS)
    chunk_tokens: tuple[int, ...] = CHUNK_TOKENS
    batches: tuple[int, ...] = (1, 4)
    transports: tuple[str, ...] = TRANSPORTS
    memories: tuple[str, ...] = MEMORY_KINDS
    progress: tuple[bool, ...] = (False, True)

    @model_validator(mode="after")
    def _check(self) -> Grid:
        for name in self.geometries:
            if name not in PRESETS:
                raise ValueError(f"geometry: unknown preset {name!r} (known: {sorted(PRESETS)})")
        _check_values("transport", self.transports, TRANSPORTS)
        _check_values("memory", self.memories, MEMORY_KINDS)
        for name, values in (("chunk tokens", self.chunk_tokens), ("batch", self.batches)):
            if not values or any(v <= 0 for v in values):
                raise ValueError(f"{name}: needs positive values, got {list(values)}")
        return self

    def points(self) -> Iterable[SweepPoint]:
        axes = (
            self.geometries,
            self.memories,
            self.progress,
            self.transports,
            self.chunk_tokens,
            self.batches,
        )
        for g, m, p, t, c, b in itertools.product(*axes):
            if t == "tcp" and p:
                continue  # NOTE: no progress thread in the TCP plane
            yield SweepPoint(g, m, p, t, c, b)


class SweepConfig(Settings):
    """Everything that decides a sweep's points and how each is measured.

    ``headline_reps``: timed runs at the headline point (Llama-3-8B, 256-token
    chunks, NIXL, DRAM, progress off), at least ``reps``: the number the
    issue quotes gets the steadiest median.
    """

    grids: tuple[Grid, ...] = (Grid(),)
    tokens: int = 2048
    block_size: int = 16
    reps: int = 5
    headline_reps: int = 7
    kind: str = "flash"
    paths: tuple[str, ...] = PATHS
    quick: bool = False

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        _check_values("path", self.paths, PATHS)
        if self.reps < 1 or self.tokens < self.block_size:
            raise ValueError("reps must be >= 1 and tokens >= block_size")
        if self.tokens % self.block_size:
            raise ValueError(f"tokens {self.tokens} is not a multiple of {self.block_size}")
        return self

    def to_json(self) -> dict[str, Any]:
        return self.model_dump()


def _quick_grid(
    geometry: str,
    chunk_tokens: tuple[int, ...],
    batch: int = 1,
    transport: str = "nixl",
    memory: str = "dram",
) -> Grid:
    """One geometry, one batch, transport and memory, NIXL's progress thread off."""
    return Grid(
        geometries=(geometry,),
        chunk_tokens=chunk_tokens,
        batches=(batch,),
        transports=(transport,),
        memories=(memory,),
        progress=(False,),
    )


QUICK = SweepConfig(
    grids=(
        _quick_grid("llama3-8b", CHUNK_TOKENS),
        _quick_grid("llama3-8b", (64, 256), transport="tcp"),
        _quick_grid("llama3-8b", (64,), batch=4),
        _quick_grid("llama3-8b", (256,), memory="vram"),
        _quick_grid("tiny", (16, 256)),
        _quick_grid("deepseek-mla", (256,)),
    ),
    reps=3,
    quick=True,
)
"""About a minute on the 2-core VM; always holds the headline point.

NOTE: NIXL's progress thread (``--progress on``) is left to the full sweep:
its busy-polling threads (two per process here) made one such point cost
~30 s on 2 cores, half of the quick budget."""


@dataclass
class Plan:
    """The points to run, in order, and the ones left out with why."""

    points: list[SweepPoint] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def suites(self) -> list[tuple[tuple[str, str, bool], list[SweepPoint]]]:
        """Points grouped by receiver, in plan order."""
        return [
            (key, list(group))
            for key, group in itertools.groupby(self.points, lambda p: p.suite_key)
        ]


def plan_sweep(config: SweepConfig, *, has_cuda: Callable[[], bool] | None = None) -> Plan:
    """The points of ``config``'s grids this machine can run, deduplicated and ordered."""
    cuda = has_cuda or cuda_available
    plan, seen = Plan(), set()
    for point in (p for grid in config.grids for p in grid.points()):
        if point in seen:
            continue
        seen.add(point)
        reason = _skip_reason(config, point, cuda)
        if reason:
            plan.skipped.append({**asdict(point), "reason": reason})
        else:
            plan.points.append(point)
    plan.points.sort(key=_order)
    return plan


def _order(p: SweepPoint) -> tuple[Any, ...]:
    # NOTE: NIXL before TCP so TCP points reuse the baselines just measured.
    return (p.suite_key, TRANSPORTS.index(p.transport), p.chunk_tokens, p.batch)


def _skip_reason(config: SweepConfig, point: SweepPoint, cuda: Callable[[], bool]) -> str:
    if point.memory == "vram" and not cuda():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if point.chunk_tokens % config.block_size:
        return f"chunk of {point.chunk_tokens} tokens is not whole {config.block_size}-token blocks"
    if point.chunk_tokens * point.batch > config.tokens:
        return f"{point.batch} chunks of {point.chunk_tokens} tokens exceed {config.tokens} tokens"
    return ""


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def headline_point(points: Iterable[SweepPoint]) -> SweepPoint | None:
    """The point of the issue's goal: Llama-3-8B, 256-token chunks, NIXL, DRAM,
    progress thread off, the smallest batch measured."""
    matches = [
        p
        for p in points
        if (p.geometry, p.chunk_tokens, p.transport, p.memory, p.progress_thread)
        == (HEADLINE_GEOMETRY, HEADLINE_CHUNK, "nixl", "dram", False)
    ]
    return min(matches, key=lambda p: p.batch) if matches else None
