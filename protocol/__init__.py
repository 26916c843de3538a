"""Wire protocol of the edge FL runtime (work in progress)."""
