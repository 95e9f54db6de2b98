"""The ``cuda_ipc`` KV transport (``--disaggregation-transfer-backend cuda_ipc``): for a prefill and a
decode engine on GPUs of one node, the pages handed over as a CUDA IPC handle.

The control plane is the tcp transport's (core/native/kv_tcp.py: rooms, the authenticated request
and reply, refusals, the timeout); only the pages move another way. After the OK reply the
prefill engine names its process (a random nonce per process) and its machine (the kernel's boot
id); the decode engine answers how it will take the pages:

- another process of the same machine (two ``engine serve``): the prefill engine stages the pages
  in one device buffer and sends torch's CUDA IPC description of it
  (``torch.multiprocessing.reductions.reduce_tensor``: device, the allocation's IPC handle, sizes
  and offsets, the producer's reference counter and event); the decode engine opens it with
  ``rebuild_cuda_tensor`` on that device, copies the pages out, drops the mapping (which releases
  the producer's counter) and confirms (DONE), after which the prefill engine frees its buffer.
- the same process (two engines in one, as the engine tests run them): CUDA refuses to open an
  IPC handle in the process that made it (``cudaIpcOpenMemHandle`` fails with "invalid device
  context"), and torch's own IPC cache does not serve it either (``reduce_tensor`` files the
  storage under the handle, ``rebuild_cuda_tensor`` looks it up under handle and offset). The
  prefill engine lends the pages in memory under a random ticket instead, until DONE; no handle
  is made, so none waits in torch's limbo.
- another machine: refused on the decode side with the reason (use tcp or nixl).

Every frame is under the HMAC of the shared secret and fixed binary: nothing is unpickled. The
IPC handle names the producer's device index: both processes must see the same devices. The
pages still reach the decode engine as host bytes, as the transport interface hands them over,
and their checksums are checked there: the GPU path moves them over the interconnect rather
than a socket, not yet straight into the decode engine's KV cache. Refused, with the reason,
where there is no NVIDIA GPU.

A decode engine that fails after the description was sent and before it opened the handle (it
died, or the frame was refused) leaves that buffer's counter unreleased: torch keeps the block in
its limbo until the prefill process ends (and warns then, "Producer process has been terminated
before all shared CUDA tensors released"). One buffer per such transfer; a decode engine that
opened it releases the counter when its mapping dies, even without confirming.
"""

from __future__ import annotations

import functools
import hmac
import os
import socket
import struct
import threading
import uuid

from ...core.native.kv_tcp import (PAGE, TAG_BYTES, TcpTransport, _recv_exact, _tag, split_pages,
                                   staged_checksums)

PEER = struct.Struct("!16s16s")  # the prefill engine's process nonce and its machine's boot id
MODE = struct.Struct("!B")  # how the decode engine takes the pages
LOCAL, IPC_MODE = 1, 2
LOAN = struct.Struct("!16sQ")  # LOCAL: the ticket, the pages' bytes in all
# IPC: device, storage bytes, storage offset, ref-counter offset, event sync required, tensor offset, bytes,
# then the lengths of the IPC handle, the ref-counter handle and the event handle, which follow
IPC = struct.Struct("!iQQQ?QQHHH")
MAX_HANDLE = 1024
DONE = b"EKVD"  # the decode engine copied the pages out

_NONCES: dict[int, bytes] = {}
_LOANS: dict[bytes, list[bytes]] = {}  # ticket -> pages lent to a decode engine of this process
_LOANS_LOCK = threading.Lock()


def process_nonce() -> bytes:
    """This process, to its peers: random, so processes of other PID namespaces never share one,
    and drawn again in a forked child (another pid)."""
    return _NONCES.setdefault(os.getpid(), os.urandom(16))


@functools.cache
def boot_id() -> bytes:
    """This machine (one boot of its kernel; containers of one host share it)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return uuid.UUID(f.read().strip()).bytes


def ipc_reasons(ctx) -> list[str]:
    if ctx.platform.vendor != "nvidia":
        return [f"needs NVIDIA GPUs of one node (the platform is {ctx.platform.summary()})"]
    return []


def cuda_index(ctx) -> int | None:
    """The engine's CUDA device index, read on the engine's thread: a thread serving a fetch starts
    on device 0, whatever device the engine uses. None for an engine on no CUDA device."""
    import torch

    device = torch.device(ctx.engine_config.device or ctx.platform.torch_device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


class CudaIpcTransport(TcpTransport):
    name = "cuda_ipc"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.cuda_index = cuda_index(ctx)

    # -- the prefill side ------------------------------------------------------------------

    def _send_pages(self, conn: socket.socket, head: bytes, payload) -> None:
        peer = PEER.pack(process_nonce(), boot_id())
        conn.sendall(peer + _tag(self.key, head, peer))
        mode = _recv_exact(conn, MODE.size)
        if not hmac.compare_digest(_recv_exact(conn, TAG_BYTES), _tag(self.key, head, peer, mode)):
            raise ValueError("the decode engine's answer is not authenticated")
        (how,) = MODE.unpack(mode)
        headers = [PAGE.pack(len(p), c) for p, c in zip(payload.pages, payload.checksums)]
        if how == LOCAL:
            self._lend(conn, head + peer + mode, payload, headers)
        elif how == IPC_MODE:
            self._share(conn, head + peer + mode, payload, headers)
        else:
            raise ValueError(f"the decode engine asked for mode {how}")

    def _lend(self, conn: socket.socket, head: bytes, payload, headers: list[bytes]) -> None:
        """A decode engine of this process: the pages themselves, under a ticket, until DONE."""
        ticket = os.urandom(16)
        with _LOANS_LOCK:
            _LOANS[ticket] = payload.pages
        try:
            frame = LOAN.pack(ticket, sum(len(p) for p in payload.pages))
            conn.sendall(frame + b"".join(headers) + _tag(self.key, head, frame, *headers))
            self._await_done(conn, head)
        finally:
            with _LOANS_LOCK:
                _LOANS.pop(ticket, None)

    def _share(self, conn: socket.socket, head: bytes, payload, headers: list[bytes]) -> None:
        """A decode engine of another process: the pages in one device buffer, as a CUDA IPC handle."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        if self.cuda_index is None:
            raise ValueError("cuda_ipc shares pages from a CUDA device; this engine runs on none")
        total = sum(len(p) for p in payload.pages)
        frame, staged = IPC.pack(self.cuda_index, 0, 0, 0, False, 0, 0, 0, 0, 0), None
        if total:  # else the decode engine holds every page: no buffer, and no handle it would never open
            host = torch.frombuffer(bytearray(b"".join(payload.pages)), dtype=torch.uint8)
            with torch.cuda.device(self.cuda_index):
                staged = host.to("cuda")
                torch.cuda.current_stream().synchronize()
                (_, _, _, tensor_offset, _, _, device, handle, size, offset, _, counter, counter_offset, event,
                 event_sync) = reduce_tensor(staged)[1]
            frame = IPC.pack(device, size, offset, counter_offset, event_sync, tensor_offset, total, len(handle),
                             len(counter), len(event or b"")) + handle + counter + (event or b"")
        conn.sendall(frame + b"".join(headers) + _tag(self.key, head, frame, *headers))
        self._await_done(conn, head)
        del staged  # the decode engine dropped its mapping, so its counter is released: the block is free

    def _await_done(self, conn: socket.socket, head: bytes) -> None:
        done = _recv_exact(conn, len(DONE) + TAG_BYTES)
        if not hmac.compare_digest(done, DONE + _tag(self.key, head, DONE)):
            raise ValueError("the decode engine did not confirm copying the pages")

    # -- the decode side -------------------------------------------------------------------

    def _receive_pages(self, sock: socket.socket, reply: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        peer = _recv_exact(sock, PEER.size)
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, reply, peer)):
            raise ValueError("the prefill engine's process is not authenticated")
        nonce, machine = PEER.unpack(peer)
        if machine != boot_id():
            raise ValueError("the prefill engine runs on another machine: cuda_ipc serves engines of one node "
                             "(use --disaggregation-transfer-backend tcp or nixl)")
        here = nonce == process_nonce()
        mode = MODE.pack(LOCAL if here else IPC_MODE)
        sock.sendall(mode + _tag(self.key, reply, peer, mode))
        head = reply + peer + mode
        if here:
            return self._borrow(sock, head, sizes)
        return self._open(sock, head, sizes)

    def _borrow(self, sock: socket.socket, head: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        frame = _recv_exact(sock, LOAN.size)
        ticket, total = LOAN.unpack(frame)
        headers = self._authenticated_headers(sock, head, frame, sizes, total)
        with _LOANS_LOCK:
            pages = _LOANS.get(ticket)
        if pages is None:
            raise ValueError("the prefill engine of this process lent no pages under that ticket")
        sock.sendall(DONE + _tag(self.key, head, DONE))
        return list(pages), staged_checksums(headers, sizes)

    def _open(self, sock: socket.socket, head: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        fixed = _recv_exact(sock, IPC.size)
        device, size, offset, counter_offset, event_sync, tensor_offset, total, *lengths = IPC.unpack(fixed)
        if max(lengths) > MAX_HANDLE:
            raise ValueError(f"IPC handles of {lengths} bytes (at most {MAX_HANDLE})")
        handle, counter, event = (_recv_exact(sock, n) for n in lengths)
        headers = self._authenticated_headers(sock, head, fixed + handle + counter + event, sizes, total)
        data = b""
        if total:
            if not 0 <= device < torch.cuda.device_count():
                raise ValueError(f"the prefill engine's pages are on cuda:{device}; this process sees "
                                 f"{torch.cuda.device_count()} CUDA devices (both must see the same devices)")
            # open on the producer's device: this fetch thread has made no device current yet
            with torch.cuda.device(device):
                shared = rebuild_cuda_tensor(torch.Tensor, (total,), (1,), tensor_offset, torch.UntypedStorage,
                                             torch.uint8, device, handle, size, offset, False, counter,
                                             counter_offset, event or None, event_sync)
                data = shared.cpu().numpy().tobytes()
                del shared  # closes the mapping and releases the producer's counter before DONE
        sock.sendall(DONE + _tag(self.key, head, DONE))
        return split_pages(data, sizes), staged_checksums(headers, sizes)

    def _authenticated_headers(self, sock: socket.socket, head: bytes, frame: bytes, sizes: list[int],
                               total: int) -> list[bytes]:
        """The page headers after ``frame``, once the tag over both is the peer's."""
        if total != sum(sizes):
            raise ValueError(f"pages of {total} bytes in all; this engine's pages are {sum(sizes)}")
        headers = [_recv_exact(sock, PAGE.size) for _ in sizes]
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, head, frame, *headers)):
            raise ValueError("the pages' description is not authenticated")
        return headers
