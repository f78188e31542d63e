"""Probe q28, finding 4: a step trace's ``{"block_tokens": N}`` header anywhere but alone on
the first line is refused as a misplaced header, not as a record missing a field."""

from __future__ import annotations

import pytest

from tiercache.errors import TraceError
from tiercache.sim.loader import load_trace
from tiercache.sim.steptrace import iter_steps

_RECORD = '{"step": 1, "layer": 0, "read": [0], "write": []}'


@pytest.mark.parametrize("text, line, says", [
    ('{"step": 0, "layer": 0, "read": [], "write": [0, 1]}\n{"block_tokens": 16}\n' + _RECORD + "\n", 2,
     "header is allowed only once, on the first line"),
    ('{"block_tokens": 16}\n{"block_tokens": 16}\n' + _RECORD + "\n", 2, "header is allowed only once, on the first line"),
    ('{"block_tokens": 16, "step": 0}\n' + _RECORD + "\n", 1, "both"),
    ('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [0], "block_tokens": 8}\n' + _RECORD + "\n", 2,
     "both"),
])
def test_a_header_out_of_place_is_named_as_a_header_by_every_reader(tmp_path, text, line, says):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    for read in (lambda: list(iter_steps(path)), lambda: load_trace(path)):
        with pytest.raises(TraceError) as info:
            read()
        message = str(info.value)
        assert f"t.jsonl:{line}:" in message and says in message and "missing field" not in message, message
        assert '{"block_tokens": N}' in message
