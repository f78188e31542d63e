"""Probe Q20, finding 3: an out-of-tree eviction policy whose ``for_tier`` answered something
that is not an ``EvictionPolicy`` failed later, in the replay, with ``AttributeError: 'object'
object has no attribute 'needs_future'``, naming neither the hook nor its answer."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from conftest import random_request_trace
from tiercache.cli import main

MODULE = "q20_policies"
POLICIES = '''
from tiercache.policies.lru import LRU


class BadForTier(LRU):
    """Answers a plain object for every tier."""

    @classmethod
    def for_tier(cls, capacity, tier):
        return object()
'''


@pytest.fixture
def pol(tmp_path: Path):
    """The module ``q20_policies`` on ``sys.path``."""
    (tmp_path / f"{MODULE}.py").write_text(POLICIES)
    sys.path.insert(0, str(tmp_path))
    yield importlib.import_module(MODULE)
    sys.path.remove(str(tmp_path))
    sys.modules.pop(MODULE, None)


def test_a_for_tier_answer_that_is_not_an_eviction_policy_is_one_line_naming_the_hook_and_the_run(tmp_path, pol, capsys):
    trace = random_request_trace(tmp_path / "t.jsonl", requests=20, ids=10, seed=3)
    code = main(["replay", str(trace), "--policy", f"{MODULE}:BadForTier", "--tiers", "hbm=1,dram=2", "--workers", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "needs_future" not in err, err
    assert (f"out-of-tree policy {MODULE}:BadForTier failed in the replay of {MODULE}:BadForTier on --tiers hbm=1,dram=2 "
            f"(object semantics): ValueError: eviction policy {MODULE}:BadForTier: for_tier(1, 0) answered an object of "
            "type object, not an EvictionPolicy") in err
