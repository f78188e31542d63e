"""Synthetic trace generators: determinism, shapes, prefix-tree structure."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tiercache.errors import UserError
from tiercache.sim.steptrace import iter_steps, write_steps
from tiercache.sim.synth import DocsSpec, ScanSpec, SparseSpec, docs_trace, scan_trace, sparse_trace
from tiercache.sim.traces import iter_requests, write_requests


def test_scan_shapes():
    spec = ScanSpec(steps=10, prompt_blocks=3, block_tokens=4, layers=1)
    records = list(scan_trace(spec))
    assert records[0].step == 0 and records[0].read == () and records[0].write == (0, 1, 2)
    decode = records[1:]
    assert [r.step for r in decode] == list(range(1, 11))
    for r in decode:
        full = 3 + (r.step - 1) // 4
        assert r.read == tuple(range(full))  # every full block so far, in order
        assert r.write == ((full,) if r.step % 4 == 0 else ())
    assert sum(len(r.write) for r in decode) == 2  # steps 4 and 8 fill a block


def test_scan_per_layer_ids_are_distinct():
    records = list(scan_trace(ScanSpec(steps=8, prompt_blocks=2, block_tokens=4, layers=3)))
    assert [(r.step, r.layer) for r in records[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    for r in records:
        assert all(i % 3 == r.layer for i in r.read + r.write)
    last = records[-1]
    assert last.read == (2, 5, 8)  # blocks 0, 1, 2 of layer 2


def test_scan_without_prompt_has_no_prefill_record():
    records = list(scan_trace(ScanSpec(steps=3, prompt_blocks=0, block_tokens=1)))
    assert [(r.step, r.read, r.write) for r in records] == [(1, (), (0,)), (2, (0,), (1,)), (3, (0, 1), (2,))]


def test_sparse_shapes():
    spec = SparseSpec(steps=200, prompt_blocks=100, k=6, sink=2, window=3, block_tokens=8, seed=3)
    for r in list(sparse_trace(spec))[1:]:
        full = 100 + (r.step - 1) // 8
        assert list(r.read) == sorted(set(r.read)) and len(r.read) == 2 + 6 + 3
        assert set(range(2)) <= set(r.read)  # sinks
        assert set(range(full - 3, full)) <= set(r.read)  # recent window
        assert max(r.read) < full


def test_sparse_reads_everything_when_short():
    records = list(sparse_trace(SparseSpec(steps=2, prompt_blocks=5, k=8, sink=1, window=2, block_tokens=4)))
    assert records[1].read == (0, 1, 2, 3, 4)


def _mean_overlap(spec: SparseSpec) -> float:
    reads = [set(r.read) for r in sparse_trace(spec)][1:]
    return sum(len(a & b) for a, b in zip(reads, reads[1:])) / (len(reads) - 1)


def test_sparse_locality_controls_reuse():
    base = dict(steps=100, prompt_blocks=500, k=16, sink=0, window=0, block_tokens=1000)
    assert _mean_overlap(SparseSpec(**base, locality=1.0)) == 16
    assert _mean_overlap(SparseSpec(**base, locality=0.9)) > 10
    assert _mean_overlap(SparseSpec(**base, locality=0.0)) < 3


def test_sparse_determinism_and_seed():
    spec = SparseSpec(steps=50, prompt_blocks=80, k=5, seed=11, layers=2)
    assert list(sparse_trace(spec)) == list(sparse_trace(spec))
    other = SparseSpec(steps=50, prompt_blocks=80, k=5, seed=12, layers=2)
    assert list(sparse_trace(spec)) != list(sparse_trace(other))


def test_docs_structure():
    spec = DocsSpec(docs=20, doc_blocks=5, requests=300, system_blocks=2, question_blocks=2, zipf=1.2, seed=5)
    requests = list(docs_trace(spec))
    assert len(requests) == 300
    parent: dict[int, int | None] = {}
    for r in requests:
        assert len(r.hash_ids) == 2 + 5 + 2 == math.ceil(r.input_length / 512)
        assert r.hash_ids[:2] == (0, 1)
        for prev, cur in zip((None,) + r.hash_ids[:-1], r.hash_ids):
            assert parent.setdefault(cur, prev) == prev  # each id has one parent: a prefix tree
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    questions = [i for r in requests for i in r.hash_ids[-2:]]
    assert len(set(questions)) == len(questions)  # question blocks are unique per request
    popularity = Counter((r.hash_ids[2] - 2) // 5 for r in requests)
    assert popularity.most_common(1)[0][0] == 0  # Zipf: rank 0 is the hottest document


def test_docs_determinism_and_seed():
    spec = DocsSpec(docs=10, doc_blocks=3, requests=50, seed=1)
    assert list(docs_trace(spec)) == list(docs_trace(spec))
    assert list(docs_trace(spec)) != list(docs_trace(DocsSpec(docs=10, doc_blocks=3, requests=50, seed=2)))


def test_generated_traces_pass_the_readers(tmp_path):
    steps = list(sparse_trace(SparseSpec(steps=40, prompt_blocks=30, layers=2)))
    write_steps(tmp_path / "s.jsonl", steps)
    assert [(r.step, r.layer, r.read, r.write) for r in iter_steps(tmp_path / "s.jsonl")] == [
        (r.step, r.layer, r.read, r.write) for r in steps
    ]
    requests = list(docs_trace(DocsSpec(docs=4, doc_blocks=2, requests=30)))
    write_requests(tmp_path / "d.jsonl", requests)
    assert [r.hash_ids for r in iter_requests(tmp_path / "d.jsonl")] == [r.hash_ids for r in requests]


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: ScanSpec(steps=0), "ScanSpec.steps"),
        (lambda: ScanSpec(steps=5, block_tokens=0), "ScanSpec.block_tokens"),
        (lambda: ScanSpec(steps=2.5), "ScanSpec.steps"),
        (lambda: SparseSpec(steps=5, locality=1.5), "SparseSpec.locality"),
        (lambda: SparseSpec(steps=5, k=-1), "SparseSpec.k"),
        (lambda: DocsSpec(docs=0, doc_blocks=1, requests=1), "DocsSpec.docs"),
        (lambda: DocsSpec(docs=1, doc_blocks=1, requests=1, rate_per_s=0), "DocsSpec.rate_per_s"),
        (lambda: DocsSpec(docs=1, doc_blocks=1, requests=1, zipf=True), "DocsSpec.zipf"),
    ],
)
def test_spec_validation_names_the_field(make, field):
    with pytest.raises(UserError, match=field):
        make()
