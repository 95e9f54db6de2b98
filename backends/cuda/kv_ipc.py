"""The ``cuda_ipc`` KV transport (``--disaggregation-transfer-backend cuda_ipc``): for a prefill and a
decode engine on GPUs of one node, the pages handed over as a CUDA IPC handle.

The control plane is the tcp transport's (core/native/kv_tcp.py: rooms, the authenticated request
and reply, refusals, the timeout); only the pages move another way. The prefill engine stages the
pages it sends in one device buffer and answers the fetch with torch's CUDA IPC description of it
(``torch.multiprocessing.reductions.reduce_tensor``: device, the allocation's IPC handle, sizes and
offsets, the producer's reference counter and event), each page's size and checksum, all under the
HMAC of the shared secret; the decode engine opens the buffer through torch
(``rebuild_cuda_tensor``, which also serves two engines of one process from torch's cache), copies
the pages out, and confirms (an authenticated DONE), after which the prefill engine frees its
buffer. The fields are sent as fixed binary frames: nothing is unpickled. Both engines must see the
same devices (the IPC handle names the producer's device index). The pages still reach the decode
engine as host bytes, as the transport interface hands them over, and their checksums are checked
there: this transport moves them over the GPUs' interconnect rather than a socket, not yet straight
into the decode engine's KV cache. Refused, with the reason, where there is no NVIDIA GPU.
"""

from __future__ import annotations

import hmac
import socket
import struct

from ...core.native.kv_tcp import (IO_TIMEOUT_S, PAGE, TAG_BYTES, TcpTransport, _recv_exact, _tag, split_pages,
                                   staged_checksums)

# device, storage bytes, storage offset, ref-counter offset, event sync required, tensor offset, bytes,
# then the lengths of the IPC handle, the ref-counter handle and the event handle, which follow
IPC = struct.Struct("!iQQQ?QQHHH")
MAX_HANDLE = 1024
DONE = b"EKVD"  # the decode engine copied the pages out


def ipc_reasons(ctx) -> list[str]:
    if ctx.platform.vendor != "nvidia":
        return [f"needs NVIDIA GPUs of one node (the platform is {ctx.platform.summary()})"]
    return []


class CudaIpcTransport(TcpTransport):
    name = "cuda_ipc"

    def _send_pages(self, conn: socket.socket, head: bytes, payload) -> None:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        total = sum(len(p) for p in payload.pages)
        host = torch.frombuffer(bytearray(b"".join(payload.pages) or b"\0"), dtype=torch.uint8)
        staged = host.to(torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.current_stream().synchronize()
        (_, _, _, tensor_offset, _, _, device, handle, size, offset, _, counter, counter_offset, event,
         event_sync) = reduce_tensor(staged)[1]
        frame = IPC.pack(device, size, offset, counter_offset, event_sync, tensor_offset, total, len(handle),
                         len(counter), len(event or b"")) + handle + counter + (event or b"")
        headers = [PAGE.pack(len(p), c) for p, c in zip(payload.pages, payload.checksums)]
        conn.sendall(frame + b"".join(headers) + _tag(self.key, head, frame, *headers))
        conn.settimeout(IO_TIMEOUT_S)
        done = _recv_exact(conn, len(DONE) + TAG_BYTES)
        if not hmac.compare_digest(done, DONE + _tag(self.key, head, DONE)):
            raise ValueError("the decode engine did not confirm copying the pages")
        del staged  # the decode engine holds no reference now: the allocator may reuse the block

    def _receive_pages(self, sock: socket.socket, reply: bytes, sizes: list[int]) -> tuple[list[bytes], list[bytes]]:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        fixed = _recv_exact(sock, IPC.size)
        device, size, offset, counter_offset, event_sync, tensor_offset, total, *lengths = IPC.unpack(fixed)
        if max(lengths) > MAX_HANDLE:
            raise ValueError(f"IPC handles of {lengths} bytes (at most {MAX_HANDLE})")
        if total != sum(sizes):
            raise ValueError(f"pages of {total} bytes in all; this engine's pages are {sum(sizes)}")
        handle, counter, event = (_recv_exact(sock, n) for n in lengths)
        headers = [_recv_exact(sock, PAGE.size) for _ in sizes]
        frame = fixed + handle + counter + event
        if not hmac.compare_digest(_recv_exact(sock, TAG_BYTES), _tag(self.key, reply, frame, *headers)):
            raise ValueError("the pages' IPC description is not authenticated")
        checksums = staged_checksums(headers, sizes)
        data = b""
        if total:
            shared = rebuild_cuda_tensor(torch.Tensor, (total,), (1,), tensor_offset, torch.UntypedStorage,
                                         torch.uint8, device, handle, size, offset, False, counter, counter_offset,
                                         event or None, event_sync)
            data = shared.cpu().numpy().tobytes()
            del shared
        sock.sendall(DONE + _tag(self.key, reply, DONE))
        return split_pages(data, sizes), checksums
