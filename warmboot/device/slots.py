"""Per-request device slots: the row of the runner's token buffer a request's last sampled
token is written to, and of its host block tables. A request that leaves the running set is
parked; its slot is freed once no in-flight step uses it (a zombie row may still read it)."""

from __future__ import annotations

from collections import Counter


class RequestSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._users: Counter[str] = Counter()
        """Per request: in-flight steps whose rows use its slot."""
        self._parked: set[str] = set()

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slots

    def __getitem__(self, req_id: str) -> int:
        return self._slots[req_id]

    @property
    def live(self) -> set[str]:
        return set(self._slots)

    @property
    def parked(self) -> set[str]:
        return set(self._parked)

    def slot_of(self, req_id: str) -> int:
        """The request's slot, taken from the free list on first use."""
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free:
                raise RuntimeError("no free request slot: more live requests than slots")
            slot = self._slots[req_id] = self._free.pop()
        return slot

    def use(self, req_id: str) -> None:
        """A step being launched has a row of ``req_id``."""
        self._parked.discard(req_id)
        self.slot_of(req_id)
        self._users[req_id] += 1

    def unuse(self, req_id: str) -> bool:
        """That step was collected; True when the request's slot was freed."""
        self._users[req_id] -= 1
        return self._release_if_idle(req_id)

    def park(self, req_id: str) -> bool:
        """The request left the running set; True when its slot was freed at once."""
        self._parked.add(req_id)
        return self._release_if_idle(req_id)

    def _release_if_idle(self, req_id: str) -> bool:
        if req_id not in self._parked or self._users[req_id]:
            return False
        self._parked.discard(req_id)
        self._users.pop(req_id, None)
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
        return True

    def check_invariants(self, in_flight: Counter[str]) -> None:
        """``in_flight``: per request, the rows it has in launched, uncollected steps."""
        live = set(self._slots.values())
        assert len(live) == len(self._slots), "two requests share a slot"
        assert not live & set(self._free), "a live slot is on the free list"
        assert len(live) + len(self._free) == self.num_slots, "a slot was lost"
        users = +self._users
        assert users == +in_flight, f"slot users {dict(users)} != rows in flight {in_flight}"
        assert set(users) <= set(self._slots), "an in-flight row has no slot"
        assert self._parked <= set(self._slots), "a parked request without a slot"
