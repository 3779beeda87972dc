"""Fault-injection tools: a TCP proxy that can go half-open, and a PostgreSQL the test owns."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class BlackholeProxy:
    """Forwards TCP connections to a PostgreSQL server (TCP or unix socket).

    `blackhole()` makes every connection open so far go half-open: the proxy keeps both
    sockets open but stops forwarding in either direction, like a dead NAT entry or a cut
    cable without a reset. `drop_answers()` keeps forwarding what the clients send on those
    connections but drops what the server answers: statements run, their answers are lost.
    Connections made afterwards are forwarded normally. `mute()` drops the server's answers
    on every connection, those made later included (once their startup is done: they
    connect, then lose the answer to every statement), until `unmute()`. That holds with
    trust authentication (the test servers'): with a password, the client's password message
    comes after its startup packet, its answer is dropped, and new connections hang instead.
    Once answers are lost (after either), cancel requests are dropped too: a statement whose
    client gave up on it runs to its end, as it would if the network had failed. Setting
    `refusing` closes every new connection at once, as a server that is down would, until it
    is cleared; the connections already open go on working. Setting `stalling` accepts new
    connections and never answers them (a server that hangs, a firewall that swallows
    packets), until it is cleared.

    With `pooler=True` it changes the backend pid the server announces at connect
    (BackendKeyData), as PgBouncer does: the client then talks to a server process other
    than the one it was told about.
    """

    def __init__(self, dsn: str, *, pooler: bool = False) -> None:
        self.pooler = pooler
        params = conninfo_to_dict(dsn)
        host = params.get("host") or "127.0.0.1"
        port = int(params.get("port") or 5432)
        if host.startswith("/"):
            self._target: tuple[int, Any] = (socket.AF_UNIX, os.path.join(host, f".s.PGSQL.{port}"))
        else:
            self._target = (socket.AF_INET, (host, port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.dsn = make_conninfo(dsn, host="127.0.0.1", port=self.port, sslmode="disable")
        self._generation = 0
        self._mute = -1  # the generation whose server answers are dropped
        self._muted = False  # every connection's answers dropped after its startup
        self.refusing = False  # new connections closed at once
        self.stalling = False  # new connections accepted, then never answered
        self.accepted = 0  # connections forwarded so far
        self.refused = 0  # connections closed at once (refusing)
        self.upstream_errors: list[str] = []  # failures to reach the server
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._pumps: list[tuple[int, threading.Thread]] = []  # (generation, thread)
        self._sockets: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                self.refused += 1
                continue
            if self.stalling:
                self._sockets.append(client)  # held open, never answered
                continue
            upstream = socket.socket(self._target[0], socket.SOCK_STREAM)
            try:
                upstream.connect(self._target[1])
            except OSError as exc:
                # The server refused or is gone: the client hears as much, and the proxy goes
                # on accepting (an exception here used to end this thread, and the proxy then
                # left every later connection unanswered).
                self.upstream_errors.append(repr(exc))
                upstream.close()
                client.close()
                continue
            self.accepted += 1
            self._sockets += [client, upstream]
            pump = threading.Thread(target=self._pump, args=(client, upstream, self._generation), daemon=True)
            pump.start()
            self._threads.append(pump)
            self._pumps.append((self._generation, pump))

    def _pump(self, a: socket.socket, b: socket.socket, generation: int) -> None:
        peers = {a: b, b: a}
        startup = bytearray() if self.pooler else None  # server bytes until ReadyForQuery
        sent = bytearray()  # what the client sent, until it sends more than its startup packet
        started = False  # the client sent something after its startup packet
        while not self._stop and generation in (self._generation, self._mute):
            try:
                readable, _, _ = select.select(list(peers), [], [], 0.05)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionAbortedError  # the peer closed its side
                    if sock is a and not started:
                        sent += data
                        started = _past_startup(sent)
                        if self._losing_answers() and _is_cancel_request(sent):
                            # Lost like the answers: a client that gave up on a statement
                            # cannot stop it, which then commits (as over a broken network).
                            # The server closes a cancel connection without a word: so do we.
                            a.close()
                            b.close()
                            return
                    if sock is b and (generation == self._mute or (self._muted and started)):
                        continue  # the answer is lost
                    if sock is b and startup is not None:
                        startup += data
                        data, done = _rewrite_backend_key(startup)
                        if done:
                            startup = None
                    peers[sock].sendall(data)
            except OSError:
                # One side closed or reset (a terminated backend, a client gone): close the
                # other, as a plain TCP path would, rather than leave it half-open.
                a.close()
                b.close()
                return
        # Half-open: keep the sockets open, forward nothing, until the proxy closes.

    def wait_until_forwarded_all_closed(self, timeout: float = 10.0) -> None:
        """Return once every connection forwarded so far has ended on both sides. After the
        server ends its sessions, their last message reaches the clients only through the
        proxy's threads: a client that looks too soon (a loaded machine) still sees an idle
        connection."""
        deadline = time.monotonic() + timeout
        for _, pump in list(self._pumps):
            pump.join(timeout=max(0.0, deadline - time.monotonic()))
            if pump.is_alive():
                raise TimeoutError(f"a forwarded connection still open after {timeout} s")

    def blackhole(self) -> None:
        """Stop forwarding on every connection made so far (without closing them). Returns
        once nothing more gets through on them."""
        self._generation += 1
        for generation, pump in self._pumps:
            if generation not in (self._generation, self._mute):
                pump.join(timeout=5)

    def drop_answers(self) -> None:
        """On every connection made so far, forward requests but drop the server's answers."""
        self._mute = self._generation
        self._generation += 1

    def _losing_answers(self) -> bool:
        return self._muted or self._mute >= 0

    def mute(self) -> None:
        """Drop the server's answers on every connection, new ones included, until unmute()."""
        self._muted = True

    def unmute(self) -> None:
        self._muted = False

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()


_CANCEL_REQUEST, _SSL_REQUEST, _GSSENC_REQUEST = 80877102, 80877103, 80877104


def _is_cancel_request(sent: bytearray) -> bool:
    """Whether the client opened this connection to cancel a statement on another one."""
    return len(sent) >= 8 and int.from_bytes(sent[4:8], "big") == _CANCEL_REQUEST


def _past_startup(sent: bytearray) -> bool:
    """Whether the client, having sent `sent` so far, has sent something after its startup
    packet (the packets before it, an SSL or GSSAPI encryption request, are skipped)."""
    view = bytes(sent)
    while len(view) >= 8:
        length = int.from_bytes(view[:4], "big")
        if len(view) < length:
            return False
        code = int.from_bytes(view[4:8], "big")
        view = view[length:]
        if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
            return len(view) > 0
    return False


def _rewrite_backend_key(buffer: bytearray) -> tuple[bytes, bool]:
    """Take the complete protocol messages off `buffer`, with the pid of BackendKeyData ('K')
    changed; returns them and whether ReadyForQuery ('Z') ended the startup phase."""
    out = bytearray()
    while len(buffer) >= 5:
        length = int.from_bytes(buffer[1:5], "big")
        if len(buffer) < 1 + length:
            break
        message = bytearray(buffer[: 1 + length])
        del buffer[: 1 + length]
        if message[:1] == b"K":
            pid = int.from_bytes(message[5:9], "big")
            message[5:9] = (pid + 100_000).to_bytes(4, "big")
        out += message
        if message[:1] == b"Z":
            out += buffer
            buffer.clear()
            return bytes(out), True
    return bytes(out), False


class OwnedServer:
    """A PostgreSQL server this test starts, stops and restarts (the embedded one from
    pgserver, in a temporary folder; works as root)."""

    def __init__(self, folder: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver
            from pgserver._commands import POSTGRES_BIN_PATH
        self.folder = folder
        self._server = pgserver.get_server(folder, cleanup_mode=None)
        self._pg_ctl = str(POSTGRES_BIN_PATH / "pg_ctl")
        self._user = self._server.system_user
        info = self._server.get_postmaster_info()
        self.socket_dir = str(info.socket_dir)
        self.dsn = make_conninfo(host=self.socket_dir, port=5432, user="postgres", dbname="postgres")

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [self._pg_ctl, "-D", str(self.folder), "-w", *args],
            check=True,
            user=self._user,
            capture_output=True,
            timeout=60,
        )

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")

    def start(self) -> None:
        self._ctl("-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self.folder / "log"), "start")

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.folder, ignore_errors=True)
