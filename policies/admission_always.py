"""Admission ``always``: every block may be placed in the tier."""

from __future__ import annotations

from typing import Sequence

from .base import AdmissionPolicy


class AlwaysAdmit(AdmissionPolicy):
    """Admits everything; keeps no state."""

    name = "always"

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)
