"""The OpenAPI document is correct, and the served API keeps to it.

The document's own checks run on an in-process app (`create_app`; serving the document
and refusing needs neither Kafka nor a worker). The fuzz run loads `/openapi.json` from
a real fleet's API and sends schemathesis' generated requests, valid and invalid, to
every operation the document lists (routes added later are covered without a change
here): no answer may be a 5xx, and every answer must have a documented status, content
type and schema. Seeded (`derandomize`), so CI sees the same requests every run.
"""

from __future__ import annotations

from typing import Any, Iterator

import jsonschema
import pytest
import schemathesis
from schemathesis import GenerationMode
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from kvfleet.settings import RedisSettings, Settings
from producer.api import create_app

#: Requests per operation and generation mode. Bounded so the file runs in ~2 minutes
#: on two cores; seeded, so a failure found once is found every run.
EXAMPLES = 25
CALL_TIMEOUT_S = 120  # a completion waits for its job; a hung answer fails instead of hanging CI
TENANT = "fuzz"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                         suppress_health_check=list(HealthCheck))


@pytest.fixture
def app(redis_url, prefix):
    # Not entered as a context manager: no lifespan, so no Kafka is needed to serve
    # the document or to refuse a request before it is queued.
    settings = Settings().replace(redis=RedisSettings(url=redis_url, key_prefix=prefix))
    return create_app(settings)


@pytest.fixture
def client(app) -> TestClient:
    return TestClient(app)


@pytest.fixture
def document(client) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref}: only references inside the document are expected"
    node: Any = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve (no {part!r})"
        node = node[part]
    return node


def _operation(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return document["paths"][path][method]


def test_every_ref_resolves_to_a_component(document):
    refs = set(_refs(document))
    assert "#/components/schemas/SubmitRequest" in refs and "#/components/schemas/JobResult" in refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        _resolve(document, ref)
    assert "$defs" not in str(document)  # msgspec's local definitions were all moved


def test_every_component_is_a_valid_json_schema(document):
    schemas = document["components"]["schemas"]
    for name, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_operation_documents_its_errors_as_the_error_component(document):
    error = document["components"]["schemas"]["Error"]
    assert error["properties"]["error"] == {"$ref": "#/components/schemas/ErrorDetail"}
    assert "HTTPValidationError" not in document["components"]["schemas"]  # FastAPI's shape: not answered
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, answer in operation["responses"].items():
                if status.startswith("4"):
                    assert answer["content"]["application/json"]["schema"] == \
                        {"$ref": "#/components/schemas/Error"}, f"{method.upper()} {path} {status}"


def test_an_error_answer_matches_the_error_component(document, client):
    validator = _validator(document, "Error")
    for response in (client.get("/v1/jobs/x", params={"wait": -1}), client.post("/v1/jobs", json={}),
                     client.get("/no/such/route"), client.put("/v1/jobs/x")):
        assert response.status_code in (404, 405, 422)
        validator.validate(response.json())


def test_wait_is_declared_with_minimum_0_and_a_negative_wait_is_refused(document, client):
    wait = next(p for p in _operation(document, "get", "/v1/jobs/{job_id}")["parameters"] if p["name"] == "wait")
    assert wait["in"] == "query" and wait["schema"]["minimum"] == 0
    refused = client.get("/v1/jobs/some-job", params={"wait": -1})
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "wait"


def test_metrics_are_documented_and_served_as_prometheus_text(document, client):
    content = _operation(document, "get", "/metrics")["responses"]["200"]["content"]
    assert list(content) == ["text/plain; version=0.0.4; charset=utf-8"]
    served = client.get("/metrics")
    assert served.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE" in served.text


def test_options_lists_every_method_the_path_serves(document, client):
    for path in ("/v1/jobs/some-job", "/v1/jobs", "/healthz"):
        templated = "/v1/jobs/{job_id}" if path.startswith("/v1/jobs/") else path
        documented = {method.upper() for method in document["paths"][templated]}
        answer = client.options(path)
        assert answer.status_code == 204
        allowed = {m.strip() for m in answer.headers["allow"].split(",")}
        assert allowed - {"HEAD"} == documented | {"OPTIONS"}, path
    assert "DELETE" in client.options("/v1/jobs/some-job").headers["allow"]
    # An unserved method: 405, with the same full Allow (Starlette named only the
    # first matching route's methods, so DELETE was missing).
    refused = client.put("/v1/jobs/some-job")
    assert refused.status_code == 405
    assert refused.headers["allow"] == client.options("/v1/jobs/some-job").headers["allow"]


def test_submit_request_states_exactly_one_of_prompt_and_prompt_tokens(document, client):
    validator = _validator(document, "SubmitRequest")
    assert validator.is_valid({"prompt": "hi"}) and validator.is_valid({"prompt_tokens": [1]})
    assert validator.is_valid({"prompt": "hi", "prompt_tokens": None})
    for both_or_neither in ({}, {"prompt": "hi", "prompt_tokens": [1]}, {"prompt": None, "prompt_tokens": None}):
        assert not validator.is_valid(both_or_neither), both_or_neither
        # ... and the server refuses exactly those (before anything is queued).
        refused = client.post("/v1/jobs", json=both_or_neither, headers={"X-Tenant-ID": "acme"})
        assert refused.status_code == 422 and "exactly one" in refused.json()["error"]["message"]


def _validator(document: dict[str, Any], component: str) -> jsonschema.Draft202012Validator:
    # The component with the rest of the document beside it, so its $refs resolve.
    schema = {**document["components"]["schemas"][component], "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


# --- the fuzz run, against a real fleet ---


def test_fuzz_every_operation_against_a_live_fleet(make_fleet):
    fleet = make_fleet(workers=1)  # the OpenAI routes answer once the job ran
    schema = schemathesis.openapi.from_url(f"{fleet.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/jobs", "GET /v1/jobs/{job_id}", "DELETE /v1/jobs/{job_id}", "GET /metrics"} <= \
        {op.label for op in operations}
    # A job that exists, so the `{job_id}` routes answer it too, not only 404s.
    known = fleet.submit(tenant=TENANT)
    failures: dict[str, str] = {}
    negated = set()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, fleet.url, known)
                if mode is GenerationMode.NEGATIVE:
                    negated.add(operation.label)
            except Unsatisfiable:
                # Nothing in the operation can be made invalid (no body, no constrained
                # parameter): there is no negative case to send.
                if mode is GenerationMode.POSITIVE:
                    failures[f"{operation.label} (positive)"] = "no request could be generated"
            except (Exception, BaseExceptionGroup) as exc:  # every operation runs, all failures are reported
                # (schemathesis' FailureGroup is a BaseExceptionGroup)
                failures[f"{operation.label} ({mode.value})"] = f"{type(exc).__name__}: {exc}"
    fleet.assert_alive()
    assert not failures, "\n\n".join(f"{label}:\n{failure}" for label, failure in failures.items())
    # Invalid requests were sent wherever a body or a constrained parameter allows them.
    with_body = {op.label for op in operations if "requestBody" in op.definition.raw}
    assert with_body | {"GET /v1/jobs/{job_id}"} <= negated, negated


def _fuzz(operation, mode: GenerationMode, base_url: str, known_job: str) -> None:
    strategy = operation.as_strategy(generation_mode=mode)
    if "{job_id}" in operation.path and not _streams(operation):
        strategy = strategy | operation.as_strategy(generation_mode=mode, path_parameters={"job_id": known_job})
    checks = CHECKS + [negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    @FUZZ_SETTINGS
    @given(case=strategy)
    def run(case) -> None:
        case.call_and_validate(base_url=base_url, checks=checks, headers={"X-Tenant-ID": TENANT},
                               timeout=CALL_TIMEOUT_S)

    run()


def _streams(operation) -> bool:
    # An event stream of a job answers until the job ends: with the known (finished)
    # job it would answer at once, but a stream is no place to test JSON answers.
    return any("text/event-stream" in (answer.get("content") or {})
               for answer in operation.definition.raw.get("responses", {}).values())
