"""Contract of every registered prefetch policy (parametrized over the registry): ``plan``
returns distinct ids the view names, none already in the top tier, at most ``limit``; it
changes nothing (same view, same plan; the policy's state and the view untouched)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.policies import PREFETCH, PrefetchPolicy, PrefetchView, get_prefetch, make_prefetch
from tiercache.policies import PolicyError

ids = st.lists(st.integers(0, 60), max_size=20, unique=True)


@pytest.mark.parametrize("name", sorted(PREFETCH))
@settings(max_examples=60, deadline=None)
@given(reads=ids, candidates=ids, ahead=ids, top=st.sets(st.integers(0, 60)), limit=st.one_of(st.none(), st.integers(1, 8)))
def test_plan_returns_named_absent_distinct_ids_and_changes_nothing(name, reads, candidates, ahead, top, limit):
    policy = get_prefetch(name)(limit)
    view = PrefetchView(3, 1, tuple(reads), tuple(candidates), tuple(ahead), frozenset(top).__contains__)
    state = copy.deepcopy(policy.__dict__)
    plan = policy.plan(view)
    assert isinstance(plan, list)
    assert len(plan) == len(set(plan))
    assert set(plan) <= set(reads) | set(candidates) | set(ahead)
    assert not set(plan) & top
    assert limit is None or len(plan) <= limit
    assert policy.plan(view) == plan
    assert policy.__dict__ == state
    assert view.reads == tuple(reads) and view.candidates == tuple(candidates)


def test_the_built_in_policies_plan_what_they_say():
    view = PrefetchView(0, 0, (1, 2), (3, 4), (5, 6), lambda b: b in (2, 4))
    assert make_prefetch("none").plan(view) == []
    assert make_prefetch("layer_ahead").plan(view) == [5, 6]
    assert make_prefetch("topk_speculative").plan(view) == [3, 5, 6]
    assert make_prefetch(None).name == "none"


def test_registry_covers_the_issue_policies_and_refuses_unknown_names():
    assert {"layer_ahead", "topk_speculative"} <= set(PREFETCH)
    assert all(issubclass(get_prefetch(n), PrefetchPolicy) for n in PREFETCH)
    with pytest.raises(PolicyError, match="unknown prefetch policy"):
        get_prefetch("nope")
