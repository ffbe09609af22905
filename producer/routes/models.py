"""OpenAI's model list, from the workers' heartbeats.

    GET /v1/models          {"object": "list", "data": [model, ...]}
    GET /v1/models/{model}  one model (404 when no live worker serves it)

A model is listed while at least one live worker serves it: what the fleet can run now.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from producer import ratelimit
from producer.context import ApiContext, context
from producer.errors import NotFound
from producer.openai.schemas import Model, ModelList
from producer.openapi import error_response, response

router = APIRouter()


async def _models(ctx: ApiContext) -> list[Model]:
    by_name: dict[str, list] = {}
    for beat in await ctx.fleet():
        if beat.model:
            by_name.setdefault(beat.model, []).append(beat)
    return [Model(id=name, created=int(min(b.started_at for b in beats)), workers=len(beats),
                  max_model_len=ctx.model.max_context if name == ctx.model.name else None)
            for name, beats in sorted(by_name.items())]


@router.get("/v1/models", responses={200: response(ModelList, "The models live workers serve"),
                                     401: error_response("Missing or unknown API key")})
async def list_models(request: Request) -> Response:
    ctx = context(request)
    tenant = ctx.tenant(request.headers)
    return Response(msgspec.json.encode(ModelList(data=await _models(ctx))), media_type="application/json",
                    headers=await ratelimit.headers(ctx, tenant))


@router.get("/v1/models/{model:path}", responses={200: response(Model, "The model"),
                                                  401: error_response("Missing or unknown API key"),
                                                  404: error_response("No live worker serves this model")})
async def get_model(model: str, request: Request) -> Response:
    ctx = context(request)
    tenant = ctx.tenant(request.headers)
    found = next((m for m in await _models(ctx) if m.id == model), None)
    if found is None:
        raise NotFound(f"no live worker serves the model {model!r} (GET /v1/models lists what does)",
                       param="model", code="model_not_found")
    return Response(msgspec.json.encode(found), media_type="application/json",
                    headers=await ratelimit.headers(ctx, tenant))
