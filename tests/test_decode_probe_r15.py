"""Probe R15 (the decode cache, raw API): ``seq.reports`` (a ``StepReports`` over a deque) was
not the list it replaced: a thread iterating it while the decode appended died with
"deque mutated during iteration", and ``copy.copy`` of it was a live alias; an object array
of small ids (a pandas column's ``.values``) was refused as "a token id does not fit in
int64"; a decode loop's list of per-step ``[1]`` id tensors was refused as a batch."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from tiercache.errors import UserError
from tiercache.integrations.inputs import prompt_rows

from decode_helpers import random_kv, small_cache

_cache, _kv = small_cache, random_kv


def _step(seq) -> None:
    for layer in range(2):
        seq.append(layer, *_kv(1))
        seq.attend(layer, torch.randn(2, 1, 8))


def test_seq_reports_is_a_list_that_iterates_during_decode_and_copies_as_a_snapshot(tmp_path):
    """A monitor thread iterating ``seq.reports`` while 150 steps decode never raises; it holds
    between ``keep_reports`` and twice that, the latest ones in order; ``copy.copy``,
    ``list()`` and slices are snapshots; ``==``, ``+`` and pickling work as on a list."""
    with _cache(tmp_path, keep_reports=8) as cache:
        seq = cache.sequence(tokens=list(range(12)))
        for layer in range(2):
            seq.append(layer, *_kv(12))
        for _ in range(3):
            _step(seq)
        errors, done = [], threading.Event()

        def monitor() -> None:
            try:
                while not done.is_set():
                    for report in seq.reports:
                        assert report.bytes_moved >= 0
                        time.sleep(0.0002)  # lets the decode thread append mid-iteration
            except Exception as exc:  # noqa: BLE001 - the test reports whatever the thread met
                errors.append(repr(exc))

        thread = threading.Thread(target=monitor)
        thread.start()
        for _ in range(150):
            _step(seq)
        done.set()
        thread.join()
        assert errors == []
        reports = seq.reports
        assert isinstance(reports, list) and 8 <= len(reports) <= 16
        assert [(r.step, r.layer) for r in reports][-2:] == [(152, 0), (152, 1)]
        assert [r.step * 2 + r.layer for r in reports] == list(range(2 * 153 - len(reports), 2 * 153))
        snap, listed, sliced = copy.copy(reports), list(reports), reports[:]
        before = len(reports)
        _step(seq)
        assert len(snap) == len(listed) == len(sliced) == before and snap[-1] is not seq.reports[-1]
        assert snap == listed == sliced and seq.reports == list(seq.reports) and seq.reports[-1].step == 153
        assert seq.reports + [] == list(seq.reports) and pickle.loads(pickle.dumps(seq.reports)) == seq.reports
        seq.free()


def _store_prompt(cache, ids: list[int]) -> None:
    """Stores a prompt of ``ids`` (every layer's KV, random) and frees its sequence, so its
    whole blocks are what ``match_prefix`` can find."""
    seq = cache.sequence(tokens=ids)
    for layer in range(2):
        seq.append(layer, *_kv(len(ids)))
    seq.free()


def test_an_object_array_of_ids_that_fit_in_int64_is_taken_and_only_an_id_beyond_it_is_refused_as_such(tmp_path):
    """``np.array([1, 2], dtype=object)`` (and numpy integers among Python ones) is the ids
    it holds, as ``match_prefix``, ``add_tokens`` and ``prompt_rows`` read it; before the fix
    each said "a token id does not fit in int64". An id beyond int64, alone or beside a numpy
    integer (which gave "got dtype object"), is still refused naming that."""
    ids = list(range(1, 10))
    with _cache(tmp_path) as cache:
        _store_prompt(cache, ids)
        for tokens in (np.array(ids, dtype=object), np.array([np.int64(i) if i % 2 else i for i in ids], dtype=object)):
            assert cache.match_prefix(tokens) == 8
            live = cache.sequence(tokens=tokens[:4])
            live.add_tokens(tokens[4:])
            assert live.token_ids.tolist() == ids and live.token_ids.dtype == np.int64
            live.free()
            assert [row.tolist() for row in prompt_rows(tokens)] == [ids]
            assert [row.tolist() for row in prompt_rows(np.stack([tokens, tokens]))] == [ids, ids]
        for tokens in ([np.int64(3), 2**64], np.array([1, -(2**63) - 1], dtype=object), [2**63]):
            with pytest.raises(ValueError, match=r"^tokens: token_ids: a token id does not fit in int64$"):
                cache.match_prefix(tokens)
            with pytest.raises(UserError, match=r"^TieredCache: prompt: token_ids: a token id does not fit in int64$"):
                prompt_rows(tokens)
        assert cache.match_prefix(np.array([1, -(2**63), 2**63 - 1, 4], dtype=object)) == 0  # the int64 limits fit
        for bad in (np.array([1, True], dtype=object), np.array([1, 2.0], dtype=object)):
            with pytest.raises(TypeError, match=r"got dtype object"):
                cache.match_prefix(bad)
        cache.check_invariants()


def test_a_list_of_one_id_tensors_is_one_sequence_and_an_n_by_1_column_is_refused_naming_its_rows(tmp_path):
    """A decode loop's per-step ``logits.argmax(-1)`` ids (``[1]`` each, or ``[1, 1]``) are
    one sequence, in order, as before f71e5c1 (since then refused as a batch of shape (n, 1));
    an ``[n, 1]`` tensor, array or nested list is refused with a message that reads it as n
    one-token rows and says to flatten it; float or bool per-step ids are refused."""
    ids = list(range(1, 10))
    with _cache(tmp_path) as cache:
        _store_prompt(cache, ids)
        generated = [torch.tensor([i]) for i in ids]
        for tokens in (generated, tuple(generated), [t.view(1, 1) for t in generated], [t.numpy() for t in generated],
                       [generated[0].view(()), *generated[1:]]):
            assert cache.match_prefix(tokens) == 8
            live = cache.sequence(tokens=tokens[:3])
            live.add_tokens(tokens[3:])
            assert live.token_ids.tolist() == ids
            live.free()
        message = (r"^tokens: one sequence's ids \(\[n\] or \[1, n\]\) expected, got shape \(9, 1\): an \[n, 1\] column "
                   r"reads as n rows of one token each; if it is one sequence, flatten it \(ids\.ravel\(\)")
        for column in (torch.tensor(ids).view(9, 1), np.array(ids)[:, None], [[i] for i in ids]):
            with pytest.raises(UserError, match=message):
                cache.match_prefix(column)
        with pytest.raises(UserError, match=r"^tokens: .*got shape \(2, 4\): give each row of a batch on its own$"):
            cache.match_prefix(torch.arange(8).view(2, 4))
        for bad, dtype in (([torch.tensor([1.0]), torch.tensor([2.0])], "torch.float32|float32"),
                           ([torch.tensor([1]), torch.tensor([True])], "bool")):
            with pytest.raises(TypeError, match=rf"^tokens: token_ids must be integers, got a one-id element of dtype ({dtype})$"):
                cache.match_prefix(bad)
        with pytest.raises(ValueError, match=r"does not fit in int64$"):
            cache.match_prefix([np.array([1], dtype=np.uint64), np.array([2**64 - 1], dtype=np.uint64)])
        cache.check_invariants()
