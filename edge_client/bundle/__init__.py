"""Offline install bundles for boards (``python -m edge_client bundle``): runs on a
workstation, never on a device."""
