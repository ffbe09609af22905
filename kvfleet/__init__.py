"""kvfleet: the core every service imports, and which imports no service.

Contracts, settings, constants, the job store, and the Redis-backed resources the API,
the scheduler and the workers share: the token ledger, tenancy, quotas, fleet capacity
with the worker registry, the Celery app, the served model's tokenizer and limits. The
development tooling here (`cli.py`, `fleet.py`, `infra/`) is the one place that may
import the services, because it starts them.
"""

__version__ = "0.1.0"
