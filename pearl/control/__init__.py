"""MPI control plane: coordinator side (:mod:`.coordinator_side`, :mod:`.execute`), node
agent (:mod:`.agent`, :mod:`.workers`), wire format (:mod:`.messages`, :mod:`.channel`),
rendezvous (:mod:`.portfile`, :mod:`.rendezvous`) and the one test fake (:mod:`.fakes`).

Nothing here imports mpi4py at import time; :func:`pearl.control.mpi.load_mpi` does, at the
thread level each side needs.
"""
