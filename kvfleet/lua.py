"""Lua shared by the core's Redis scripts: the one clock every replica agrees on.

Scripts take time from Redis's own clock (`TIME`), so API and scheduler replicas whose
host clocks are skewed still agree on which lease ran out and how full a bucket is. A
caller may pass its own `now` instead (a simulated clock); '' means Redis time.
"""

from __future__ import annotations

from typing import Optional

#: `redis_now(arg)`: seconds (float) from ARGV `arg`, or Redis's clock when it is ''.
REDIS_NOW = """
local function redis_now(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
"""


def now_arg(now: Optional[float]) -> str:
    """The ARGV a script reads with `redis_now`: '' for Redis's clock."""
    return "" if now is None else repr(now)
