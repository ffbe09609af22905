"""The Python client: submit a job, then get or wait for its result.

    client = Client("http://127.0.0.1:8000", tenant="acme")
    job_id = client.submit("Once upon a time", priority="high", max_new_tokens=32)
    result = client.wait(job_id, timeout=60)
    print(result.status, result.text)

A refusal raises `ClientError` with the HTTP status and, for 429 / 503, `retry_after`
(seconds) from the `Retry-After` header.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import httpx
import msgspec

from kvfleet.contracts import JobResult, Sampling, SubmitRequest, decode_result


class ClientError(RuntimeError):
    """The API refused the request; `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str, retry_after: Optional[float] = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after


class Client:
    def __init__(self, base_url: str, *, tenant: Optional[str] = None, api_key: Optional[str] = None,
                 timeout_s: float = 30.0) -> None:
        headers = {}
        if tenant:
            headers["X-Tenant-ID"] = tenant
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def submit(self, prompt: Optional[str] = None, *, prompt_tokens: Optional[list[int]] = None,
               priority: str = "normal", max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None, stop: Optional[list[str]] = None,
               job_id: Optional[str] = None, timeout_s: Optional[float] = None) -> str:
        """Queue a job; returns its id. Pass your own `job_id` to make retries idempotent."""
        body = SubmitRequest(
            prompt=prompt, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, job_id=job_id,
            sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop or []),
            timeout_s=timeout_s,
        )
        response = self._http.post("/v1/jobs", content=msgspec.json.encode(body),
                                   headers={"Content-Type": "application/json", "X-Priority": priority})
        return self._json(response)["job_id"]

    def get(self, job_id: str, *, wait: float = 0.0) -> JobResult:
        response = self._http.get(f"/v1/jobs/{job_id}", params={"wait": wait} if wait else None,
                                  timeout=wait + 30.0)
        self._check(response)
        return decode_result(response.content)

    def cancel(self, job_id: str) -> JobResult:
        """Cancel a job that has not ended; its result says `cancelled`. A job that
        already ended raises ClientError 409."""
        response = self._http.delete(f"/v1/jobs/{job_id}")
        self._check(response)
        return decode_result(response.content)

    def wait(self, job_id: str, timeout: float = 300.0) -> JobResult:
        """Long-poll until the job is terminal or `timeout` seconds pass (then its current state)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            result = self.get(job_id, wait=max(0.0, min(remaining, 30.0)))
            if result.status.terminal or remaining <= 0:
                return result

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _json(self, response: httpx.Response) -> dict:
        self._check(response)
        return response.json()

    @staticmethod
    def _check(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            error = response.json().get("error", response.text)
            message = error.get("message", response.text) if isinstance(error, dict) else error
        except ValueError:
            message = response.text
        retry = response.headers.get("Retry-After")
        raise ClientError(response.status_code, message, float(retry) if retry else None)
