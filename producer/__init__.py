"""The front door: a Python client, the `kvfleet submit` CLI and the HTTP API."""
