"""kvfleet: the shared core — contracts, settings, constants, the job store and the CLI."""

__version__ = "0.1.0"
