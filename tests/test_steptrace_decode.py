"""The step trace's optional decode fields: written only when set, read back exactly,
validated with the file and line named; old traces replay as before."""

from __future__ import annotations

import pytest

from tiercache.errors import TraceError
from tiercache.sim.loader import load_trace
from tiercache.sim.steptrace import StepRecord, iter_steps, step_json, write_steps


def test_decode_fields_round_trip_and_stay_absent_when_unset(tmp_path):
    records = [StepRecord(0, 0, (), (1, 2), hold=(1, 2)),
               StepRecord(1, 0, (1, 2), (), in_place=True, ahead=(7,)),
               StepRecord(2, 0, (2,), (), candidates=(1,)),
               StepRecord(3, 0, (), (), release=(1, 2)),
               StepRecord(4, 1, (5,), (6,))]
    path = tmp_path / "t.jsonl"
    write_steps(path, records, block_tokens=16)
    back = [StepRecord(r.step, r.layer, r.read, r.write, 0, r.in_place, r.candidates, r.ahead, r.hold, r.release)
            for r in iter_steps(path)]
    assert back == records
    assert step_json(records[4]) == '{"step": 4, "layer": 1, "read": [5], "write": [6]}'
    trace = load_trace(path)
    assert set(trace.steps.decode) == {0, 1, 2, 3}
    assert trace.steps.decode[1].in_place and trace.steps.decode[1].ahead == (7,)


@pytest.mark.parametrize("line, message", [
    ('{"step": 0, "layer": 0, "read": [], "write": [], "in_place": 1}', "in_place"),
    ('{"step": 0, "layer": 0, "read": [], "write": [], "hold": [1, 1]}', "hold lists block 1 more than once"),
    ('{"step": 0, "layer": 0, "read": [], "write": [], "candidates": ["x"]}', "candidates"),
])
def test_bad_decode_fields_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"block_tokens": 4}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        list(iter_steps(path))
    assert "bad.jsonl" in str(info.value) and ":2" in str(info.value)
