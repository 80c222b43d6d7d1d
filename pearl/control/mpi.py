"""Loading mpi4py for the control plane, and the MPICH facts the design rests on.

Measured with the MPICH 5.0.2 wheel (ch4:ucx; the ofi netmod fails here with "default
nic=eth0") and mpi4py 4.x:

- ``MPI.Open_port``/``Accept``/``Connect`` work between separately launched
  ``mpiexec -n 1`` runs, and between a singleton-initialised server and ``mpiexec``
  clients, but **not between two singletons** ("Local and remote groups in
  MPI_Intercomm_create must not overlap", later connects silently broken): agents must run
  under ``mpiexec``/``srun``.
- ``THREAD_MULTIPLE`` is granted when requested, **but a blocking ``Accept`` in one thread
  starves every other intercommunicator of the process**: no message arrives on the others
  until it returns (also with ``MPIR_CVAR_ASYNC_PROGRESS=1``, ``MPIR_CVAR_CH4_NUM_VCIS=4``
  or ``MPIR_CVAR_CH4_GLOBAL_PROGRESS=1``). Hence :mod:`pearl.control.rendezvous`: an agent
  knocks over TCP first, and the coordinator calls ``Accept`` only when a peer is about to
  ``Connect``. ``Connect`` itself waits for a matching ``Accept`` (MPICH
  ``MPIR_CVAR_CH4_COMM_CONNECT_TIMEOUT``, 180 s by default).
- Errors on a communicator are returned (``ERRORS_RETURN`` is set on each intercomm) and
  surface as ``MPI.Exception``; the control plane treats any of them as the loss of that one
  peer and never as fatal for the process.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def find_mpiexec() -> str | None:
    """The ``mpiexec`` of this interpreter's environment (the MPICH wheel's), else PATH's."""
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def load_mpi(thread_level: str = "multiple") -> Any:
    """Import ``mpi4py.MPI`` initialised at ``thread_level`` and check what was granted."""
    import mpi4py

    if "mpi4py.MPI" not in __import__("sys").modules:
        mpi4py.rc.thread_level = thread_level
    from mpi4py import MPI

    wanted = {
        "single": MPI.THREAD_SINGLE,
        "funneled": MPI.THREAD_FUNNELED,
        "serialized": MPI.THREAD_SERIALIZED,
        "multiple": MPI.THREAD_MULTIPLE,
    }[thread_level]
    if MPI.Query_thread() < wanted:
        raise RuntimeError(
            f"MPI granted thread level {MPI.Query_thread()}, need {thread_level} ({wanted})"
        )
    mod: ModuleType = MPI
    return mod
