"""The receiver's read slots: at most ``slots`` transfers read at once, each READ at most
``slot_bytes``.

On a GPU a slot is device memory, registered with NIXL once (registering costs: pinning,
keys; docs/connector.md, "Figures behind the design"): the receiver reads every transfer through a slot, in chunks
of whole layers (or of blocks, for a layer larger than a slot), and assembles each chunk on
the device into the host payload. On the host a slot has no memory of its own: reads land
in the payload's memory (landing.py) and the slot only bounds the reads in flight and the
size of each. A slot whose read could not be released (NIXL refused: the backend may still
write into it) is retired for good, never reused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from omni_runtime.kv.transport.nixl_agent import KVAgent

logger = logging.getLogger(__name__)

DEFAULT_SLOT_BYTES = 64 << 20
#: On the host a slot has no memory; its size only bounds one READ, which UCX's ``cma``
#: transport copies inside the post, on the receiver's thread: large enough that a 7B
#: request's KV goes in one READ, which was faster than smaller chunks (docs/connector.md,
#: "Figures behind the design").
DEFAULT_HOST_SLOT_BYTES = 256 << 20
DEFAULT_SLOTS = 4


def default_slot_bytes(device: str) -> int:
    """A slot's size unless one is given: VRAM staging on a device, a bound on one READ on
    the host."""
    return DEFAULT_HOST_SLOT_BYTES if torch.device(device).type == "cpu" else DEFAULT_SLOT_BYTES
#: Slot starts are aligned for the widest dtype and for DMA engines.
ALIGN = 4096


@dataclass(eq=False)
class Slot:
    index: int
    tensor: torch.Tensor | None  # uint8, slot_bytes, on the device; None on the host

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()


class StagingPool:
    def __init__(self, agent: KVAgent, *, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 slots: int = DEFAULT_SLOTS, device: str = "cpu") -> None:
        if slot_bytes < ALIGN or slots < 1:
            raise ValueError(f"staging needs slots >= 1 of at least {ALIGN} bytes")
        self.slot_bytes = slot_bytes - slot_bytes % ALIGN
        self.device = torch.device(device)
        self.on_device = self.device.type != "cpu"
        self.mem_type = "VRAM" if self.on_device else "DRAM"
        self.device_id = self.device.index or 0
        if not self.on_device:
            self._slots = [Slot(i, None) for i in range(slots)]
        else:
            memory = torch.empty(self.slot_bytes * slots + ALIGN, dtype=torch.uint8,
                                 device=self.device)
            skip = -memory.data_ptr() % ALIGN
            area = memory[skip: skip + self.slot_bytes * slots]
            area.zero_()
            agent.register([(area.data_ptr(), area.numel(), self.device_id)], self.mem_type)
            self._slots = [Slot(i, area[i * self.slot_bytes: (i + 1) * self.slot_bytes])
                           for i in range(slots)]
        self._free = list(reversed(self._slots))
        self.retired = 0

    def acquire(self) -> Slot | None:
        return self._free.pop() if self._free else None

    def release(self, slot: Slot) -> None:
        self._free.append(slot)

    def retire(self, slot: Slot) -> None:
        """Never reuse ``slot``: a read into it may still land (its handle was not released)."""
        self.retired += 1
        logger.error("KV receiver: staging slot %d retired (a read into it could not be "
                     "released); %d of %d slots left", slot.index,
                     len(self._slots) - self.retired, len(self._slots))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        """Slots not retired."""
        return len(self._slots) - self.retired
