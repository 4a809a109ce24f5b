"""A small TCP key-value store for rendezvous: set/get/add/wait/delete/keys with timeouts.

One `StoreServer` listens (on rank 0, or in the launcher that supervises the ranks); every rank
talks to it through a `TCPStore` client. Process groups use it to pass the NCCL unique id when
there is no MPI, and to agree on sub-group ids; the launcher (issue 16) uses the same API for
heartbeats. Values are bytes; `add` keeps a decimal integer, as torch's store does.

Wire format, both ways: one JSON header line, then the header's `n` bytes of payload.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

from kiln.errors import DistributedError


class StoreServer:
    """The store's state and its listening socket, served by daemon threads of this process."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        store = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                while True:
                    line = self.rfile.readline()
                    if not line:
                        return
                    header = json.loads(line)
                    payload = self.rfile.read(header.get("n", 0))
                    reply, body = store._serve(header, payload)
                    reply["n"] = len(body)
                    self.wfile.write(json.dumps(reply).encode() + b"\n" + body)
                    self.wfile.flush()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        try:
            self._server = Server((host, port), Handler)
        except OSError as e:
            raise DistributedError(f"the rendezvous store cannot listen on {host}:{port}: {e}; "
                                   "pick a free MASTER_PORT") from None
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kiln-store",
                                        daemon=True)
        self._thread.start()

    def _serve(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        op, key = header["op"], header.get("key", "")
        with self._changed:
            if op == "set":
                self._data[key] = payload
                self._changed.notify_all()
                return {"ok": True}, b""
            if op == "add":
                value = int(self._data.get(key, b"0")) + int(header["amount"])
                self._data[key] = str(value).encode()
                self._changed.notify_all()
                return {"ok": True, "value": value}, b""
            if op == "delete":
                return {"ok": True, "value": int(self._data.pop(key, None) is not None)}, b""
            if op == "keys":
                return {"ok": True}, json.dumps(sorted(k for k in self._data if k.startswith(key))).encode()
            if op in ("get", "wait"):
                keys = [key] if op == "get" else header["keys"]
                found = self._changed.wait_for(lambda: all(k in self._data for k in keys),
                                               timeout=header["timeout"])
                if not found:
                    return {"ok": False, "missing": [k for k in keys if k not in self._data]}, b""
                return {"ok": True}, self._data[key] if op == "get" else b""
        return {"ok": False, "error": f"unknown store operation {op!r}"}, b""

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class TCPStore:
    """A client of the store at host:port; `is_server=True` also starts the server in this process.

    Every call that waits (get, wait) gives up after `timeout` seconds (the store's default, or
    the call's) with a DistributedError that names the keys still missing."""

    def __init__(self, host: str, port: int, *, is_server: bool = False, timeout: float = 300.0):
        self.timeout = float(timeout)
        self.server = StoreServer("0.0.0.0", port) if is_server else None  # reachable from every host
        self.host, self.port = host, (self.server.port if self.server is not None else port)
        self._lock = threading.Lock()
        self._sock = self._connect()
        self._file = self._sock.makefile("rb")

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5.0)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if time.monotonic() > deadline:
                    raise DistributedError(f"no rendezvous store answered at {self.host}:{self.port} "
                                           f"within {self.timeout:.0f} s ({e}); is rank 0 (or the "
                                           "launcher) up, and MASTER_ADDR/MASTER_PORT right?") from None
                time.sleep(0.1)

    def _request(self, header: dict, payload: bytes = b"", wait: float = 0.0) -> tuple[dict, bytes]:
        header["n"] = len(payload)
        with self._lock:
            try:
                self._sock.settimeout(wait + 30.0)
                self._sock.sendall(json.dumps(header).encode() + b"\n" + payload)
                line = self._file.readline()
                if not line:
                    raise OSError("connection closed")
                reply = json.loads(line)
                body = self._file.read(reply["n"]) if reply["n"] else b""
            except OSError as e:
                raise DistributedError(f"the rendezvous store at {self.host}:{self.port} is gone "
                                       f"({header['op']} {header.get('key', '')!r}: {e})") from None
        if not reply["ok"] and "error" in reply:
            raise DistributedError(reply["error"])
        return reply, body

    def set(self, key: str, value: bytes | str) -> None:
        self._request({"op": "set", "key": key}, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of key, waiting up to timeout seconds for some rank to set it."""
        t = self.timeout if timeout is None else float(timeout)
        reply, body = self._request({"op": "get", "key": key, "timeout": t}, wait=t)
        if not reply["ok"]:
            raise DistributedError(f"store key {key!r} was not set within {t:.1f} s: a rank is "
                                   "missing or stalled")
        return body

    def try_get(self, key: str) -> bytes | None:
        """The value of key, or None if it is not set (no waiting)."""
        reply, body = self._request({"op": "get", "key": key, "timeout": 0.0})
        return body if reply["ok"] else None

    def add(self, key: str, amount: int = 1) -> int:
        """Add to the integer at key (0 if unset) and return the new value, atomically."""
        return int(self._request({"op": "add", "key": key, "amount": int(amount)})[0]["value"])

    def wait(self, keys, timeout: float | None = None) -> None:
        """Return once every key is set; DistributedError naming the missing ones after timeout."""
        t = self.timeout if timeout is None else float(timeout)
        keys = [keys] if isinstance(keys, str) else list(keys)
        reply, _ = self._request({"op": "wait", "keys": keys, "timeout": t}, wait=t)
        if not reply["ok"]:
            raise DistributedError(f"store keys {reply['missing']} were not set within {t:.1f} s: "
                                   "a rank is missing or stalled")

    def delete(self, key: str) -> bool:
        return bool(self._request({"op": "delete", "key": key})[0]["value"])

    def keys(self, prefix: str = "") -> list[str]:
        return json.loads(self._request({"op": "keys", "key": prefix})[1])

    def close(self) -> None:
        with self._lock:
            self._file.close()
            self._sock.close()
        if self.server is not None:
            self.server.close()
