"""OpenAI-compatible request and answer shapes, on top of kvfleet's own jobs.

`schemas` holds the wire shapes (msgspec Structs, also what the OpenAPI document shows),
`requests` turns a request body into a kvfleet job (and refuses what kvfleet does not
do, naming the field), `responses` turns a finished job into OpenAI's answer and a
stream's events into OpenAI's chunks, `relay` streams them as server-sent events.
The routes are in producer/routes/completions.py and producer/routes/models.py.
"""
