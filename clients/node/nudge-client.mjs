// A clinic's side of nudge, in Node: sign a request to the intake (scheme v2) and verify the
// delivery events nudge-events pushes (Standard Webhooks, with the `standardwebhooks` package).
//
//   node nudge-client.mjs post --url http://127.0.0.1:8080 --tenant clinic-a \
//       --secret nsk_... --body reminder.json
//   node nudge-client.mjs receive --port 9000 --secret whsec_... [--record events.jsonl]
//
// `post` sends one reminder (the body a JSON file) and prints the intake's answer; it exits 0
// on a 2xx. `receive` serves the endpoint set with `nudgectl tenant webhook set`: each POST is
// verified (signature and timestamp) before anything is read, answered 204 when it verifies
// and 401 when it does not, and each verified event is printed as a JSON line (or appended to
// --record). Deduplicate by each event's `id`: delivery is at least once.
import { createHmac } from "node:crypto";
import { appendFileSync, readFileSync } from "node:fs";
import { createServer } from "node:http";
import { parseArgs } from "node:util";
import { Webhook, WebhookVerificationError } from "standardwebhooks";

// `Nudge-Signature`: HMAC-SHA256 under the tenant's secret of
// "<t>\n<METHOD>\n<path with query>\n<body>", hex.
export function intakeSignature(secret, method, path, body, now) {
  const mac = createHmac("sha256", secret);
  mac.update(`${now}\n${method}\n${path}\n`);
  mac.update(body);
  return `t=${now},v2=${mac.digest("hex")}`;
}

async function post({ url, tenant, secret, body }) {
  const payload = readFileSync(body);
  const target = new URL(`${url.replace(/\/$/, "")}/v1/tenants/${tenant}/reminders`);
  const now = Math.floor(Date.now() / 1000);
  const answer = await fetch(target, {
    method: "POST",
    headers: {
      "content-type": "application/json",
      "nudge-signature": intakeSignature(secret, "POST", target.pathname, payload, now),
    },
    body: payload,
  });
  const text = await answer.text();
  (answer.ok ? console.log : console.error)(answer.status, text);
  return answer.ok ? 0 : 1;
}

function receive({ port, secret, record }) {
  const webhook = new Webhook(secret);
  const write = (line) => (record ? appendFileSync(record, line + "\n") : console.log(line));
  const server = createServer((request, response) => {
    const chunks = [];
    request.on("data", (chunk) => chunks.push(chunk));
    request.on("end", () => {
      const body = Buffer.concat(chunks).toString("utf8");
      let batch;
      try {
        batch = webhook.verify(body, request.headers);
      } catch (refused) {
        if (!(refused instanceof WebhookVerificationError)) throw refused;
        console.error(`refused ${request.headers["webhook-id"]}: ${refused.message}`);
        response.writeHead(401).end();
        return;
      }
      for (const event of batch.data.events) {
        write(JSON.stringify({ webhook_id: request.headers["webhook-id"], ...event }));
      }
      response.writeHead(204).end();
    });
  });
  server.listen(Number(port), "127.0.0.1", () => {
    console.error(`listening on http://127.0.0.1:${server.address().port}`);
  });
}

const [command, ...rest] = process.argv.slice(2);
const { values } = parseArgs({
  args: rest,
  options: {
    url: { type: "string" },
    tenant: { type: "string" },
    secret: { type: "string" },
    body: { type: "string" },
    port: { type: "string" },
    record: { type: "string" },
  },
});
const need = (names) => {
  for (const name of names) {
    if (!values[name]) {
      console.error(`${command}: --${name} is required`);
      process.exit(2);
    }
  }
};
if (command === "post") {
  need(["url", "tenant", "secret", "body"]);
  process.exit(await post(values));
} else if (command === "receive") {
  need(["port", "secret"]);
  receive(values);
} else {
  console.error("usage: node nudge-client.mjs post|receive ... (see the comment at the top)");
  process.exit(2);
}
