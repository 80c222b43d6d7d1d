"""The run log: one JSONL file per run, written by the simulator and the coordinator alike.

``schema`` (pure): the versioned record types; ``records`` (pure): the records of a state
change, a decision and a borrow window; ``jsonl``: the writer and the tolerant reader.
The schema is documented in ``docs/log-schema.md``.
"""
