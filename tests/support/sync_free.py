"""A guard for tests of code that must not force a host-device sync (docs/design.md rule 3)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that read a tensor back to the host: on CUDA each one waits for the device.
DEVICE_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_device_reads(where: str = "on the step path") -> Iterator[None]:
    """Inside the block, any read of a tensor back to the host raises AssertionError."""
    saved = {name: getattr(torch.Tensor, name) for name in DEVICE_READS}

    def forbid(name: str):
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            raise AssertionError(f"Tensor.{name}() {where} forces a device sync")
        return read

    for name in DEVICE_READS:
        setattr(torch.Tensor, name, forbid(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class TorchCallLog(TorchFunctionMode):
    """Inside the block, ``calls`` lists the name of every torch function called, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))
