"""The framework's own refusals, answered like every `ApiError`.

FastAPI refuses an invalid query or path parameter (`RequestValidationError`) and
Starlette an unknown path (404) or method (405) before any route runs, each in its own
shape (`{"detail": ...}`). Here they become ApiErrors and go through the app's one
error handler, so every answer of the API has the one documented `Error` shape.

Starlette's 405 names only the methods of the first route whose path matched (GET and
HEAD for `/v1/jobs/{id}`, although DELETE is served there too); `allowed_methods`
looks at every route, and answers OPTIONS itself with that `Allow`.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from producer.errors import ApiError, BadRequest

Refuse = Callable[[Request, ApiError], Awaitable[Response]]


def install(app: FastAPI, refuse: Refuse) -> None:
    """Route the framework's refusals through `refuse`, the app's ApiError handler."""

    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return await refuse(request, _bad_request(exc))

    async def http(request: Request, exc: HTTPException) -> Response:
        if exc.status_code != 405:
            return await refuse(request, ApiError(_message(request, exc), status=exc.status_code))
        allow = ", ".join(allowed_methods(request.app, request.scope))
        if request.method == "OPTIONS":  # no route serves OPTIONS itself: say what the path serves
            return Response(status_code=204, headers={"Allow": allow})
        response = await refuse(request, ApiError(f"{request.method} is not served at {request.url.path}; "
                                                  f"use one of {allow}", status=405))
        response.headers["Allow"] = allow
        return response

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http)


#: The methods a route may serve; OPTIONS is answered here, for every path.
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at the request's path, and OPTIONS, sorted."""
    # Asked of the routes themselves, one method at a time, rather than read from
    # `route.methods`: included routers and mounts nest routes, and only `matches`
    # sees through them all.
    served = {m for m in _METHODS
              if any(route.matches({**scope, "method": m})[0] is Match.FULL for route in app.router.routes)}
    return sorted(served | {"OPTIONS"})


def _bad_request(exc: RequestValidationError) -> BadRequest:
    errors = exc.errors()
    parts = [f"`{_name(e['loc'])}`: {e['msg']}" for e in errors]
    param = _name(errors[0]["loc"]) if errors else None
    return BadRequest("invalid request: " + "; ".join(parts), param=param)


def _name(loc: tuple) -> str:
    # loc is ("query", "wait") or ("path", "job_id"): the field's name is its last part.
    return ".".join(str(part) for part in loc[1:]) or str(loc[0])


def _message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no route {request.url.path!r}; see /openapi.json for the routes this API serves"
    return str(exc.detail)
