"""Probe q47 (``tiercache bench`` and ``remote-serve``): the raw baselines run no worker
without a block (with ``--threads`` above the blocks of a slice every raw call opened,
synced and barrier-waited on every file, and tiercache "beat" the hardware 1171x); bad
options end in one line before any work; SIGTERM removes bench's working folder; a master
that ends on its own ends remote-serve with one line saying how."""

from __future__ import annotations

import os
import signal
import subprocess

import numpy as np
import pytest

from tiercache.bench import rawio
from tiercache.cli import bench as bench_cli
from tiercache.cli import main, remote_serve
from tiercache.core import interrupts
from tiercache.data.remote_master import MasterProcess, free_ports

BLOCK = 4096


def test_raw_writes_and_reads_use_no_more_workers_or_files_than_blocks(tmp_path, monkeypatch):
    files = rawio.RawBlockFiles(str(tmp_path / "raw"), BLOCK, 8, 2)
    try:
        files.lay_out()
        syncs, opens = [], []
        real_sync, real_open = os.fdatasync, rawio.open_for_read
        monkeypatch.setattr(os, "fdatasync", lambda fd: syncs.append(fd) or real_sync(fd))
        monkeypatch.setattr(rawio, "open_for_read", lambda path, direct: opens.append(path) or real_open(path, direct))
        sources = [rawio.source_block(BLOCK, seed) for seed in (1, 2)]
        files.write(sources, ["a", "b"], sync_each_block=False)
        slots = files.last_slots.copy()
        written = {slot % 8 for slot in slots.tolist()}  # 1 or 2: two writers share one queue
        assert len(syncs) == len(written) <= 2  # one per file written, none for the six idle ones
        dests = rawio.read_buffers(BLOCK, 2)
        files.read(slots, dests, threads=8)
        assert len(opens) == len(written)  # only the files the slots are in
        for source, dest in zip(sources, dests):
            assert bytes(dest) == bytes(source)
    finally:
        files.close()


@pytest.mark.parametrize("options, message", [
    (["--seed", str(2**64)], "--seed: must be an integer from 0 to 2**64-1"),
    (["--threads", "257"], "--threads: must be an integer from 1 to 256"),
    (["--json", "same.json", "--save-profile", "same.json"], "the same file as --json"),
])
def test_bad_bench_options_end_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, options, message):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--dir", str(tmp_path), *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_runs_larger_than_the_free_disk_or_memory_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import collections

    import psutil

    free = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(bench_cli.shutil, "disk_usage", lambda path: free(1 << 40, 0, 20 << 20))
    args = ["bench", "--dir", str(tmp_path), "--json", str(tmp_path / "b.json"), "--blocks", "2", "--block-tokens", "1024"]
    monkeypatch.setattr(bench_cli, "run_bench", lambda config: pytest.fail("ran"))
    # 2 blocks of 4 MiB over 8 threads lay out 8 raw blocks: 48 MiB, more than 3x the blocks' bytes
    assert main([*args, "--threads", "8"]) == 2
    assert "on 8 threads needs about 48.0 MiB of disk, 20.0 MiB are free" in capsys.readouterr().err
    monkeypatch.setattr(bench_cli.shutil, "disk_usage", lambda path: free(1 << 40, 0, 1 << 40))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: collections.namedtuple("vm", "available")(16 << 20))
    assert main(args) == 2
    assert "--blocks 2: blocks of 4194304 B need about 33.6 MiB of memory, 16.0 MiB are available" in capsys.readouterr().err


def test_a_working_folder_bench_cannot_make_is_named(tmp_path, monkeypatch, capsys):
    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(bench_cli.tempfile, "mkdtemp", refused)
    assert main(["bench", "--quick", "--dir", str(tmp_path), "--json", str(tmp_path / "b.json")]) == 2
    assert f"--dir {tmp_path}: cannot make the working folder there (Permission denied)" in capsys.readouterr().err


def test_sigterm_ends_bench_as_ctrl_c_does(monkeypatch):
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the default, whatever ran before in this process
    try:
        handlers = []
        monkeypatch.setattr(bench_cli, "main", lambda args: handlers.append(signal.getsignal(signal.SIGTERM)) or 0)
        assert main(["bench", "--quick"]) == 0
        assert handlers == [interrupts._exit_on_sigterm]  # SystemExit(143): its finally removes the folder
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_small_figures_and_few_repetitions_print_honestly():
    assert bench_cli._fig(0.004321) == "0.00432" and bench_cli._fig(1.234) == "1.23" and bench_cli._fig(0) == "0.00"
    assert "no median" in bench_cli._over_reps(1) and "mean" in bench_cli._over_reps(2)
    assert bench_cli._over_reps(5) == "medians over reps"


def test_a_master_that_ends_on_its_own_ends_remote_serve_saying_how(monkeypatch, capsys):
    process = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    monkeypatch.setattr(remote_serve, "start_master", lambda *a, **k: MasterProcess(process, "127.0.0.1", 1, 2, 3))
    monkeypatch.setattr(remote_serve.signal, "signal", lambda *a: None)  # leave pytest's own handlers alone
    assert main(["remote-serve"]) == 1
    assert f"mooncake_master (pid {process.pid}) ended: killed by signal 9 (SIGKILL)" in capsys.readouterr().err


@pytest.mark.parametrize("host, message", [("::1", "an IPv6 address"), ("0.0.0.0", "no client can reach 0.0.0.0"),
                                           ("0", "no client can reach 0.0.0.0")])
def test_remote_serve_refuses_hosts_no_client_can_use(capsys, host, message):
    assert main(["remote-serve", "--host", host]) == 2
    assert message in capsys.readouterr().err


def test_free_ports_are_distinct_and_avoid_the_given_ones():
    taken = tuple(free_ports("127.0.0.1", 2))
    picked = free_ports("127.0.0.1", 20, taken=taken)
    assert len(set(picked)) == 20 and not set(picked) & set(taken)
    assert np.all(np.array(picked) > 0)
