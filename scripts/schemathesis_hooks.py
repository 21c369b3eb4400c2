"""Schemathesis hooks for nudge-intake: every request is signed as a client would sign it.

The body is serialised here, once, to the exact bytes that are sent, and `Nudge-Signature` is
computed over them (HMAC-SHA256 of "<t>.<body>" under the tenant's secret). Requests go to the
tenant the script created (NUDGE_ST_TENANT) so that they reach the handlers instead of all being
refused; the secret is NUDGE_ST_SECRET. Read by scripts/schemathesis.sh.
"""

import hashlib
import hmac
import json
import os
import time

import schemathesis

SECRET = os.environ["NUDGE_ST_SECRET"].encode()
TENANT = os.environ["NUDGE_ST_TENANT"]


def _body_bytes(case, kwargs):
    """The bytes the request will carry, forced into `kwargs` so nothing re-serialises them."""
    serialized = case.operation.schema.transport.serialize_case(case)
    if "json" in serialized and serialized["json"] is not None:
        body = json.dumps(serialized["json"], separators=(",", ":")).encode()
    elif serialized.get("data") is not None:
        data = serialized["data"]
        if isinstance(data, str):
            body = data.encode()
        elif isinstance(data, (bytes, bytearray)):
            body = bytes(data)
        else:
            # Form-like data: let requests encode it the way it will be sent.
            import requests

            body = requests.Request("POST", "http://x", data=data).prepare().body or b""
            if isinstance(body, str):
                body = body.encode()
    else:
        body = b""
    if body:
        kwargs["data"] = body
        kwargs.pop("json", None)
    return body


@schemathesis.hook
def before_call(ctx, case, kwargs):
    if case.path_parameters is not None and "tenant" in case.path_parameters:
        case.path_parameters["tenant"] = TENANT
    body = _body_bytes(case, kwargs)
    t = str(int(time.time()))
    mac = hmac.new(SECRET, t.encode() + b"." + body, hashlib.sha256).hexdigest()
    if case.headers is None:
        case.headers = {}
    case.headers["Nudge-Signature"] = f"t={t},v1={mac}"
