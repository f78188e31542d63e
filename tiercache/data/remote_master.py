"""Starting and stopping a ``mooncake_master`` (with its HTTP metadata server) on free ports.

Used by ``tiercache remote-serve``, the tests' fixture and the benchmark: one function
that finds the executable the Mooncake wheel installed, picks free ports, starts the
master, waits until it accepts connections, and returns the addresses a client needs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tiercache.errors import UserError
from tiercache.extras import install_hint

if TYPE_CHECKING:
    from tiercache.config import RemoteConfig

__all__ = ["MasterProcess", "find_master", "start_master", "free_port", "free_ports", "servers_answer"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    return free_ports(host, 1)[0]


def free_ports(host: str = "127.0.0.1", count: int = 3, taken: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now, none of ``taken``: all are bound at
    once before any is let go, so two picks never return the same port.

    Raises:
        OSError: nothing can listen on ``host``.
    """
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in taken:
                ports.append(port)
        return ports
    finally:
        for sock in socks:
            sock.close()


def find_master() -> str:
    """Path of ``mooncake_master``: beside this Python (a venv's bin), else on PATH.

    Raises:
        UserError: not installed; the message says how to install it.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")
    if found is None:
        raise UserError(f"mooncake_master (Mooncake Store's master) not found: {install_hint('mooncake')}")
    return found


@dataclass
class MasterProcess:
    """A running master: ``master`` (``host:rpc_port``) and ``metadata`` (URL) are what a
    client's ``RemoteConfig`` needs; ``stop`` ends it by its pid."""

    process: subprocess.Popen
    host: str
    rpc_port: int
    metadata_port: int
    metrics_port: int

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def master(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Ends the master (SIGTERM, or SIGKILL with ``kill`` or after ``timeout``)."""
        if self.process.poll() is not None:
            return
        os.kill(self.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait()


def master_command(host: str, rpc_port: int, metadata_port: int, metrics_port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The ``mooncake_master`` command line (the README shows the same)."""
    return [find_master(), "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={metadata_port}", f"--rpc_address={host}", f"--rpc_port={rpc_port}",
            f"--metrics_host={host}", f"--metrics_port={metrics_port}", *extra]


def start_master(host: str = "127.0.0.1", ports: tuple[int, int, int] | None = None, log: str | None = None,
                 extra: tuple[str, ...] = (), wait_s: float = 30.0) -> MasterProcess:
    """Starts a master on free ports (or the given ``(rpc, metadata, metrics)`` ports, to
    restart one where its clients expect it) and waits until both servers accept.

    Whatever ends the wait early (Ctrl-C, a signal handler's exception, not ready in time)
    kills the master first: it never outlives a start that did not return it.

    Raises:
        UserError: not installed, or it exited or did not answer within ``wait_s``.
    """
    rpc, metadata, metrics = ports or free_ports(host, 3)
    out = open(log, "ab") if log else subprocess.DEVNULL
    process = subprocess.Popen(master_command(host, rpc, metadata, metrics, extra), stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    started = MasterProcess(process, host, rpc, metadata, metrics)
    try:
        if log:
            out.close()
        _wait_ready(started, time.monotonic() + wait_s, log)
    except BaseException:
        started.stop(kill=True)
        raise
    return started


def _wait_ready(started: MasterProcess, deadline: float, log: str | None) -> None:
    """Waits until the master's RPC and metadata servers both accept connections.

    Raises:
        UserError: it exited, or did not accept by ``deadline`` (``time.monotonic``).
    """
    host, process = started.host, started.process
    while not (_accepts(host, started.rpc_port) and _accepts(host, started.metadata_port)):
        if process.poll() is not None or time.monotonic() > deadline:
            where = f"see {log}" if log else "its output was discarded: give a log file (remote-serve --log) to keep it"
            raise UserError(f"mooncake_master did not start on {started.master} ({exit_status(process.poll())}); {where}")
        time.sleep(0.05)


def exit_status(code: int | None) -> str:
    """A ``Popen.returncode`` in words: ``exit status N``, ``killed by signal N (NAME)``, or
    ``still running`` (None)."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    return f"killed by signal {-code} ({name})"


def _accepts(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):  # ValueError: a port out of range
        return False


def _answers(host: str, port: int, timeout_s: float, hello: bytes) -> bool:
    """Whether the server at ``host:port`` *answers* within ``timeout_s``: it accepts a TCP
    connection and, once sent ``hello``, replies or closes the connection. A hung or frozen
    server (or a silent listener) accepts through the kernel's backlog but never answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(hello)
            sock.recv(1)  # any byte, or b"" for a close: it answered
            return True
    except ConnectionResetError:  # it dropped the connection: only a running server does
        return True
    except (OSError, ValueError):  # refused, unreachable, timed out; ValueError: a port out of range
        return False


#: Bytes the master's RPC server rejects at once (not its protocol's magic): it closes the
#: connection, which proves it runs; a master that hangs says nothing.
_RPC_HELLO = bytes(64)


def _http_hello(host: str) -> bytes:
    return f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()


def servers_answer(config: "RemoteConfig") -> bool:
    """True when the master and the metadata server (an HTTP URL, or at least one endpoint of
    an ``etcd://host:port[,host:port...]`` list) answer within ``timeout_s`` each: the client's
    own setup blocks the whole process (GIL held, up to 10 min) on a server that does not
    answer, so it is never called then. Accepting a TCP connection is not enough: a master
    that hangs (or any listener on its port) still accepts through the kernel's backlog."""
    host, port = config.master.rsplit(":", 1)
    if not _answers(host, int(port), config.timeout_s, _RPC_HELLO):
        return False
    if config.metadata.startswith("http://"):
        url = urlsplit(config.metadata)
        return _answers(url.hostname, url.port or 80, config.timeout_s, _http_hello(url.hostname))
    if config.metadata.startswith("etcd://"):
        endpoints = [e.rsplit(":", 1) for e in config.metadata[len("etcd://"):].split(",") if ":" in e]
        return any(_answers(h, int(p), config.timeout_s, _http_hello(h)) for h, p in endpoints if p.isdigit())
    return True
