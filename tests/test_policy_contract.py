"""Contract tests, parametrized over every registered policy (a new policy is tested for free).

The eviction contract is the one in ``policies/base.py``: hooks track exactly what they are
told, ``victims(n, protected)`` returns ``n`` distinct tracked unprotected ids or ``None``
(then changing nothing observable), never changes the tracked set, and misuse raises
``KeyError`` without changing anything. Random operation sequences come from hypothesis;
``check_invariants`` runs after every operation.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from tiercache.policies import (
    ADMISSION,
    EVICTION,
    NO_NEXT_USE,
    AdmissionPolicy,
    EvictionPolicy,
    Hints,
    PolicyError,
    get_admission,
    get_eviction,
    make_admission,
    make_eviction,
)

UNIVERSE = 24  # ids 0..23: small enough that sequences revisit ids, hit ghosts and parents
CAPACITIES = st.integers(min_value=1, max_value=12)
RANDOM_RUNS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _hints(data: st.DataObject, ids: list[int]) -> Hints:
    """Hints for a batch: random next uses and parents (any id but itself, or a root)."""
    next_use = [data.draw(st.sampled_from([NO_NEXT_USE, *range(50)])) for _ in ids]
    parents = [data.draw(st.sampled_from([None, *(p for p in range(UNIVERSE) if p != b)])) for b in ids]
    return Hints(time=0, next_use=next_use, parents=parents)


def _drain(policy: EvictionPolicy) -> list[int]:
    """The full eviction order of a copy of ``policy`` (victims(1) + on_remove until empty)."""
    clone = copy.deepcopy(policy)
    order = []
    while len(clone):
        victim = clone.victims(1)
        assert victim is not None and len(victim) == 1
        clone.on_remove(victim)
        order.extend(victim)
    return order


def _assert_tracks(policy: EvictionPolicy, model: set[int]) -> None:
    policy.check_invariants()
    assert len(policy) == len(model)
    assert {b for b in range(UNIVERSE) if b in policy} == model


class _Driver:
    """Applies random operations to one policy and a model of its tracked set."""

    def __init__(self, policy: EvictionPolicy, data: st.DataObject) -> None:
        self.policy, self.data, self.model = policy, data, set()

    def subset(self, pool: set[int], min_size: int = 0) -> list[int]:
        return self.data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=min_size, unique=True)) if pool else []

    def insert(self) -> None:
        ids = self.subset(set(range(UNIVERSE)) - self.model, min_size=1)
        if ids:
            self.policy.on_insert(ids, _hints(self.data, ids))
            self.model.update(ids)

    def access(self) -> None:
        ids = self.subset(self.model, min_size=1)
        if ids:
            self.policy.on_access(ids, _hints(self.data, ids))

    def remove(self) -> None:
        ids = self.subset(self.model, min_size=1)
        if ids:
            self.policy.on_remove(ids)
            self.model.difference_update(ids)

    def victims(self) -> None:
        n = self.data.draw(st.integers(min_value=0, max_value=len(self.model) + 1))
        protected = set(self.subset(set(range(UNIVERSE))))
        before = copy.deepcopy(self.policy)
        result = self.policy.victims(n, protected)
        _assert_tracks(self.policy, self.model)  # victims never changes the tracked set
        unprotected = len(self.model - protected)
        if result is None:
            assert unprotected < n, f"None although {unprotected} >= {n} unprotected ids"
            assert _drain(self.policy) == _drain(before), "victims returned None but changed state"
            return
        assert len(result) == n and len(set(result)) == n
        assert set(result) <= self.model - protected
        if self.data.draw(st.booleans()):  # the caller usually evicts what it was offered
            self.policy.on_remove(result)
            self.model.difference_update(result)

    def misuse(self) -> None:
        """Each misuse raises KeyError and leaves the eviction order unchanged."""
        outside = set(range(UNIVERSE, UNIVERSE + 3))
        calls = [lambda: self.policy.on_access([min(outside)], _hints(self.data, [min(outside)])),
                 lambda: self.policy.on_remove([min(outside)])]
        if self.model:
            inside = min(self.model)
            calls.append(lambda: self.policy.on_insert([max(outside), inside], _hints(self.data, [0, 1])))
            calls.append(lambda: self.policy.on_remove([inside, inside]))
        before = _drain(self.policy)
        with pytest.raises(KeyError):
            self.data.draw(st.sampled_from(calls))()
        assert _drain(self.policy) == before


@pytest.mark.parametrize("name", sorted(EVICTION))
@RANDOM_RUNS
@given(capacity=CAPACITIES, data=st.data())
def test_eviction_contract_random_sequences(name: str, capacity: int, data: st.DataObject) -> None:
    driver = _Driver(make_eviction(name, capacity), data)
    ops = [driver.insert, driver.access, driver.remove, driver.victims, driver.misuse]
    for _ in range(data.draw(st.integers(min_value=1, max_value=40))):
        data.draw(st.sampled_from(ops))()
        _assert_tracks(driver.policy, driver.model)


def _batch_claim_params() -> list:
    """Every eviction policy name; those that do not claim ``batch_insert_safe`` carry an
    explicit skip, so the report shows which policies the claim test did not exercise."""
    params = []
    for name in sorted(EVICTION):
        if get_eviction(name).batch_insert_safe:
            params.append(name)
        else:
            reason = f"{name} does not claim batch_insert_safe; nothing to check"
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)))
    return params


@pytest.mark.parametrize("name", _batch_claim_params())
@RANDOM_RUNS
@given(capacity=CAPACITIES, data=st.data())
def test_eviction_batch_insert_safe_claim(name: str, capacity: int, data: st.DataObject) -> None:
    """Where claimed, k victims up front then k inserts == k interleaved evict/insert pairs."""
    cls = get_eviction(name)
    assert cls.batch_insert_safe, f"{name}: parametrized without the claim"
    seq = data.draw(st.lists(st.integers(0, UNIVERSE - 1), min_size=capacity, max_size=3 * capacity))
    policy = cls(capacity)
    _fill(policy, seq, data)
    assert len(policy) >= 1, f"{name}: a non-empty sequence left the policy empty"
    new = list(range(UNIVERSE, UNIVERSE + data.draw(st.integers(1, len(policy)))))
    batched, interleaved = copy.deepcopy(policy), copy.deepcopy(policy)
    victims = batched.victims(len(new))
    # len(new) <= len(policy) and nothing is protected, so the contract demands victims.
    assert victims is not None, f"{name}: victims({len(new)}) is None with {len(policy)} tracked"
    batched.on_remove(victims)
    batched.on_insert(new, _hints(data, new))
    for block_id in new:
        one = interleaved.victims(1)
        assert one is not None, f"{name}: victims(1) is None on a full cache"
        interleaved.on_remove(one)
        interleaved.on_insert([block_id], _hints(data, [block_id]))
    assert _drain(batched) == _drain(interleaved)


def _fill(policy: EvictionPolicy, seq: list[int], data: st.DataObject) -> None:
    """Replays ``seq`` through ``policy`` as a full cache would (evict before insert)."""
    for block_id in seq:
        hints = _hints(data, [block_id])
        if block_id in policy:
            policy.on_access([block_id], hints)
            continue
        if len(policy) >= policy.capacity:
            policy.on_remove(policy.victims(1))
        policy.on_insert([block_id], hints)


@pytest.mark.parametrize("name", sorted(EVICTION))
def test_eviction_class_attributes(name: str) -> None:
    cls = get_eviction(name)
    assert issubclass(cls, EvictionPolicy)
    assert cls.name == name
    assert isinstance(cls.needs_future, bool) and isinstance(cls.batch_insert_safe, bool)
    assert cls.check_invariants is not EvictionPolicy.check_invariants, "check_invariants missing"
    with pytest.raises(ValueError):
        cls(0)


@pytest.mark.parametrize("name", sorted(EVICTION))
def test_eviction_victims_of_nothing(name: str) -> None:
    policy = make_eviction(name, 4)
    assert policy.victims(0) == []
    assert policy.victims(1) is None
    policy.on_insert([1, 2], Hints(next_use=[5, 6], parents=[None, 1]))
    assert policy.victims(1, protected={1, 2}) is None
    assert policy.victims(3) is None
    assert sorted(policy.victims(2)) == [1, 2]


@pytest.mark.parametrize("name", sorted(ADMISSION))
@RANDOM_RUNS
@given(batches=st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=30))
def test_admission_contract(name: str, batches: list[list[int]]) -> None:
    policy, twin = make_admission(name), make_admission(name)
    assert isinstance(policy, AdmissionPolicy) and type(policy).name == name
    for ids in batches:
        verdicts = policy.admit(ids)
        assert isinstance(verdicts, list) and len(verdicts) == len(ids)
        assert all(isinstance(v, bool) for v in verdicts)
        assert twin.admit(ids) == verdicts, "admission must be deterministic"
        policy.check_invariants()


def test_registry_unknown_name_lists_known_names() -> None:
    for lookup, table in ((get_eviction, EVICTION), (get_admission, ADMISSION)):
        with pytest.raises(PolicyError) as err:
            lookup("no-such-policy")
        assert all(name in str(err.value) for name in table)


def test_registry_module_class_and_case() -> None:
    from tiercache.policies.lru import LRU
    from tiercache.policies.admission_second_hit import SecondHitAdmit

    assert get_eviction("tiercache.policies.lru:LRU") is LRU
    assert get_eviction(" LRU ") is LRU
    assert get_admission("tiercache.policies.admission_second_hit:SecondHitAdmit") is SecondHitAdmit
    with pytest.raises(PolicyError):
        get_eviction("tiercache.policies.lru:NoSuchClass")
    with pytest.raises(PolicyError):
        get_eviction("no_such_module_xyz:LRU")
