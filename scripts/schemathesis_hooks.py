"""Schemathesis hooks for nudge-intake: every request is signed as a client would sign it.

The body is serialised here, once, to the exact bytes that are sent, and `Nudge-Signature` is
computed by a `requests` auth callable on the prepared request, so that what it signs is what
goes on the wire: HMAC-SHA256 of "<t>\\n<METHOD>\\n<path and query>\\n<body>" under the
tenant's secret (scheme v2). Requests go to the tenant the script created (NUDGE_ST_TENANT) so
that they reach the handlers instead of all being refused; the secret is NUDGE_ST_SECRET. Read
by scripts/schemathesis.sh.
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


def sign(request):
    """A `requests` auth: signs the prepared request's method, target and body (v2)."""
    body = request.body or b""
    if isinstance(body, str):
        body = body.encode()
    t = str(int(time.time()))
    message = b"\n".join([t.encode(), request.method.encode(), request.path_url.encode(), body])
    mac = hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    request.headers["Nudge-Signature"] = f"t={t},v2={mac}"
    return request


@schemathesis.hook
def before_call(ctx, case, kwargs):
    if case.path_parameters is not None and "tenant" in case.path_parameters:
        case.path_parameters["tenant"] = TENANT
    _body_bytes(case, kwargs)
    kwargs["auth"] = sign
