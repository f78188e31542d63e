"""What an out-of-tree policy answers, checked where it is asked.

tiercache's own policies (``tiercache.policies.base.in_tree``) are trusted: their contracts are
tested over the registry, and the manager calls their methods directly, so a replay's hot
path pays nothing for checking. A policy defined anywhere else (``--policy
mypackage.mymodule:MyPolicy``) is asked through a checking wrapper instead: each answer must
keep the contract of its base class (``tiercache.policies.base``), and a wrong one raises
``ValueError`` naming the policy, the method and what was wrong before anything acts on it,
as a placement policy's tier out of range does (``tiercache.core.placing``). A replay reports
it in one line naming the policy (``tiercache.sim.sweep``).

Invariant: a checked wrapper returns exactly what the policy answered, as a list (of bools
for ``admit``), or raises; it never corrects an answer.

What the manager hands such a policy is its own copy: ids as tuples, hints with tuples
(``handed``), in every hook (``hooks``), ``admit``, placement question and prefetch view, so a
policy that empties or pops a list it was given (``ids.pop()``) changes nothing the manager
goes on using. tiercache's own policies never change what they are given (tested over the
registry) and get the manager's sequences as they are: a replay pays nothing for the copies.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Sequence

import numpy as np

from tiercache.policies.base import (AdmissionPolicy, EvictionPolicy, Hints, PrefetchPolicy, PrefetchView, enough_unprotected,
                                     in_tree)

from .directory import TierDirectory

__all__ = ["askers", "hooks", "handed", "victims_asker", "admit_asker", "plan_asker", "is_int"]

Victims = Callable[[int, Collection[int]], "list[int] | None"]
Admit = Callable[[Sequence[int]], "list[bool]"]
Plan = Callable[[PrefetchView], "list[int]"]


def askers(evictions: Sequence[EvictionPolicy], admissions: Sequence[AdmissionPolicy],
           dirs: Sequence[TierDirectory]) -> tuple[list[Victims], list[Admit]]:
    """Each tier's ``victims`` and ``admit`` as the manager calls them (one per tier, in order):
    the policies' own methods when in-tree, checked wrappers otherwise."""
    return ([victims_asker(p, d) for p, d in zip(evictions, dirs)],
            [admit_asker(a, d.name) for a, d in zip(admissions, dirs)])


def hooks(policy: EvictionPolicy) -> EvictionPolicy | HandedHooks:
    """What the manager calls ``on_insert``/``on_access``/``on_remove`` on: ``policy`` itself
    when in-tree, else ``HandedHooks`` (each call handed copies: ``handed``)."""
    return policy if in_tree(policy) else HandedHooks(policy)


class HandedHooks:
    """An out-of-tree eviction policy's hooks, each called with copies of the manager's ids
    and hints (``handed``); the policy's answers are its own."""

    __slots__ = ("policy",)

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        self.policy.on_insert(*handed(ids, hints))

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        self.policy.on_access(*handed(ids, hints))

    def on_remove(self, ids: Sequence[int]) -> None:
        self.policy.on_remove(tuple(ids))


def handed(ids: Sequence[int], hints: Hints | None = None) -> tuple[tuple[int, ...], Hints | None]:
    """``ids`` and ``hints`` as an out-of-tree policy is handed them: tuples (a tuple is not
    copied again), which nothing the policy does can change under the manager."""
    if hints is not None and (hints.next_use is not None or hints.parents is not None):
        hints = Hints(hints.time, _tuple(hints.next_use), _tuple(hints.parents))
    return tuple(ids), hints


def _tuple(values: Sequence | None) -> tuple | None:
    """``values`` as a tuple (None stays None)."""
    return None if values is None else tuple(values)


def victims_asker(policy: EvictionPolicy, directory: TierDirectory) -> Victims:
    """``policy.victims`` for the tier ``directory`` keeps, checked unless in-tree.

    A checked answer is ``None`` only while fewer than ``n`` of the tier's ids are outside
    ``protected``, and otherwise a list or tuple of exactly ``n`` distinct ids the tier holds,
    none in ``protected``.
    """
    if in_tree(policy):
        return policy.victims

    def victims(n: int, protected: Collection[int]) -> list[int] | None:
        answer = policy.victims(n, protected)
        problem = _victims_problem(answer, n, protected, directory)
        if problem:
            _refuse("eviction", policy, f"victims({n}) of tier {directory.name}", problem)
        return None if answer is None else list(answer)

    return victims


def admit_asker(policy: AdmissionPolicy, tier_name: str) -> Admit:
    """``policy.admit`` for tier ``tier_name``, checked unless in-tree: one ``True`` or
    ``False`` per id asked about (a list or tuple), returned as a list of bools. The policy
    is asked with a tuple of the ids."""
    if in_tree(policy):
        return policy.admit

    def admit(ids: Sequence[int]) -> list[bool]:
        answer = policy.admit(tuple(ids))
        problem = _admit_problem(answer, ids)
        if problem:
            _refuse("admission", policy, f"admit({_plural(len(ids), 'id')}) of tier {tier_name}", problem)
        return [bool(ok) for ok in answer]

    return admit


def plan_asker(policy: PrefetchPolicy) -> Plan:
    """``policy.plan`` checked unless in-tree: a list or tuple of distinct ids, each named by
    the view (``reads``, ``candidates`` or ``ahead``), none already in the top tier, at most
    ``policy.limit`` of them; returned as a list. The policy sees the view's sequences as
    tuples (the caller's lists stay as they were)."""
    if in_tree(policy):
        return policy.plan

    def plan(view: PrefetchView) -> list[int]:
        view = replace(view, reads=tuple(view.reads), candidates=tuple(view.candidates), ahead=tuple(view.ahead))
        answer = policy.plan(view)
        problem = _plan_problem(answer, view, getattr(policy, "limit", None))
        if problem:
            _refuse("prefetch", policy, f"plan(step {view.step}, layer {view.layer})", problem)
        return list(answer)

    return plan


def _victims_problem(answer, n: int, protected: Collection[int], directory: TierDirectory) -> str | None:
    """What breaks the victims contract in ``answer`` (see ``victims_asker``), or None."""
    if answer is None:
        if enough_unprotected(directory.slot_of, protected, n):
            return f"answered None, but at least {n} of the ids it holds are unprotected"
        return None
    return (_not_a_list(answer, "a list of ids or None") or _not_ids(answer) or _count_problem(answer, n, "id")
            or _repeat_problem(answer)
            or next((f"answered id {v!r}, which tier {directory.name} does not hold"
                     for v in answer if v not in directory.slot_of), None)
            or next((f"answered id {v!r}, which it was told to protect (pinned, referenced, held or being placed)"
                     for v in answer if v in protected), None))


def _admit_problem(answer, ids: Sequence[int]) -> str | None:
    """What breaks the admit contract in ``answer`` (see ``admit_asker``), or None."""
    return (_not_a_list(answer, "a list of bools") or _count_problem(answer, len(ids), "answer")
            or next((f"answered {ok!r} for id {block_id!r}, not True or False"
                     for block_id, ok in zip(ids, answer) if not _is_bool(ok)), None))


def _plan_problem(answer, view: PrefetchView, limit: int | None) -> str | None:
    """What breaks the plan contract in ``answer`` (see ``plan_asker``), or None."""
    named = set(view.reads).union(view.candidates, view.ahead)
    return (_not_a_list(answer, "a list of ids") or _not_ids(answer) or _repeat_problem(answer)
            or (f"answered {len(answer)} ids, over its limit of {limit}" if limit is not None and len(answer) > limit else None)
            or next((f"answered id {v!r}, which the view does not name" for v in answer if v not in named), None)
            or next((f"answered id {v!r}, which is already in the top tier" for v in answer if view.in_top(v)), None))


def _not_a_list(answer, wanted: str) -> str | None:
    if isinstance(answer, (list, tuple)):
        return None
    return f"answered an object of type {type(answer).__name__}, not {wanted}"


def _not_ids(answer: Sequence) -> str | None:
    return next((f"answered {v!r} as an id, not an int" for v in answer if not is_int(v)), None)


def _count_problem(answer: Sequence, n: int, what: str) -> str | None:
    return None if len(answer) == n else f"answered {_plural(len(answer), what)}, not {n}"


def _repeat_problem(answer: Sequence) -> str | None:
    seen: set = set()
    for block_id in answer:
        if block_id in seen:
            return f"answered id {block_id!r} twice"
        seen.add(block_id)
    return None


def is_int(value) -> bool:
    """True for an int (numpy's too) that is not a bool: what an id or a tier index must be
    (``True == 1`` and ``1.0 == 1``, so a membership test alone lets both through)."""
    return isinstance(value, (int, np.integer)) and not _is_bool(value)


def _is_bool(value) -> bool:
    """True for ``True``/``False`` and numpy's, not for 0, 1 or anything else."""
    return isinstance(value, (bool, np.bool_))


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _refuse(kind: str, policy: object, call: str, problem: str) -> None:
    """Raises the one-line ``ValueError`` for a broken contract: whose, which call, what."""
    cls = type(policy)
    raise ValueError(f"{kind} policy {cls.__module__}:{cls.__qualname__}: {call} {problem}")
