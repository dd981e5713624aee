"""What every stage stands on: the run directory, the SQLite ledger and its verdicts,
workers and their heartbeats, atomic shards, verification, progress bars, stop requests
and fault injection."""
