"""The HTTP status behind a driver's exception: what the default classifier
(:func:`~torch_deltasync.store._retry.classify_error`) and the Hugging Face one (``_hf``) decide by."""

from __future__ import annotations


def http_status(e: BaseException) -> int | None:
    """The HTTP status behind an exception, if any (botocore ``ClientError``, httpx/requests errors)."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):  # botocore: {"ResponseMetadata": {"HTTPStatusCode": 503}, "Error": {...}}
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    status = getattr(resp, "status_code", None)
    return status if isinstance(status, int) else None
