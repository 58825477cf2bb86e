"""CudaKernels' stream and event order, through a fake ``torch.cuda``.

What a GPU would run is the order of these calls: the side stream waits for
the caller's stream (the KV or chunk was written there) before the kernel,
the kernel is launched on the side stream, an event is recorded after it,
the chunk's memory is tied to the side stream, and the caller's stream waits
on that event (always after an unpack, after a pack unless ``join_current``
is off). ``synchronize`` waits on the latest event: what a NIXL WRITE of a
packed slot, or the release of an unpacked one, must come after.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from fabric.kv import cuda as kv_cuda
from fabric.kv import fold64 as fold64_module
from fabric.kv.cuda import CudaKernels

Log = list[tuple[str, ...]]


class FakeCuda:
    """The parts of ``torch.cuda`` CudaKernels uses, logging every call."""

    def __init__(self, log: Log) -> None:
        self.log = log
        events = itertools.count()
        streams = itertools.count()
        fake = self

        class Stream:
            def __init__(self, device: Any = None, name: str | None = None) -> None:
                self.name = name or f"side{next(streams)}"
                self.cuda_stream = hash(self.name)

            def wait_stream(self, other: Stream) -> None:
                fake.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: Event) -> None:
                fake.log.append(("wait_event", self.name, event.name))

        class Event:
            def __init__(self) -> None:
                self.name = f"event{next(events)}"

            def record(self, stream: Stream) -> None:
                fake.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                fake.log.append(("synchronize", self.name))

        self.Stream, self.Event = Stream, Event
        self.current = Stream(name="current")

    def current_stream(self, device: Any = None) -> Any:
        return self.current

    def current_device(self) -> int:
        return 0

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    entries: Log = []
    fake = FakeCuda(entries)
    for name in ("current_stream", "current_device", "stream", "Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, s: entries.append(("record_stream", s.name))
    )
    return entries


def extension(log: Log) -> ModuleType:
    module = ModuleType("fake_cuda_pack")

    def launcher(name: str) -> Any:
        def launch(bases: Any, strides: Any, ids: Any, chunk: Any, seg: int, stream: int) -> None:
            assert len(bases) == len(strides) == 3 and ids.tolist() == [2, 0]
            log.append(("kernel", name, "side0" if stream == hash("side0") else str(stream)))

        return launch

    module.pack, module.unpack = launcher("pack"), launcher("unpack")  # type: ignore[attr-defined]
    return module


def views() -> list[torch.Tensor]:
    return [torch.zeros(4, 32, dtype=torch.uint8) for _ in range(3)]


LAUNCH = [
    ("wait_stream", "side0", "current"),  # the side stream sees the caller's writes
    ("enter", "side0"),
]


@pytest.mark.parametrize("join", [True, False])
def test_pack_runs_on_the_side_stream_after_the_callers_work(log: Log, join: bool) -> None:
    kernels = CudaKernels(extension(log), join_current=join)
    kernels.pack(views(), np.array([2, 0]), torch.zeros(3 * 2 * 32, dtype=torch.uint8))
    tail = [("wait_event", "current", "event0")] if join else []
    assert log == [
        *LAUNCH,
        ("kernel", "pack", "side0"),
        ("record", "event0", "side0"),
        ("exit", "side0"),
        ("record_stream", "side0"),  # the chunk is not reused before the copy ends
        *tail,
    ]
    assert kernels.last_event is not None and kernels.last_event.name == "event0"
    log.clear()
    kernels.synchronize()  # what a WRITE of the packed slot waits for
    assert log == [("synchronize", "event0")]


def test_unpack_always_joins_the_callers_stream(log: Log) -> None:
    kernels = CudaKernels(extension(log), join_current=False)
    kernels.unpack(torch.zeros(3 * 2 * 32, dtype=torch.uint8), views(), np.array([2, 0]))
    assert log == [
        *LAUNCH,
        ("kernel", "unpack", "side0"),
        ("record", "event0", "side0"),
        ("exit", "side0"),
        ("record_stream", "side0"),
        ("wait_event", "current", "event0"),  # attention after it sees the blocks
    ]


def test_synchronize_waits_on_the_latest_launch(log: Log) -> None:
    kernels = CudaKernels(extension(log))
    kernels.synchronize()
    assert log == [], "nothing launched, nothing to wait for"
    chunk = torch.zeros(3 * 2 * 32, dtype=torch.uint8)
    kernels.pack(views(), np.array([2, 0]), chunk)
    kernels.unpack(chunk, views(), np.array([2, 0]))
    log.clear()
    kernels.synchronize()
    assert log == [("synchronize", "event1")]


def test_each_thread_waits_on_its_own_launch(log: Log) -> None:
    """The pack thread and the loader share one instance: a thread whose
    launch came first on the side stream must not wait on (or take) an
    event recorded before its own kernel."""
    kernels = CudaKernels(extension(log))
    chunk = torch.zeros(3 * 2 * 32, dtype=torch.uint8)
    kernels.unpack(chunk, views(), np.array([2, 0]))  # this thread: event0
    other = threading.Thread(target=kernels.pack, args=(views(), np.array([2, 0]), chunk))
    other.start()
    other.join()  # another thread: event1
    log.clear()
    kernels.synchronize()
    assert log == [("synchronize", "event0")]


class FakeCudaBytes:
    """A chunk "on cuda:0" as far as fold64 asks: its device, its flat view,
    and a result buffer (host memory here)."""

    device = SimpleNamespace(type="cuda", index=0)

    def reshape(self, *shape: int) -> FakeCudaBytes:
        return self

    def new_empty(self, size: int, *, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype)


def test_fold64_runs_on_a_stream_of_its_own_and_reads_the_result(
    log: Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the hash must not queue on (or behind) the caller's stream:
    it enters a stream of its thread's and launches with that stream's
    handle (torch's stream context yields None, so the handle must come
    from the stream object itself)."""
    module = ModuleType("fake_cuda_pack")

    def fold64_kernel(data: Any, out: torch.Tensor, stream: int) -> None:
        log.append(("fold64", str(stream)))
        out[0] = -2  # the kernel writes the 64 bits as an int64

    module.fold64 = fold64_kernel  # type: ignore[attr-defined]
    monkeypatch.setattr(kv_cuda, "load_extension", lambda: module)
    monkeypatch.setattr(fold64_module, "_streams", threading.local())
    assert fold64_module.fold64(FakeCudaBytes()) == (1 << 64) - 2  # type: ignore[arg-type]
    assert log == [("enter", "side0"), ("fold64", str(hash("side0"))), ("exit", "side0")]
    log.clear()
    fold64_module.fold64(FakeCudaBytes())  # type: ignore[arg-type]
    assert log[0] == ("enter", "side0"), "one stream per thread, made once"
