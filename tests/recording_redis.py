"""A Redis client for tests that records its round trips (tests/test_prefix.py,
tests/test_jobstore.py): how many calls a code path costs, and which commands."""

from __future__ import annotations

import redis


class Recording(redis.Redis):
    """Each round trip as the names of the commands it carried: one for a command, all
    of a pipeline's for its `execute`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trips: list[list[str]] = []
        self.sent_args: list[list[tuple]] = []  # each trip's commands with their arguments

    @property
    def round_trips(self) -> int:
        return len(self.trips)

    def last_trip_with(self, arg) -> int:
        """The index of the last round trip that carried `arg` (a key) in any command; -1 if none."""
        wanted = {arg, arg.encode() if isinstance(arg, str) else arg}
        return max((i for i, trip in enumerate(self.sent_args)
                    if any(a in wanted for c in trip for a in c if isinstance(a, (str, bytes)))), default=-1)

    @property
    def sent(self) -> list[str]:
        """Every command sent, in order."""
        return [name for trip in self.trips for name in trip]

    def execute_command(self, *args, **options):
        self.trips.append([str(args[0]).upper()])
        self.sent_args.append([args])
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def recorded(*args, **kwargs):
            if pipe.command_stack:
                self.trips.append([str(command[0][0]).upper() for command in pipe.command_stack])
                self.sent_args.append([command[0] for command in pipe.command_stack])
            return execute(*args, **kwargs)

        pipe.execute = recorded
        return pipe
