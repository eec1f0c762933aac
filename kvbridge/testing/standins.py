"""Stand-ins for torch accelerator libraries, for conformance runs where the hardware is absent.

A stand-in is NOT the library: it is the small surface kvbridge's accelerator devices call, backed by
host memory, installed for one test only (`install_standin`). What it proves, and what it does not:
docs/plugins.md ("Stand-ins").
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import attrs
import torch


@attrs.frozen
class StandInDeviceRef:
    """What ``tensor.device`` says on a stand-in tensor: ``type`` and ``index``, like ``torch.device``."""

    type: str
    index: int

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


def _is_cpu(value: Any) -> bool:
    return (isinstance(value, str) and value == "cpu") or (isinstance(value, torch.device) and value.type == "cpu")


class StandInTensor(torch.Tensor):
    """A host-memory tensor that reports a stand-in device; results of ops on it stay on that device.

    Except ``cpu()``, ``numpy()`` and ``to("cpu")``, which come back as plain host tensors."""

    _standin_device: StandInDeviceRef

    @staticmethod
    def wrap(t: torch.Tensor, device: StandInDeviceRef) -> StandInTensor:
        out = t.as_subclass(StandInTensor)
        out._standin_device = device
        return out

    @property  # type: ignore[override]
    def device(self) -> Any:
        return self._standin_device

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = next((a._standin_device for a in args if isinstance(a, StandInTensor)), None)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        to_host = name in ("cpu", "numpy") or (name == "to" and any(_is_cpu(v) for v in (*args[1:], *kwargs.values())))
        if device is None or to_host or not isinstance(out, torch.Tensor) or isinstance(out, StandInTensor):
            return out
        return cls.wrap(out, device)


@attrs.define
class _Stream:
    owner: StandInAccelerator
    device: int

    def synchronize(self) -> None:
        self.owner.calls.append(("stream_synchronize", self.device))


@attrs.define
class _Event:
    owner: StandInAccelerator
    recorded_on: int | None = None

    def record(self, stream: _Stream | None = None) -> None:
        self.recorded_on = stream.device if stream is not None else self.owner.current
        self.owner.calls.append(("event_record", self.recorded_on))

    def synchronize(self) -> None:
        if self.recorded_on is None:
            raise RuntimeError("stand-in: Event.synchronize() before record()")
        self.owner.calls.append(("event_synchronize", self.recorded_on))


@attrs.frozen
class _Properties:
    name: str
    total_memory: int
    uuid: str


class StandInAccelerator:
    """The ``torch.cuda``-style module surface, recording every synchronization in `calls`."""

    def __init__(self, device_type: str, device_count: int = 2) -> None:
        self.device_type = device_type
        self.count = device_count
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        self.pinned: list[int] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: int) -> None:
        self.current = self._index(device)

    def current_stream(self, device: Any = None) -> _Stream:
        return _Stream(self, self._index(device))

    def Event(self, **_: Any) -> _Event:  # noqa: N802 - the libraries spell it as a class
        return _Event(self)

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", self._index(device)))

    def get_device_properties(self, device: Any = None) -> _Properties:
        i = self._index(device)
        return _Properties(f"stand-in {self.device_type} {i}", 1 << 30, f"standin-{self.device_type}-{i}")

    def _index(self, device: Any) -> int:
        i = self.current if device is None else int(getattr(device, "index", device))
        if not 0 <= i < self.count:
            raise RuntimeError(f"stand-in {self.device_type}: invalid device ordinal {i} (have {self.count})")
        return i

    def zeros(self, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``torch.zeros`` that serves ``device="<type>:<i>"`` and ``pin_memory=True`` from host memory."""

        def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if isinstance(device, str) and device.split(":")[0] == self.device_type:
                kwargs.pop("device")
                index = self._index(int(device.split(":")[1]) if ":" in device else None)
                return StandInTensor.wrap(real(*args, **kwargs), StandInDeviceRef(self.device_type, index))
            if kwargs.pop("pin_memory", False):
                out = real(*args, **kwargs)
                self.pinned.append(out.numel() * out.element_size())
                return out
            return real(*args, **kwargs)

        return zeros


def install_standin(
    monkeypatch: Any, device_type: str, module: str | None = None, *, device_count: int = 2
) -> StandInAccelerator:
    """Install a stand-in for one library for the current test only.

    `device_type` is the torch device type (``npu``, ``mlu``; never ``cuda``); it becomes ``torch.<type>``.
    `module` is the vendor package (``torch_npu``, ``torch_mlu``): a module of that name with the
    stand-in as its ``<type>`` attribute goes into ``sys.modules``. ``torch.zeros`` learns the device.
    """
    if device_type == "cuda":  # torch's own CUDA module is never replaced: nothing pretends to be a GPU
        raise ValueError(
            "there is no CUDA stand-in: the cuda plugin runs for real where a GPU is, and its shared "
            "accelerator code is covered by the npu and mlu stand-ins"
        )
    acc = StandInAccelerator(device_type, device_count)
    monkeypatch.setattr(torch, device_type, acc, raising=False)
    if module is not None:
        mod = types.ModuleType(module, f"stand-in for {module} (kvbridge.testing.standins)")
        setattr(mod, device_type, acc)
        monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.setattr(torch, "zeros", acc.zeros(torch.zeros))
    return acc
