"""Review R17: a kv-cache-tester folder holding one conversation plain and gzipped (``gzip -k``)
read it twice without a word (the second copy hit everything the first stored); a gzipped
JSON Lines trace was refused as "not UTF-8: byte 0x8b", a ``.json.gz`` of JSON Lines as
"Extra data", neither saying the file was gzipped or what to do."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from tiercache.cli import main

DATA = Path(__file__).parent / "data"


def test_a_conversation_both_plain_and_gzipped_in_one_folder_is_refused_naming_both(tmp_path, capsys):
    folder = tmp_path / "kv"
    folder.mkdir()
    conversation = sorted((DATA / "kvtester_sample").glob("*.json"))[0]
    shutil.copy(conversation, folder / "a.json")
    (folder / "A.json.gz").write_bytes(gzip.compress(conversation.read_bytes()))
    assert main(["trace", "inspect", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{folder / 'A.json.gz'}: {folder / 'a.json'} is in the folder too" in err and "keep one of the two" in err
    (folder / "a.json").unlink()  # the gzipped copy alone is read
    assert main(["trace", "inspect", str(folder)]) == 0


def test_a_gzipped_json_lines_trace_is_refused_saying_it_is_gzipped(tmp_path, capsys):
    packed = gzip.compress((DATA / "mooncake_head.jsonl").read_bytes())
    for name, said in (("t.jsonl.gz", "t.jsonl.gz:1: gzip-compressed (it starts with bytes 1f 8b): a JSON Lines trace "
                                      "is read uncompressed, gunzip it first"),
                       ("u.json.gz", "(one JSON object per line is a JSON Lines trace, read only uncompressed: gunzip it)")):
        (tmp_path / name).write_bytes(packed)
        assert main(["trace", "inspect", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
