"""One peer over one intercommunicator: byte messages, nonblocking both ways.

Sending: ``Isend`` of the encoded bytes (``MPI.BYTE``) on :data:`TAG`; the buffer and the
request are kept until the request completes (:meth:`Channel.progress`). Receiving:
``Iprobe`` for :data:`TAG`, ``Get_count`` for the size, ``Recv`` into a ``bytearray`` of
exactly that size, then :func:`pearl.control.messages.decode`. No pickled object is ever
received, and no collective is ever called on the intercommunicator: a dead peer cannot
block us. Any ``MPI.Exception`` marks the channel broken (:attr:`Channel.error`).

Closing: :meth:`close` frees the communicator locally (``MPI_Comm_free``, which MPICH
implements without talking to the peer), never ``Disconnect`` (collective with the peer).
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import BaseModel

from pearl.control.messages import MAX_MESSAGE_BYTES, decode, encode

TAG = 7


class Channel:
    def __init__(self, mpi: Any, comm: Any) -> None:
        self._mpi = mpi
        self.comm = comm
        comm.Set_errhandler(mpi.ERRORS_RETURN)
        self._pending: list[tuple[Any, bytes]] = []
        self.error: str | None = None
        self.closed = False

    def send(self, msg: BaseModel) -> None:
        if self.closed or self.error:
            return
        data = encode(msg)
        try:
            req = self.comm.Isend([data, self._mpi.BYTE], dest=0, tag=TAG)
        except self._mpi.Exception as e:
            self.error = f"send failed: {e.Get_error_string()}"
            return
        self._pending.append((req, data))

    def progress(self) -> bool:
        """Complete finished sends; True when nothing is left in flight."""
        if self._pending and not self.error:
            try:
                self._pending = [(r, d) for r, d in self._pending if not r.Test()]
            except self._mpi.Exception as e:
                self.error = f"send failed: {e.Get_error_string()}"
        return not self._pending

    def recv_raw(self) -> bytes | None:
        """Next raw message, or None if none has arrived."""
        if self.closed or self.error:
            return None
        st = self._mpi.Status()
        try:
            if not self.comm.Iprobe(source=0, tag=TAG, status=st):
                return None
            n = st.Get_count(self._mpi.BYTE)
            if n > MAX_MESSAGE_BYTES:  # refuse before allocating: the peer is dropped
                self.error = f"peer sent {n} bytes, over {MAX_MESSAGE_BYTES}"
                return None
            buf = bytearray(max(n, 0))
            self.comm.Recv([buf, self._mpi.BYTE], source=0, tag=TAG)
        except self._mpi.Exception as e:
            self.error = f"receive failed: {e.Get_error_string()}"
            return None
        return bytes(buf)

    def recv(self) -> Any | None:
        """Next decoded message; raises ProtocolError on a malformed one."""
        raw = self.recv_raw()
        return None if raw is None else decode(raw)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.error:
            # A broken peer: cancel what we sent and drop the handle without touching it
            # again (freeing may try to complete pending operations with the dead peer).
            for req, _ in self._pending:
                with contextlib.suppress(self._mpi.Exception):
                    req.Cancel()
            return
        with contextlib.suppress(self._mpi.Exception):
            self.comm.Free()
