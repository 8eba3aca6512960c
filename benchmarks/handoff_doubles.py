"""In-memory collaborators for the handoff benchmarks: a sink that only counts the verified
bytes (the benchmarks measure the protocol and the wire, not an engine install) and a
replay gate with the C.9 watermark rule held in memory (no disk latency in the figures)."""

from __future__ import annotations

KEY = bytes(range(32))


class CountingSink:
    """Accepts segments into a (virtual) detached generation; keeps counts only."""

    def __init__(self) -> None:
        self.bytes = 0
        self.committed = False

    def begin(self, manifest, prefix_cut):
        pass

    def write_segment(self, d, payload):
        self.bytes += payload.nbytes

    def prepare(self):
        pass

    def commit(self):
        self.committed = True

    def abort(self):
        pass


class MemoryLedger:
    """The replay watermark rule, in memory: generation must rise."""

    def __init__(self) -> None:
        self.highest = 0

    def admit(self, key_id, epoch, generation):
        if generation <= self.highest:
            raise RuntimeError("replay")

    def reserve(self, key_id, epoch, generation):
        self.admit(key_id, epoch, generation)
        self.highest = generation
