#!/usr/bin/env python3
"""Starts every nudge process of a Kubernetes rendering as its pod would: its command, its
environment (the Secret's keys replaced by local values), the ConfigMap's nudge.toml, against
the PostgreSQL and RabbitMQ of scripts/services.sh. The migrate Job must exit 0; every
Deployment's process must start, still run 3 s later, answer its probes' paths on the ports
the manifest names (mapped to free local ports), answer HTTP (any status below 500) at `/` on
each port a Service sends to, and exit 0 on SIGTERM within its terminationGracePeriodSeconds.

The run's own database (dropped afterwards) and RabbitMQ names under the namespace
`k8s-smoke-<pid>.` (deleted afterwards) keep it apart from everything else on the services.
Needs the binaries built (NUDGE_BIN_DIR, default target/debug), psql, and PyYAML (the
validation's virtualenv has it: scripts/validate-k8s.sh).

--probes report: print each probe's answer without failing on it (for binaries that do not
serve their admin endpoints yet); --probes require (the default) fails on any probe that
does not answer 200.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k8s_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PG = "postgres://postgres@127.0.0.1:5432"
AMQP = "amqp://guest:guest@127.0.0.1:5672/%2f"
# Public test keys (32 bytes each), standing in for the Secret's.
LOCAL_SECRETS = {
    "destination-key": "vRdeBeF1KMBq4P78kL4MbxId31ISqKCBf5M1IV5/9Ow=",
    "subscriber-key": "3q2+7wABAgMEBQYHCAkKCwwNDg8QERITFBUWFxgZGhs=",
    "tenant-secret-key": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
    "console-session-key": "ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=",
    "amqp-url": AMQP,
}
# Each binary's Secret key names its database role (PostgreSQL here trusts loopback, so the
# role needs no password): the smoke runs every binary as the role the manifests give it.
ROLE_OF_URL = {
    "console-database-url": "nudge_console",
    "events-database-url": "nudge_events",
    "intake-database-url": "nudge_intake",
    "janitor-database-url": "nudge_janitor",
    "producer-database-url": "nudge_producer",
    "worker-database-url": "nudge_worker",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-qc", sql],
                   check=True, env={**os.environ, "PGOPTIONS": "--client-min-messages=warning"})


def secret_value(key: str, database: str) -> str:
    if key in LOCAL_SECRETS:
        return LOCAL_SECRETS[key]
    if key in ROLE_OF_URL:
        return f"postgres://{ROLE_OF_URL[key]}@127.0.0.1:5432/{database}"
    if key.endswith("database-url"):
        return f"{PG}/{database}"
    if key.endswith("-token"):
        return f"smoke-{key}"
    raise SystemExit(f"k8s_smoke.py: no local value for Secret key {key}")


def probe(port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as answer:
            return str(answer.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError as e:
        return type(e).__name__


def delete_broker_names(namespace: str) -> None:
    out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True,
                         text=True, timeout=60).stdout.split()
    for queue in (q for q in out if q.startswith(namespace)):
        subprocess.run(["rabbitmqctl", "-q", "delete_queue", queue], capture_output=True, timeout=60)
    try:
        import pika  # the exchanges; rabbitmqctl cannot delete them
    except ImportError:
        print(f"k8s_smoke.py: exchanges {namespace}nudge.work and .dead left (pika not installed)")
        return
    connection = pika.BlockingConnection(pika.URLParameters(AMQP))
    channel = connection.channel()
    for name in ("nudge.work", "nudge.dead"):
        channel.exchange_delete(namespace + name)
    connection.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kustomization", type=Path)
    ap.add_argument("--probes", choices=["require", "report"], default="require")
    args = ap.parse_args()
    bin_dir = Path(os.environ.get("NUDGE_BIN_DIR", ROOT / "target/debug"))
    resources = k8s_check.render(args.kustomization)
    config_map = next(r for r in resources if r["kind"] == "ConfigMap")
    work = Path(tempfile.mkdtemp(prefix="nudge-k8s-smoke."))
    (work / "nudge.toml").write_text(config_map["data"]["nudge.toml"])
    database = f"nudge_k8s_smoke_{os.getpid()}"
    namespace = f"k8s-smoke-{os.getpid()}."
    psql(f"CREATE DATABASE {database}")
    failures: list[str] = []
    try:
        jobs = [r for r in resources if r["kind"] == "Job"]
        deployments = [r for r in resources if r["kind"] == "Deployment"]
        services = [r for r in resources if r["kind"] == "Service"]
        for r in jobs + deployments:
            name = r["metadata"]["name"]
            spec = r["spec"]["template"]["spec"]
            container = spec["containers"][0]
            ports = {p.get("name"): free_port() for p in container.get("ports", [])}
            env = {"PATH": os.environ["PATH"], "NUDGE_AMQP__NAMESPACE": namespace,
                   # The pod's own network namespace is this machine's loopback here.
                   "NUDGE_TELEMETRY__METRICS_ADDR": f"127.0.0.1:{ports.get('admin', free_port())}"}
            # A binary with a port of its own listens on the one mapped for `http`.
            for command, (section, _) in k8s_check.LISTENERS.items():
                port = ports.get("http") if container["command"][0] == command else None
                env[f"NUDGE_{section.upper()}__LISTEN_ADDR"] = f"127.0.0.1:{port or free_port()}"
            for e in container.get("env", []):
                if e["name"] == "NUDGE_CONFIG":
                    env[e["name"]] = str(work / "nudge.toml")
                elif "value" in e:
                    env[e["name"]] = e["value"]
                else:
                    env[e["name"]] = secret_value(e["valueFrom"]["secretKeyRef"]["key"], database)
            command = [str(bin_dir / container["command"][0])] + container["command"][1:]
            log_path = work / f"{name}.log"
            with log_path.open("w") as log:
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            if r["kind"] == "Job":
                code = process.wait(timeout=120)
                print(f"{name}: exit {code}")
                if code != 0:
                    failures.append(f"{name} exited {code} (log {log_path})")
                continue
            deadline = time.time() + 60
            while time.time() < deadline and process.poll() is None:
                if '"message":"started"' in log_path.read_text():
                    break
                time.sleep(0.2)
            time.sleep(3)
            running = process.poll() is None
            answers = []
            for kind in ("livenessProbe", "readinessProbe"):
                get = container.get(kind, {}).get("httpGet")
                if get:
                    answer = probe(ports[get["port"]], get["path"])
                    answers.append(f"{get['path']} on {get['port']}: {answer}")
                    if answer != "200" and args.probes == "require":
                        failures.append(f"{name}: {kind} {get['path']} on port {get['port']} "
                                        f"answered {answer}")
            # What a Service sends to must answer HTTP (a page, a redirect to the login, a 404 of
            # a path it does not serve): proof that the process listens where the Service points.
            for service in services:
                selector = service["spec"].get("selector", {})
                labels = r["spec"]["template"]["metadata"].get("labels", {})
                if not selector or selector.items() - labels.items():
                    continue
                for sp in service["spec"].get("ports", []):
                    target = sp.get("targetPort", sp["port"])
                    if target not in ports:
                        failures.append(f"{name}: Service {service['metadata']['name']} targets "
                                        f"port {target}, which the container does not name")
                        continue
                    answer = probe(ports[target], "/")
                    answers.append(f"Service {service['metadata']['name']} / on {target}: {answer}")
                    if not (answer.isdigit() and int(answer) < 500) and args.probes == "require":
                        failures.append(f"{name}: / on port {target} (Service "
                                        f"{service['metadata']['name']}) answered {answer}")
            grace = spec.get("terminationGracePeriodSeconds", 30)
            if running:
                process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
                failures.append(f"{name} did not exit within terminationGracePeriodSeconds {grace}")
            print(f"{name}: {'running' if running else 'NOT RUNNING'} after start; "
                  f"{'; '.join(answers) or 'no probes'}; exit {code} after SIGTERM")
            if not running or code != 0:
                failures.append(f"{name}: running={running}, exit {code} (log {log_path})")
    finally:
        psql(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        delete_broker_names(namespace)
    for f in failures:
        print(f"FAIL {f}")
    if not failures:
        shutil.rmtree(work)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
