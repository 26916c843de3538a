"""The training device: the runtime that announces itself, trains the tasks it gets and
uploads (``python -m edge_client run``), its local training per strategy, its transfers
and its persisted state. Needs torch (the ``train`` profile)."""
