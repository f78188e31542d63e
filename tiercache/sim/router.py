"""Request routing of a fleet replay (``tiercache replay --instances N --route R``).

- ``round_robin``: request ``i`` to instance ``i % N``.
- ``prefix_affinity``: by a stable hash of the request's first block, so requests sharing a
  first block meet. Where every request shares it (a system prompt: Mooncake's conversation
  trace has one root), every request goes to one instance.
- ``kv_aware``: a cache-aware router in the manner of the serving engines' (SGLang's
  cache-aware policy, Dynamo's KV router). It sees each instance's cache exactly (as Dynamo
  does from its workers' KV events): the leading run of the request's blocks each instance's
  local tiers hold. The request goes to the instance holding the longest run when that run is
  at least ``MATCH_SHARE`` of the request's blocks and the load is in balance; otherwise to the
  least loaded instance. (SGLang's router has the same two rules with its own thresholds: a
  ``cache_threshold``, and a balance test that also asks for a relative gap; these are ours.)
  Load is what a trace can tell of it without a queue model: the requests routed to each
  instance among the last ``LOAD_PER_INSTANCE`` times N, so that an instance's expected load
  is the same whatever N. The load counts as out of balance once the most loaded instance
  has more than ``BALANCE_GAP`` requests over the least. Ties go to the less loaded instance,
  then to the one picked least recently (never picked: first), then to the lower index, so
  that every instance takes its turn. A request without blocks goes round-robin under every
  route (it has no prefix to meet).

Cost: ``kv_aware`` asks every instance for its held run of each request (N lookups of at most
the request's length), so a fleet of thousands of instances replays that much slower than
under the other routes.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from tiercache.config import Route

__all__ = ["Router", "MATCH_SHARE", "LOAD_PER_INSTANCE", "BALANCE_GAP"]

#: The share of a request's blocks an instance must hold (leading run) for ``kv_aware`` to
#: send the request there for its cache.
MATCH_SHARE = 0.5
#: Requests per instance over which ``kv_aware`` counts the load (the window is this times N).
LOAD_PER_INSTANCE = 16
#: Requests the most loaded instance may have over the least before ``kv_aware`` routes by load alone.
BALANCE_GAP = 16


class Router:
    """Picks each request's instance (see the module docstring).

    Args:
        route: the rule.
        held: one function per instance giving how many leading blocks of a request's
            blocks its local tiers hold (read by ``kv_aware`` only).

    Raises:
        ValueError: ``route`` is not a ``Route`` (a name would fall through to some rule's
            branch), or there is no instance.

    Invariants: ``loads[i]`` is the number of requests among the last ``window`` picks
    (``recent``) that went to instance ``i``; ``last[i]`` is the number of the pick that last
    chose instance ``i`` (-1: never).
    """

    def __init__(self, route: Route, held: Sequence[Callable[[list[int]], int]]) -> None:
        if not isinstance(route, Route):
            raise ValueError(f"Router: route must be a Route, got {route!r}")
        if not held:
            raise ValueError("Router: at least one instance")
        self.route = route
        self.held = list(held)
        self.loads = [0] * len(self.held)
        self.last = [-1] * len(self.held)
        self.window = LOAD_PER_INSTANCE * len(self.held)
        self.recent: deque[int] = deque()
        self.picks = 0

    def pick(self, request: int, run: list[int]) -> int:
        """The instance of request number ``request`` (blocks ``run``)."""
        n = len(self.held)
        if self.route is Route.ROUND_ROBIN or not run:
            chosen = request % n
        elif self.route is Route.PREFIX_AFFINITY:
            chosen = (run[0] * 0x9E3779B97F4A7C15 >> 17) % n  # a stable mix of the first block's id
        else:
            chosen = self._cache_aware(run)
        self._count(chosen)
        return chosen

    def _cache_aware(self, run: list[int]) -> int:
        """``kv_aware``'s pick: the longest held run if long enough and the load in balance,
        else the least loaded instance."""
        loads, last = self.loads, self.last
        least = min(range(len(loads)), key=lambda i: (loads[i], last[i], i))
        if max(loads) - loads[least] > BALANCE_GAP:
            return least
        matched = [held(run) for held in self.held]
        best = min(range(len(matched)), key=lambda i: (-matched[i], loads[i], last[i], i))
        return best if matched[best] >= MATCH_SHARE * len(run) else least

    def _count(self, chosen: int) -> None:
        """Counts a pick in the load window."""
        self.last[chosen] = self.picks
        self.picks += 1
        self.recent.append(chosen)
        self.loads[chosen] += 1
        if len(self.recent) > self.window:
            self.loads[self.recent.popleft()] -= 1
