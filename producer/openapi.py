"""The OpenAPI document: msgspec Structs as `components/schemas`, in one place.

Routes decode their bodies with msgspec, not pydantic, so FastAPI cannot see their
types. A route declares them here instead, in its decorator:

    @router.post("/v1/jobs", openapi_extra=openapi.body(SubmitRequest),
                 responses={202: openapi.response(Accepted, "Queued"),
                            404: openapi.error_response("No such job")})

`body()` and `response()` answer a `$ref` and remember the Struct; `install(app)` makes
`app.openapi()` answer FastAPI's document with every remembered Struct (and the Structs
they use) under `components/schemas`, so every `$ref` resolves. Constraints that msgspec
cannot state (`exactly_one`) are added to the component here too, so the document
states what the server enforces.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import msgspec
from fastapi import FastAPI

from producer.answers import Error

REF_PREFIX = "#/components/schemas/"
_DEFS_PREFIX = "#/$defs/"  # where msgspec.json.schema() puts its definitions
#: FastAPI's own validation answer; create_app turns it into an ApiError (`Error`).
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")

# Module-level on purpose: decorators run when a route module is imported, before any
# app exists, so the Structs they name are collected here and read by `install`. Both
# only ever grow, and a name maps to one type (a clash raises at import).
_TYPES: dict[str, type] = {}
_EXTRA: dict[str, dict[str, Any]] = {}


def body(*types: type, required: bool = True) -> dict:
    """`openapi_extra=` for a JSON request body of one of `types` (several: `oneOf`)."""
    refs = [_ref(t) for t in types]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def response(type_: Optional[type], description: str, *, media_type: str = "application/json",
             schema: Optional[dict] = None) -> dict:
    """One entry of `responses={status: ...}`: a body of `type_` (a Struct), or of a raw
    `schema`, as `media_type`; neither: an answer without a body."""
    if type_ is not None:
        schema = _ref(type_)
    if schema is None:
        return {"description": description}
    return {"description": description, "content": {media_type: {"schema": schema}}}


def error_response(description: str) -> dict:
    """An error answer's entry: `producer.errors.ApiError.body()`, the `Error` component."""
    return response(Error, description)


def exactly_one(type_: type, *fields: str) -> None:
    """State in `type_`'s component that exactly one of `fields` is given and not null
    (msgspec has no keyword for it; the server checks it after decoding)."""
    alternatives = [{"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in fields]
    _ref(type_)
    _EXTRA.setdefault(type_.__name__, {})["oneOf"] = alternatives


def install(app: FastAPI) -> None:
    """Make `app.openapi()` answer the complete document, built once (again only when
    routes are added: FastAPI's own cache decides that)."""
    fastapi_openapi = app.openapi
    completed: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        # FastAPI answers `app.openapi_schema`, ours below, until its routes change;
        # then a fresh document, which is completed (a copy: it shares dicts with the
        # routes' `openapi_extra`) and cached in its place.
        doc = fastapi_openapi()
        if not completed or doc is not completed[0]:
            completed[:] = [complete(copy.deepcopy(doc))]
            app.openapi_schema = completed[0]
        return completed[0]

    app.openapi = openapi  # type: ignore[method-assign]


def complete(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document, completed: the registered Structs' components, every
    `#/$defs/X` a route embedded (a whole `msgspec.json.schema()`) moved there, and
    FastAPI's own 422 answers documented as the `Error` they are turned into, like
    any error status documented without a body (every refusal is an `Error`: see
    `producer.http_errors`), and FastAPI's guess of a JSON body dropped where a route
    names its own content types."""
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    _ref(Error)  # FastAPI's 422s are retargeted to it even where no route named it
    _, components = msgspec.json.schema_components(list(_TYPES.values()), ref_template=REF_PREFIX + "{name}")
    schemas.update(components)
    for name, extra in _EXTRA.items():
        schemas[name] = {**schemas[name], **extra}
    _walk(doc, lambda node: schemas.update({k: v for k, v in node.pop("$defs", {}).items() if k not in schemas}))
    _walk(doc, _retarget)  # after hoisting: the hoisted definitions refer to each other by `#/$defs/`
    _walk(doc, _drop_guess)
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            for status, answer in operation.get("responses", {}).items():
                if status[:1] in ("4", "5") and "content" not in answer:
                    answer.update(error_response(answer.get("description", "")))
    if not _references(doc, _FASTAPI_VALIDATION[0]):
        for name in _FASTAPI_VALIDATION:
            schemas.pop(name, None)
    return doc


def _ref(type_: type) -> dict:
    name = type_.__name__
    known = _TYPES.setdefault(name, type_)
    if known is not type_:
        raise ValueError(f"two types named {name!r} in the OpenAPI document ({known!r}, {type_!r}): rename one")
    return {"$ref": REF_PREFIX + name}


def _walk(node: Any, visit: Callable[[dict], Any]) -> None:
    """Apply `visit` to every dict in `node`, in place, children first."""
    children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        _walk(child, visit)
    if isinstance(node, dict):
        visit(node)


def _retarget(node: dict) -> None:
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return
    if ref.startswith(_DEFS_PREFIX):
        node["$ref"] = REF_PREFIX + ref[len(_DEFS_PREFIX):]
    elif ref == REF_PREFIX + _FASTAPI_VALIDATION[0]:
        node["$ref"] = REF_PREFIX + Error.__name__


def _drop_guess(node: dict) -> None:
    # FastAPI documents a route without a `response_model` as answering JSON of any
    # shape (`"schema": {}`); where the route names its content types itself (an event
    # stream, Prometheus text), that guess is wrong and is dropped.
    content = node.get("content")
    if isinstance(content, dict) and len(content) > 1 and content.get("application/json") == {"schema": {}}:
        del content["application/json"]


def _references(node: Any, name: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == REF_PREFIX + name or any(_references(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_references(v, name) for v in node)
    return False
