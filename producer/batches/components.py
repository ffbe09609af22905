"""What the Files and Batch routes and the driver share, built once per API process."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from producer.batches.driver import BatchDriver
from producer.batches.store import BatchStore
from producer.context import ApiContext
from producer.files.index import FileIndex
from producer.files.store import FileStore, open_store


@dataclass
class Batching:
    files: FileStore
    index: FileIndex
    batches: BatchStore
    driver: BatchDriver


def build(ctx: ApiContext) -> Batching:
    keys = ctx.settings.redis.keys
    files, index, batches = open_store(ctx.settings), FileIndex(ctx.sync_redis, keys), BatchStore(ctx.sync_redis, keys)
    return Batching(files=files, index=index, batches=batches, driver=BatchDriver(ctx, batches, files, index))


def batching(request: Request) -> Batching:
    return request.app.state.batching
