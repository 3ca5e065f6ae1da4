"""``tokentrail inspect``: a read-only web view of a finished run's data directory (DESIGN §16)."""
