"""A clinic's side of nudge, in Python: sign a request to the intake (scheme v2) and verify the
delivery events nudge-events pushes (Standard Webhooks, with the `standardwebhooks` package).

    python nudge_client.py post --url http://127.0.0.1:8080 --tenant clinic-a \
        --secret nsk_... --body reminder.json
    python nudge_client.py receive --port 9000 --secret whsec_... [--record events.jsonl]

`post` sends one reminder (the body a JSON file) and prints the intake's answer; it exits 0 on
a 2xx. `receive` serves the endpoint set with `nudgectl tenant webhook set`: each POST is
verified (signature and timestamp) before anything is read, answered 204 when it verifies and
401 when it does not, and each verified event is printed as a JSON line (or appended to
--record). Deduplicate by each event's `id`: delivery is at least once.
"""

import argparse
import hashlib
import hmac
import json
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


def intake_signature(secret: str, method: str, path: str, body: bytes, now: int) -> str:
    """`Nudge-Signature`: HMAC-SHA256 under the tenant's secret of
    "<t>\\n<METHOD>\\n<path with query>\\n<body>", hex."""
    message = f"{now}\n{method}\n{path}\n".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return f"t={now},v2={digest}"


def post(args: argparse.Namespace) -> int:
    with open(args.body, "rb") as f:
        body = f.read()
    url = f"{args.url.rstrip('/')}/v1/tenants/{args.tenant}/reminders"
    path = urlsplit(url).path
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("content-type", "application/json")
    request.add_header(
        "nudge-signature", intake_signature(args.secret, "POST", path, body, int(time.time()))
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            print(answer.status, answer.read().decode())
            return 0
    except urllib.error.HTTPError as refused:
        print(refused.code, refused.read().decode(), file=sys.stderr)
        return 1


def receive(args: argparse.Namespace) -> int:
    webhook = Webhook(args.secret)
    record = open(args.record, "a", buffering=1) if args.record else sys.stdout

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            body = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                webhook.verify(body, headers)
            except WebhookVerificationError as refused:
                print(f"refused {headers.get('webhook-id')}: {refused}", file=sys.stderr)
                self.send_response(401)
                self.end_headers()
                return
            batch = json.loads(body)
            for event in batch["data"]["events"]:
                record.write(json.dumps({"webhook_id": headers["webhook-id"], **event}) + "\n")
            self.send_response(204)
            self.end_headers()

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Endpoint)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("post", help="sign and send one reminder to the intake")
    p.add_argument("--url", required=True, help="the intake's base URL")
    p.add_argument("--tenant", required=True)
    p.add_argument("--secret", required=True, help="the tenant's signing secret (nsk_...)")
    p.add_argument("--body", required=True, help="a JSON file: one reminder")
    r = commands.add_parser("receive", help="serve the events endpoint, verifying each request")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--secret", required=True, help="the webhook's secret (whsec_...)")
    r.add_argument("--record", help="append each verified event here as a JSON line")
    args = parser.parse_args()
    return post(args) if args.command == "post" else receive(args)


if __name__ == "__main__":
    sys.exit(main())
