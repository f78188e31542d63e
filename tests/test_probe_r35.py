"""Review R34 leftovers, fixed: a prefetch whose keys include one whose id collided with
another key's gave the next block the block before the collision as its parent (the keys
without an id were dropped before the parents were read); a put gives it none.
"""

from __future__ import annotations

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.live import keymap
from tiercache.live.store import TieredKVStore


def test_a_prefetch_breaks_the_parent_chain_at_a_key_it_cannot_reach(tmp_path, monkeypatch):
    keys = [key(i) for i in range(4)]
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=2, nvme=8), eviction="leaf_lru", path=tmp_path / "nvme",
                       device="cpu") as store:
        store.put(keys, blocks(4, 1))
        ids = store._map.ids(keys, register=False)
        real_id = keymap.key_to_int  # key(99)'s id made keys[1]'s: a 63-bit collision, which get refuses
        monkeypatch.setattr(keymap, "key_to_int", lambda k: real_id(keys[1] if k == key(99) else k))
        seen = []
        real = store.manager.prefetch
        monkeypatch.setattr(store.manager, "prefetch", lambda ids_, parents=None: seen.append(parents) or real(ids_, parents=parents))
        store.wait(store.prefetch([keys[0], key(99), keys[2], keys[3]]))
        assert seen == [{ids[0]: None, ids[2]: None, ids[3]: ids[2]}]  # was {.., ids[2]: ids[0], ..}
        store.check_invariants()


def test_every_sim_module_the_loader_imports_tags_the_trace_cache():
    """Review R34: the trace cache's entry names carry a digest of the parser's modules, which
    left out kvtester and steptrace (whose detection decides how a file is read)."""
    import ast
    from pathlib import Path

    from tiercache.sim import tracecache

    sim = Path(tracecache.__file__).parent
    imported = {node.module for node in ast.walk(ast.parse((sim / "loader.py").read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    assert imported and imported <= set(tracecache._PARSER_MODULES), imported - set(tracecache._PARSER_MODULES)
