"""A real S3-protocol server (moto) on 127.0.0.1 for tests and benchmarks; never a remote endpoint.

Usage::

    with s3_server() as endpoint:        # "http://127.0.0.1:<port>"
        make_bucket(endpoint, "runs")
        store = open_store("s3://runs/x", endpoint_url=endpoint)

The server runs on a thread of this process (``moto.server.ThreadedMotoServer``), bound to
loopback on a free port. Credentials are dummies set in the environment for the duration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Iterator

#: Environment a client of the test server needs (also passed to writer subprocesses).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def s3_env(extra: dict[str, str] | None = None) -> Iterator[None]:
    """Set :data:`S3_ENV` (and ``extra``) in ``os.environ``, restoring the old values after."""
    values = {**S3_ENV, **(extra or {})}
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start moto's S3 server on ``127.0.0.1:<free port>``; yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with s3_env():
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            assert host == "127.0.0.1", host
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def make_bucket(endpoint: str, name: str | None = None) -> str:
    """Create a bucket on the test server (a fresh random name by default); returns its name."""
    import boto3

    name = name or f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=name)
    return name
