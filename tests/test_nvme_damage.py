"""Malformed store folders give one clear UserError naming the file (issue 8, item 9).

Each damage below used to end a reopen with a raw exception (IsADirectoryError,
FileNotFoundError, AttributeError, IndexError) or, for a string shape, with a store
silently opened at the wrong capacity.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tiercache.config import KVLayout
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
CHUNK0 = "c.0.0.0.0.0.0"


def edit_meta(path, change) -> None:
    meta_path = path / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(change(meta)))


def set_key(key, value, inside=None):
    def change(meta):
        (meta[inside] if inside else meta)[key] = value
        return meta
    return change


def replace_with_dir(name):
    def damage(path):
        target = path / name
        if target.exists():
            os.unlink(target)
        target.mkdir()
        (target / "x").write_text("not mine")
    return damage


DAMAGES = {
    "live-chunk-is-a-directory": (replace_with_dir(CHUNK0), CHUNK0),
    "free-chunk-is-a-directory": (replace_with_dir("c.3.0.0.0.0.0"), "c.3.0.0.0.0.0"),
    "dangling-symlink-chunk": (lambda p: os.symlink(p / "nowhere", p / "c.2.0.0.0.0.0"), "c.2.0.0.0.0.0"),
    "symlink-over-live-chunk": (lambda p: (os.unlink(p / CHUNK0), os.symlink("/etc/hostname", p / CHUNK0)), CHUNK0),
    "meta-is-a-list": (lambda p: (p / "zarr.json").write_text("[]"), "zarr.json"),
    "meta-is-null": (lambda p: (p / "zarr.json").write_text("null"), "zarr.json"),
    "meta-is-a-directory": (replace_with_dir("zarr.json"), "zarr.json"),
    "attributes-a-list": (lambda p: edit_meta(p, set_key("attributes", [])), "zarr.json"),
    "tiercache-attributes-a-list": (lambda p: edit_meta(p, set_key("tiercache", [], "attributes")), "zarr.json"),
    "layout-a-list": (lambda p: edit_meta(p, lambda m: (m["attributes"]["tiercache"].update(layout=[]), m)[1]),
                      "zarr.json"),
    "shape-empty": (lambda p: edit_meta(p, set_key("shape", [])), "zarr.json"),
    "shape-a-string": (lambda p: edit_meta(p, set_key("shape", "12")), "zarr.json"),
    "shape-of-strings": (lambda p: edit_meta(p, lambda m: (m.update(shape=[str(x) for x in m["shape"]]), m)[1]),
                         "zarr.json"),
    "shape-bool": (lambda p: edit_meta(p, lambda m: (m.update(shape=[True] + m["shape"][1:]), m)[1]), "zarr.json"),
    "shape-zero": (lambda p: edit_meta(p, lambda m: (m.update(shape=[0] + m["shape"][1:]), m)[1]), "zarr.json"),
    "shape-other-block": (lambda p: edit_meta(p, lambda m: (m.update(shape=m["shape"][:-1] + [32]), m)[1]),
                          "zarr.json"),
    "shape-missing-dim": (lambda p: edit_meta(p, lambda m: (m.update(shape=m["shape"][:-1]), m)[1]), "zarr.json"),
    "chunks-of-two-blocks": (lambda p: edit_meta(p, lambda m: (
        m["chunk_grid"]["configuration"].update(chunk_shape=[2] + m["shape"][1:]), m)[1]), "zarr.json"),
    "journal-is-a-directory": (replace_with_dir(nvme_index.JOURNAL_NAME), nvme_index.JOURNAL_NAME),
    "snapshot-is-a-directory": (replace_with_dir(nvme_index.SNAPSHOT_NAME), nvme_index.SNAPSHOT_NAME),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_malformed_store_folder_is_a_user_error_naming_the_file(tmp_path, name):
    import torch

    path = tmp_path / "s"
    with NVMeStore(path, LAYOUT, 4) as store:
        store.put([b"a", b"b"], torch.zeros((2, *LAYOUT.block_shape), dtype=torch.bfloat16))
    damage, culprit = DAMAGES[name]
    damage(path)
    before = sorted(os.listdir(path))
    with pytest.raises(UserError, match=re.escape(culprit)):
        NVMeStore(path, LAYOUT)
    assert sorted(os.listdir(path)) == before, "a refused open changed the folder"
