"""probeB findings F1, F7, F8: the bulk JSONL parser reads exactly what the line reader reads
(one record per line), a lone ``.json`` file is a kv-cache-tester conversation wherever its
keys are, and a record that repeats a key is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import TraceError
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.fastscan import scan_requests
from tiercache.sim.kvtester import is_kvtester
from tiercache.sim.loader import load_trace
from tiercache.sim.tracelines import keys_spelled_once
from tiercache.sim.traces import load_flat

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def _outcome(reader, path: Path):
    """The arrays a reader builds, or its error message."""
    try:
        flat = reader(path)
    except TraceError as exc:
        return str(exc)
    flat = getattr(flat, "requests", flat)
    return [getattr(flat, f).tolist() for f in ("ids", "timestamps", "input_lengths", "output_lengths")]


def _assert_paths_agree(path: Path) -> None:
    """load_trace (compiled scanner, bulk orjson, line reader) gives what the line reader gives,
    and the bulk parser either defers or builds the same arrays."""
    reference = _outcome(load_flat, path)
    assert _outcome(load_trace, path) == reference
    bulk = bulk_requests(path.read_bytes())
    if bulk is not None:
        assert not isinstance(reference, str)
        assert [bulk.ids.tolist(), bulk.timestamps.tolist(), bulk.input_lengths.tolist(),
                bulk.output_lengths.tolist()] == reference


# ----------------------------------------------------------------------------- F1: one record per line


@pytest.mark.parametrize("second,third", [
    # the probe's trace: an extra record on line 2 and a list broken over lines 2-3
    ('{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}, '
     '{"timestamp": 6, "input_length": 1024, "output_length": 1, "hash_ids": [1', '4]}'),
    # an object broken between two fields
    ('{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [3]}, {"timestamp": 6',
     '"input_length": 1024, "output_length": 1, "hash_ids": [4]}'),
    # a string broken over two lines
    ('{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [3]}, {"note": "a',
     'b", "timestamp": 6, "input_length": 1024, "output_length": 1, "hash_ids": [4]}'),
    # a list of objects broken between two of them
    ('{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [3]}, {"x": [{"a": 1}',
     '{"b": 2}], "timestamp": 6, "input_length": 1024, "output_length": 1, "hash_ids": [4]}'),
])
def test_a_record_moved_across_lines_is_refused_by_both_paths(tmp_path, second, third):
    path = _write(tmp_path / "merge.jsonl", f"{GOOD}\n{second}\n{third}\n")
    assert bulk_requests(path.read_bytes()) is None
    assert scan_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=r"merge.jsonl:2: malformed JSON"):
        load_trace(path)
    _assert_paths_agree(path)


@pytest.mark.parametrize("layout", ["trailing spaces", "whitespace-only line", "crlf and tabs"])
def test_unusual_but_valid_layouts_keep_the_bulk_path(tmp_path, layout):
    lines = [GOOD.replace("[1, 2]", f"[{i}, {i + 1}]").replace('"timestamp": 0', f'"timestamp": {i}')
             for i in range(20)]
    text = {"trailing spaces": " \n".join(lines) + " \n",
            "whitespace-only line": "\n".join(lines[:10] + ["   "] + lines[10:]) + "\n",
            "crlf and tabs": "\r\n".join("\t" + line + "\t" for line in lines) + "\r\n"}[layout]
    path = _write(tmp_path / "layout.jsonl", text)
    assert bulk_requests(path.read_bytes()) is not None
    _assert_paths_agree(path)


def test_a_comma_after_a_brace_inside_a_string_is_still_read(tmp_path):
    """Text that looks like two records on a line (inside a string) only costs the fast path."""
    record = '{"note": "}, {", "timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [5]}'
    path = _write(tmp_path / "note.jsonl", f"{GOOD}\n{record}\n")
    assert load_trace(path).ids.tolist() == [1, 2, 5]
    _assert_paths_agree(path)


@pytest.mark.parametrize("seed", range(3))
def test_random_line_breaks_and_joins_give_the_line_readers_verdict(tmp_path, seed):
    """Lines merged (``\\n`` -> ``, ``) and records broken (``, `` -> ``,\\n``, ``[`` -> ``[\\n``)
    in the same file keep the line count, which alone let such traces through."""
    rng = np.random.default_rng(seed)
    lines = [json.dumps({"timestamp": t, "input_length": 512, "output_length": 1, "note": "a, b",
                         "hash_ids": [int(x) for x in rng.integers(0, 50, size=int(rng.integers(1, 5)))]})
             for t in range(12)]
    base = "\n".join(lines) + "\n"
    for trial in range(40):
        text = base
        for _ in range(int(rng.integers(1, 3))):
            joins = [i for i, c in enumerate(text[:-1]) if c == "\n"]
            at = int(rng.choice(joins))
            text = text[:at] + ", " + text[at + 1:]
            splits = [i for i in range(len(text) - 1) if text[i:i + 2] == ", " or text[i] in "[:\""]
            at = int(rng.choice(splits)) + 1
            text = text[:at] + "\n" + text[at:]
        path = _write(tmp_path / f"mut{trial}.jsonl", text)
        _assert_paths_agree(path)


# ----------------------------------------------------------------------------- F8: repeated keys


@pytest.mark.parametrize("record,key", [
    ('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [7, 8], "hash_ids": [1, 3]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [7], "hash\\u005fids": [1]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [7], "model": "a", "model": "b"}', "model"),
    ('{"timestamp": 5, "timestamp": 6, "input_length": 1, "output_length": 1, "hash_ids": [7]}', "timestamp"),
])
def test_a_repeated_key_in_a_jsonl_record_is_refused_by_name(tmp_path, record, key):
    path = _write(tmp_path / "dup.jsonl", f"{GOOD}\n{record}\n")
    assert bulk_requests(path.read_bytes()) is None and scan_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=rf"dup.jsonl:2: key '{key}' appears more than once in the record"):
        load_trace(path)
    with pytest.raises(TraceError, match=rf"dup.jsonl:2: key '{key}' appears more than once"):
        load_flat(path)


def test_a_repeated_key_in_a_bailian_record_is_refused(tmp_path):
    first = '{"chat_id": 1, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 1, "output_length": 1, ' \
            '"type": "text", "turn": 1, "hash_ids": [1]}'
    second = first.replace('"turn": 1', '"turn": 1, "timestamp": 2.5')
    path = _write(tmp_path / "bailian.jsonl", f"{first}\n{second}\n")
    assert bulk_requests(path.read_bytes(), seconds=True) is None
    with pytest.raises(TraceError, match=r"bailian.jsonl:2: key 'timestamp' appears more than once"):
        load_trace(path)


def test_a_step_record_that_repeats_a_key_is_refused(tmp_path):
    path = _write(tmp_path / "steps.jsonl", '{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [1]}\n'
                                            '{"step": 1, "layer": 0, "read": [1], "read": [2], "write": []}\n')
    with pytest.raises(TraceError, match=r"steps.jsonl:3: key 'read' appears more than once"):
        load_trace(path)


@pytest.mark.parametrize("extra", [', "note": "hash_ids"', ', "meta": {"hash_ids": 1, "t": "x"}',
                                   ', "note": "a\\"b"', ', "tags": ["timestamp", "x"]'])
def test_key_names_elsewhere_are_not_repeats(tmp_path, extra):
    record = '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [5]' + extra + "}"
    path = _write(tmp_path / "ok.jsonl", f"{GOOD}\n{record}\n")
    assert load_trace(path).ids.tolist() == [1, 2, 5]
    _assert_paths_agree(path)


def test_keys_spelled_once_never_misses_a_repeat():
    """Random objects, keys spelled plainly or escaped, strings and nested objects as values:
    whenever the top-level object repeats a key, the cheap test says it may."""
    rng = np.random.default_rng(0)
    names = ["a", "b", "hash_ids", "a/b"]
    spellings = {"a": ['"a"', '"\\u0061"'], "b": ['"b"'], "hash_ids": ['"hash_ids"', '"hash\\u005fids"'],
                 "a/b": ['"a/b"', '"a\\/b"']}
    values = ["1", '"a"', '"hash_ids"', '{"a": 1, "a": 2}', '["b", 2]', '"x\\"y"']
    misses = 0
    for _ in range(3000):
        keys = [str(rng.choice(names)) for _ in range(int(rng.integers(1, 5)))]
        text = "{" + ", ".join(f"{rng.choice(spellings[k])}: {rng.choice(values)}" for k in keys) + "}"
        raw = text.encode()
        repeated = len(set(keys)) < len(keys)
        if repeated and keys_spelled_once(raw, [json.loads(raw)]):
            misses += 1
    assert misses == 0


# ----------------------------------------------------------------------------- kv-cache-tester: F8 and F7


def _conversation(**fields) -> dict:
    conv = {"block_size": 64, "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1]},
                                           {"t": 1, "in": 128, "out": 1, "hash_ids": [1, 2]}]}
    conv.update(fields)
    return conv


def test_a_repeated_block_size_in_a_conversation_is_refused(tmp_path):
    path = _write(tmp_path / "dup.json", '{"block_size": 64, "block_size": 32, "requests": '
                                         '[{"t": 0, "in": 1, "out": 1, "hash_ids": [1]}]}')
    with pytest.raises(TraceError, match=r"dup.json: key 'block_size' appears more than once in the conversation"):
        load_trace(path)
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "dup.json").write_bytes(path.read_bytes())
    with pytest.raises(TraceError, match=r"dup.json: key 'block_size' appears more than once"):
        load_trace(folder)


def test_a_repeated_key_in_a_request_names_the_request(tmp_path):
    text = json.dumps(_conversation()).replace('"hash_ids": [1, 2]', '"hash_ids": [1, 2], "hash_ids": [9]')
    path = _write(tmp_path / "conv.json", text)
    with pytest.raises(TraceError, match=r"conv.json: key 'hash_ids' appears more than once in requests\[1\]"):
        load_trace(path)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_conversation_with_a_long_first_field_is_read_alone_as_in_a_folder(tmp_path, indent):
    text = json.dumps({"description": "x" * 5000, **_conversation()}, indent=indent)
    path = _write(tmp_path / "long.json", text)
    assert is_kvtester(path)
    alone = load_trace(path)
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "long.json").write_text(text)
    assert alone.block_tokens == 64 and alone.ids.tolist() == load_trace(folder).ids.tolist() == [1, 1, 2]


def test_json_lines_named_json_stay_json_lines(tmp_path):
    steps = _write(tmp_path / "steps.json", '{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [3]}\n'
                                            '{"step": 1, "layer": 0, "read": [3], "write": []}\n')
    assert not is_kvtester(steps) and load_trace(steps).kind.value == "steps"
    requests = _write(tmp_path / "req.json", "\n" + GOOD + "\n")
    assert not is_kvtester(requests) and load_trace(requests).ids.tolist() == [1, 2]
    with pytest.raises(TraceError, match=r"empty"):
        load_trace(_write(tmp_path / "empty.json", "\n"))


@pytest.mark.parametrize("text", ['{"description": "' + "x" * 5000 + '", "requests": []}',
                                  '{\n  "description": "' + "x" * 5000 + '",\n  "block_size": 0\n}',
                                  '{"description": "' + "x" * 5000 + '", "requests": [',
                                  '{"other": 1}'])
def test_a_json_file_is_never_told_to_be_named_json(tmp_path, text):
    with pytest.raises(TraceError) as info:
        load_trace(_write(tmp_path / "bad.json", text))
    assert "name the file" not in str(info.value)
