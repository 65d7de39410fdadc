"""Tools for the store fault matrix: a TCP proxy that can stall an S3 endpoint mid-request,
and a record of a directory tree to prove nothing outside the store was written or deleted."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path


class StallingProxy:
    """127.0.0.1 proxy in front of ``upstream`` (host, port). ``stall()`` stops forwarding in
    both directions while keeping every connection open: the client sees a server that has
    stopped answering, the fault a deadline must catch. ``resume()`` lets bytes flow again."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.closed = True
        self.flowing.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file under ``root`` (links not followed)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out
