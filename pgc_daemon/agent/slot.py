"""What serves right now."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

BASE_LABEL = "fp32 · eager"


@dataclass(frozen=True)
class Slot:
    """A module and the variant it is (None before the agent registered with the store).

    ``hookable``: per-layer hooks see its layers (eager modules). ``control``: set while this
    slot is a canary; then calls alternate, in blocks, between it and the control (what
    served before), so both are measured side by side on the same live traffic.
    """

    module: nn.Module
    variant_id: int | None
    label: str
    hookable: bool
    deployment_id: int | None = None
    control: Slot | None = None

    @property
    def canary(self) -> bool:
        return self.control is not None
