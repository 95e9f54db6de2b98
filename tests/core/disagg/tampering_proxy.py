"""A relay between a decode engine and a prefill engine's bootstrap port that flips one bit on the
way: a man in the middle of the control plane, for the transports' authentication."""

from __future__ import annotations

import random
import socket
import threading
from typing import Callable

Where = Callable[[bytes], "int | None"]  # the offset to flip in the bytes seen so far, once it is known


class TamperingProxy:
    """Relays one connection; flips a random bit of the byte at ``to_decode(seen)`` of the prefill
    engine's bytes, or at ``to_prefill(seen)`` of the decode engine's (whichever is given)."""

    def __init__(self, prefill_port: int, to_decode: Where | None = None, to_prefill: Where | None = None) -> None:
        self.prefill_port, self.where = prefill_port, {"to_decode": to_decode, "to_prefill": to_prefill}
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.flipped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        decode, _ = self.server.accept()
        self.server.close()
        prefill = socket.create_connection(("127.0.0.1", self.prefill_port))
        for src, dst, where in ((prefill, decode, self.where["to_decode"]),
                                (decode, prefill, self.where["to_prefill"])):
            threading.Thread(target=self._relay, args=(src, dst, where), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, where: Where | None) -> None:
        seen, sent, offset = bytearray(), 0, None
        try:
            while chunk := src.recv(65536):
                seen += chunk
                if where is None:
                    dst.sendall(chunk)
                    continue
                offset = where(bytes(seen)) if offset is None else offset
                if offset is None:
                    continue  # not yet known: hold the bytes
                if offset < len(seen) and not self.flipped.is_set():
                    seen[offset] ^= 1 << random.randrange(8)
                    self.flipped.set()
                upto = len(seen) if self.flipped.is_set() else min(offset, len(seen))
                dst.sendall(seen[sent:upto])
                sent = upto
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
