"""MPI control plane: coordinator side (:mod:`.coordinator_side`, :mod:`.execute`), node
agent (:mod:`.agent`, :mod:`.workers`), wire format (:mod:`.messages`, :mod:`.channel`),
and rendezvous (:mod:`.portfile`, :mod:`.rendezvous`). The engines it starts are in
:mod:`pearl.engines` (the test fake: :mod:`pearl.engines.fake`).

Nothing here imports mpi4py at import time; :func:`pearl.control.mpi.load_mpi` does, at the
thread level each side needs.
"""
