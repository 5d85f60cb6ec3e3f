"""The `nki.collectives` names the emulator knows. Collective kernels are not emulated yet."""

from __future__ import annotations


class ReplicaGroup:
    """The ranks taking part in a collective, as lists of rank ids."""

    def __init__(self, groups):
        self.groups = [list(g) for g in groups]
