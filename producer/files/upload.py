"""A `multipart/form-data` upload (OpenAI's `files.create`), streamed into the store.

The file part goes to a store writer chunk by chunk as the request body arrives, so an
upload of any size costs a chunk of memory, and one over the size limit is cut off at
the limit (413) instead of being read to its end first. The other parts (`purpose`) are
small form fields, capped too.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

import anyio
import python_multipart
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from producer.errors import ApiError, BadRequest
from producer.files.store import Writer

#: A form field (not the file) larger than this is no field OpenAI's API has.
MAX_FIELD_BYTES = 4096


class TooLarge(ApiError):
    status = 413


class Upload:
    """The parsed request: its form fields, and the file part's name and size."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}
        self.filename: Optional[str] = None
        self.bytes = 0


async def receive(content_type: str, body: AsyncIterator[bytes], writer: Writer, *, max_bytes: int) -> Upload:
    """Parse the upload, writing its `file` part to `writer` (not committed: the caller
    validates, then commits or aborts). Raises BadRequest / TooLarge."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in params:
        raise BadRequest("upload the file as multipart/form-data with fields `file` and `purpose` "
                         "(what `openai.files.create` and `curl -F` send)", status=400)
    upload = Upload()
    part: dict = {}
    pending: list[bytes] = []  # file data parsed from the current chunk, written after it

    def on_part_begin() -> None:
        part.clear()
        part.update(headers=[], name=b"", value=b"", field=bytearray(), file=False)

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part["name"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part["value"] += data[start:end]

    def on_header_end() -> None:
        part["headers"].append((part["name"].lower(), part["value"]))
        part["name"], part["value"] = b"", b""

    def on_headers_finished() -> None:
        disposition = dict(part["headers"]).get(b"content-disposition", b"")
        _, options = parse_options_header(disposition)
        part["field_name"] = options.get(b"name", b"").decode("utf-8", "replace")
        if part["field_name"] == "file":
            if upload.filename is not None:
                raise BadRequest("send one `file` part per upload", param="file", status=400)
            part["file"] = True
            upload.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part["file"]:
            upload.bytes += end - start
            if upload.bytes > max_bytes:
                raise TooLarge(f"the file is over the limit of {max_bytes} bytes ({max_bytes / 2**20:.0f} MiB): "
                               "split it into several files, one batch each", param="file",
                               code="file_too_large")
            pending.append(data[start:end])
        else:
            part["field"] += data[start:end]
            if len(part["field"]) > MAX_FIELD_BYTES:
                raise BadRequest(f"form field `{part['field_name']}` is over {MAX_FIELD_BYTES} bytes", status=400,
                                 param=part["field_name"])

    def on_part_end() -> None:
        if not part["file"]:
            upload.fields[part["field_name"]] = part["field"].decode("utf-8", "replace")

    parser = python_multipart.MultipartParser(params[b"boundary"], {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end,
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished})
    try:
        async for chunk in body:
            parser.write(chunk)
            if pending:
                data = b"".join(pending)
                pending.clear()
                await anyio.to_thread.run_sync(writer.write, data)  # disk I/O off the event loop
        parser.finalize()
    except FormParserError as exc:
        raise BadRequest(f"the multipart body is malformed ({exc})", status=400) from None
    if upload.filename is None:
        raise BadRequest("no `file` part: send the JSONL file as the form field `file`", param="file", status=400)
    return upload
