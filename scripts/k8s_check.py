#!/usr/bin/env python3
"""Offline checks of nudge's Kubernetes manifests (deploy/k8s), run by scripts/validate-k8s.sh.

For each kustomization given (the base and every overlay):

1. Renders it with the small kustomize subset below (no kubectl needed), and, when a kubectl
   with kustomize is on PATH, renders it with `kubectl kustomize` too and requires the same
   resources: the subset cannot drift from the real tool unnoticed.
2. Validates every resource against the Kubernetes OpenAPI schemas of kubernetes-validate
   (strict: unknown fields are errors), for each Kubernetes version asked for; the KEDA kinds
   (not in those schemas) against deploy/k8s/schemas/keda.schema.json, written from KEDA 2.x's
   CRDs (keda.sh/v1alpha1 ScaledObject and TriggerAuthentication); CloudNativePG's Cluster
   against deploy/k8s/schemas/cnpg-cluster.schema.json, the operator's published CRD schema,
   made strict here (an unknown field is an error, as with the built-in kinds).
3. Checks what no schema knows: the rules of nudge's configuration (see `check_nudge`).

The kustomize subset: `resources` (files and directories), `namespace`, `labels` (pairs,
includeSelectors and includeTemplates false), `images`, `configMapGenerator` (files; behavior
create, replace or merge; the content-hash name suffix as kustomize computes it, and every
reference to the ConfigMap renamed with it) and `patches` (strategic merge, by kind and name,
lists of named items merged by name). Any other field is refused by name.

Exit status: 0 all good, 1 a check failed, 2 a usage or environment error.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
KEDA_SCHEMA = ROOT / "deploy/k8s/schemas/keda.schema.json"
KEDA_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}
CNPG_SCHEMA = ROOT / "deploy/k8s/schemas/cnpg-cluster.schema.json"
CNPG_CLUSTER = ("postgresql.cnpg.io/v1", "Cluster")
# The roles the migrations grant to (docs/database-roles.md): a CloudNativePG cluster must
# create each with LOGIN, or its binary cannot connect.
BINARY_ROLES = {"nudge_producer", "nudge_intake", "nudge_worker", "nudge_janitor",
                "nudge_events", "nudge_console"}
SUPPORTED_FIELDS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "images",
    "configMapGenerator", "patches",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PriorityClass", "StorageClass", "PersistentVolume"}
WORKER_COMMANDS = {"nudge-push": "push", "nudge-email": "email", "nudge-sms": "sms"}
# The binaries that serve on a port of their own (container port `http`): the section whose
# listen_addr it is, and that key's default port.
LISTENERS = {"nudge-intake": ("intake", 8080), "nudge-console": ("console", 8095)}

# PostgreSQL connections the Deployments may open at their most replicas, summed as most
# replicas x pool (NUDGE_DATABASE__MAX_CONNECTIONS, else nudge.toml's database.max_connections):
# PostgreSQL's default max_connections (100), less its superuser_reserved_connections (3), an
# operator's nudgectl or the migrate Job (8: nudgectl opens CHUNKS_IN_FLIGHT + 2, whatever the
# configuration says) and 2 for psql or monitoring. A server with more raises it here.
CONNECTION_BUDGET = 87

# The Secret key of each long-running binary's database URL: its own role
# (docs/database-roles.md). `database-url`, the owner, is for nudgectl migrate only.
DATABASE_URL_KEYS = {
    "nudge-producer": "producer-database-url",
    "nudge-intake": "intake-database-url",
    "nudge-janitor": "janitor-database-url",
    "nudge-events": "events-database-url",
    "nudge-console": "console-database-url",
    "nudge-push": "worker-database-url",
    "nudge-email": "worker-database-url",
    "nudge-sms": "worker-database-url",
}


class CheckFailed(Exception):
    pass


# ---- rendering -----------------------------------------------------------------------------

def load_yaml_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def key_of(res: dict) -> tuple[str, str]:
    return res["kind"], res["metadata"]["name"]


def render(directory: Path) -> list[dict]:
    resources, generated = _render(directory)
    return _finish(resources, generated)


def _render(directory: Path) -> tuple[list[dict], set[str]]:
    """Resources of one kustomization, with generated ConfigMaps still unsuffixed, and the
    names of those ConfigMaps (suffixed once, at the end, as kustomize does)."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise CheckFailed(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = sorted(set(k) - SUPPORTED_FIELDS)
    if unknown:
        raise CheckFailed(f"{kfile}: fields outside the checked subset: {', '.join(unknown)}")
    out: list[dict] = []
    generated: set[str] = set()
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            sub, gen = _render(path)
            out.extend(sub)
            generated |= gen
        else:
            out.extend(load_yaml_docs(path))
    for gen in k.get("configMapGenerator", []):
        behavior = gen.get("behavior", "create")
        extra = sorted(set(gen) - {"name", "files", "behavior"})
        if extra:
            raise CheckFailed(f"{kfile}: configMapGenerator fields outside the subset: {extra}")
        data = {}
        for file in gen.get("files", []):
            key, _, rel = file.partition("=") if "=" in file else (Path(file).name, "", file)
            data[key] = (directory / (rel or file)).read_text()
        name = gen["name"]
        existing = [r for r in out if key_of(r) == ("ConfigMap", name)]
        if behavior == "create":
            if existing:
                raise CheckFailed(f"{kfile}: ConfigMap {name} already exists")
            out.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": name}, "data": data})
            generated.add(name)
        elif behavior in ("replace", "merge"):
            if len(existing) != 1:
                raise CheckFailed(f"{kfile}: ConfigMap {name} to {behavior} not found")
            cm = existing[0]
            cm["data"] = data if behavior == "replace" else {**cm.get("data", {}), **data}
        else:
            raise CheckFailed(f"{kfile}: unknown configMapGenerator behavior {behavior}")
    for patch in k.get("patches", []):
        extra = sorted(set(patch) - {"path"})
        if extra:
            raise CheckFailed(f"{kfile}: patch fields outside the subset: {extra}")
        for p in load_yaml_docs(directory / patch["path"]):
            targets = [r for r in out if key_of(r) == key_of(p)]
            if len(targets) != 1:
                raise CheckFailed(f"{kfile}: patch {patch['path']} matches {len(targets)} resources")
            merged = strategic_merge(targets[0], p)
            out[out.index(targets[0])] = merged
    if "namespace" in k:
        for r in out:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise CheckFailed(f"{kfile}: labels with includeSelectors/includeTemplates are outside the subset")
        for r in out:
            r["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in k.get("images", []):
        for r in out:
            for c in containers_of(r):
                name, tag = split_image(c.get("image", ""))
                if name == image["name"]:
                    c["image"] = image.get("newName", name) + (
                        ":" + str(image["newTag"]) if "newTag" in image else (":" + tag if tag else ""))
    return out, generated


def split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, ""
    return name, tag


def strategic_merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(i, dict) and "name" in i for i in base + patch)):
        out = list(base)
        for item in patch:
            match = [i for i, b in enumerate(out) if b["name"] == item["name"]]
            if match:
                out[match[0]] = strategic_merge(out[match[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def kustomize_hash(cm: dict) -> str:
    # kustomize's hasher: sha256 of Go's json.Marshal of {data, kind, name: ""} (sorted keys,
    # <, > and & escaped), first ten hex digits with 0 1 3 a e replaced to avoid words.
    text = json.dumps({"data": cm.get("data", {}), "kind": "ConfigMap", "name": ""},
                      separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _finish(resources: list[dict], generated: set[str]) -> list[dict]:
    renames = {}
    for r in resources:
        if r["kind"] == "ConfigMap" and r["metadata"]["name"] in generated:
            new = f"{r['metadata']['name']}-{kustomize_hash(r)}"
            renames[r["metadata"]["name"]] = new
            r["metadata"]["name"] = new
    for r in resources:
        spec = pod_spec(r)
        if spec is None:
            continue
        for v in spec.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] in renames:
                v["configMap"]["name"] = renames[v["configMap"]["name"]]
        for c in containers_of(r):
            for e in c.get("envFrom", []):
                if "configMapRef" in e and e["configMapRef"]["name"] in renames:
                    e["configMapRef"]["name"] = renames[e["configMapRef"]["name"]]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["name"] in renames:
                    ref["name"] = renames[ref["name"]]
    return resources


def pod_spec(r: dict) -> dict | None:
    if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return r["spec"]["template"]["spec"]
    if r["kind"] == "CronJob":
        return r["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if r["kind"] == "Pod":
        return r["spec"]
    return None


def containers_of(r: dict) -> list[dict]:
    spec = pod_spec(r)
    if spec is None:
        return []
    return spec.get("initContainers", []) + spec.get("containers", [])


def canonical(resources: list[dict]) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True) for r in resources)


def compare_with_kubectl(directory: Path, ours: list[dict]) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl not found: rendered with the subset only"
    try:
        out = subprocess.run([kubectl, "kustomize", str(directory)], check=True,
                             capture_output=True, text=True, timeout=120).stdout
    except subprocess.CalledProcessError as e:
        raise CheckFailed(f"kubectl kustomize {directory} failed: {e.stderr.strip()}") from e
    theirs = [d for d in yaml.safe_load_all(out) if d]
    a, b = canonical(ours), canonical(theirs)
    if a != b:
        only_ours = [json.loads(x)["metadata"]["name"] for x in a if x not in b]
        only_theirs = [json.loads(x)["metadata"]["name"] for x in b if x not in a]
        raise CheckFailed(f"{directory}: the subset and kubectl kustomize disagree: "
                          f"only here {only_ours}, only in kubectl's {only_theirs}")
    version = subprocess.run([kubectl, "version", "--client"], capture_output=True,
                             text=True, timeout=60).stdout.replace("\n", "; ").strip("; ")
    return f"same {len(theirs)} resources as kubectl kustomize ({version})"


# ---- schemas -------------------------------------------------------------------------------

def validate_schemas(resources: list[dict], versions: list[str], where: str) -> list[str]:
    import jsonschema
    from kubernetes_validate import utils as kv

    keda_schema = json.loads(KEDA_SCHEMA.read_text())
    errors = []
    for r in resources:
        name = f"{where}: {r['kind']}/{r['metadata']['name']}"
        if (r["apiVersion"], r["kind"]) == CNPG_CLUSTER:
            validator = jsonschema.Draft7Validator(cnpg_cluster_schema())
            for e in validator.iter_errors(r):
                errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message} "
                              "(CloudNativePG schema)")
            continue
        if (r["apiVersion"], r["kind"]) in KEDA_KINDS:
            schema = {"$ref": f"#/$defs/{r['kind']}", "$defs": keda_schema["$defs"]}
            validator = jsonschema.Draft202012Validator(schema)
            for e in validator.iter_errors(r):
                errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message} (KEDA schema)")
            continue
        for version in versions:
            try:
                kv.validate(r, version, strict=True)
            except kv.ValidationError as e:
                errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message} "
                              f"(Kubernetes {version}, strict)")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{name}: {e.message}")
    return errors


def strict(schema):
    """A CRD's structural schema made strict: an object that lists its properties refuses any
    other (the API server would prune it silently; a typo must fail here instead), unless the
    schema says to keep unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def cnpg_cluster_schema() -> dict:
    vendored = json.loads(CNPG_SCHEMA.read_text())
    schema = strict(vendored["schema"])
    # metadata is the API server's, not the CRD's: any ObjectMeta.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


# ---- nudge's own rules ---------------------------------------------------------------------

def known_sections() -> list[str]:
    text = (ROOT / "crates/config/src/load.rs").read_text()
    block = re.search(r"pub const KNOWN_SECTIONS: &\[&str\] = &\[(.*?)\];", text, re.S)
    if not block:
        raise CheckFailed("KNOWN_SECTIONS not found in crates/config/src/load.rs")
    return re.findall(r'"([a-z_]+)"', block.group(1))


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def check_nudge(resources: list[dict], where: str) -> tuple[list[str], list[str]]:
    """Returns (errors, notes)."""
    errors: list[str] = []
    notes: list[str] = []
    err = errors.append
    by_kind: dict[str, list[dict]] = {}
    for r in resources:
        by_kind.setdefault(r["kind"], []).append(r)
    config_maps = {r["metadata"]["name"]: r for r in by_kind.get("ConfigMap", [])}
    secrets = {r["metadata"]["name"]: r for r in by_kind.get("Secret", [])}
    sections = known_sections()
    env_name = re.compile(r"^NUDGE_(%s)__[A-Z0-9_]+$" % "|".join(s.upper() for s in sections))

    # The configuration every pod mounts.
    configs = {}
    for name, cm in config_maps.items():
        if "nudge.toml" in cm.get("data", {}):
            try:
                configs[name] = tomllib.loads(cm["data"]["nudge.toml"])
            except tomllib.TOMLDecodeError as e:
                err(f"{where}: ConfigMap {name}: nudge.toml: {e}")
    if len(configs) != 1:
        err(f"{where}: expected one ConfigMap with nudge.toml, found {len(configs)}")
        return errors, notes
    (config_name, config), = configs.items()
    for section in config:
        if section not in sections:
            err(f"{where}: nudge.toml: [{section}] is not a nudge section")
    for section, key in (("database", "url"), ("amqp", "url"), ("crypto", "destination_key"),
                         ("crypto", "subscriber_key"), ("console", "session_key")):
        if key in config.get(section, {}):
            err(f"{where}: nudge.toml sets {section}.{key}: a secret, it belongs in the Secret")
    for i, p in enumerate(config.get("providers", [])):
        if "auth_token" in p:
            err(f"{where}: nudge.toml sets providers.{i}.auth_token: a secret")
    tel = config.get("telemetry", {})
    admin_port = port_of(tel["metrics_addr"]) if "metrics_addr" in tel else None
    listen_ports = {command: port_of(config.get(section, {}).get("listen_addr", f"0.0.0.0:{port}"))
                    for command, (section, port) in LISTENERS.items()}
    if config.get("console", {}).get("secure_cookies", True) is not True:
        err(f"{where}: nudge.toml sets console.secure_cookies to false: the session cookie would "
            "travel over plain http; serve the console through TLS instead")
    prefetch = config.get("amqp", {}).get("prefetch", 128)
    namespace = config.get("amqp", {}).get("namespace", "")
    grace_ms = config.get("worker", {}).get("shutdown_grace_ms", 20000)
    statement_ms = config.get("database", {}).get("statement_timeout_ms", 30000)
    request_ms = config.get("events", {}).get("request_timeout_ms", 10000)
    prod = config.get("producer", {})
    in_flight_s = prod.get("in_flight_seconds", 1.0)
    min_w = prod.get("min_in_flight_per_channel", 20)
    max_w = prod.get("max_in_flight_per_channel", 2000)

    pdbs = by_kind.get("PodDisruptionBudget", [])
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in by_kind.get("ScaledObject", [])}
    auths = {t["metadata"]["name"]: t for t in by_kind.get("TriggerAuthentication", [])}
    max_connections = 0
    connections: list[str] = []

    for r in resources:
        spec = pod_spec(r)
        if spec is None:
            continue
        name = f"{where}: {r['kind']}/{r['metadata']['name']}"
        if spec.get("enableServiceLinks") is not False:
            err(f"{name}: enableServiceLinks must be false (service variables such as "
                "NUDGE_INTAKE_SERVICE_HOST would stop nudge at start-up)")
        for v in spec.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in config_maps:
                err(f"{name}: volume {v['name']} names a ConfigMap not in the rendering")
        for c in containers_of(r):
            cname = f"{name} container {c['name']}"
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for what in ("cpu", "memory"):
                    if what not in res.get(kind, {}):
                        err(f"{cname}: no {kind}.{what}")
            command = (c.get("command") or [""])[0]
            envs = {e["name"]: e for e in c.get("env", [])}
            for e in c.get("envFrom", []):
                err(f"{cname}: envFrom: name every NUDGE_ variable (a whole Secret would hand "
                    "a process keys it must not have)")
            for ename, e in envs.items():
                if ename.startswith("NUDGE_") and ename != "NUDGE_CONFIG" and not env_name.match(ename):
                    err(f"{cname}: {ename} is not NUDGE_<SECTION>__<KEY>: nudge would refuse to start")
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] in secrets:
                    s = secrets[ref["name"]]
                    keys = set(s.get("data", {})) | set(s.get("stringData", {}))
                    if ref["key"] not in keys:
                        err(f"{cname}: {ename} names key {ref['key']}, not in Secret {ref['name']}")
            for ename, e in envs.items():
                ref = e.get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("key") == "console-session-key" and command != "nudge-console":
                    err(f"{cname}: {ename} from Secret key console-session-key: only "
                        "nudge-console signs sessions")
            if command == "nudge-console":
                # It holds no key that opens a destination or content, and has no broker.
                for ename in envs:
                    if ename.startswith(("NUDGE_CRYPTO__", "NUDGE_AMQP__")):
                        err(f"{cname}: the console must not have {ename} (it opens nothing "
                            "sealed and has no broker connection)")
                if "NUDGE_CONSOLE__SESSION_KEY" not in envs:
                    err(f"{cname}: no NUDGE_CONSOLE__SESSION_KEY: the console refuses to start "
                        "without console.session_key")
                secure = envs.get("NUDGE_CONSOLE__SECURE_COOKIES", {}).get("value")
                if secure is not None and secure.strip().lower() != "true":
                    err(f"{cname}: NUDGE_CONSOLE__SECURE_COOKIES {secure}: the session cookie "
                        "would travel over plain http; serve the console through TLS instead")
            if envs.get("NUDGE_CONFIG", {}).get("value") != "/etc/nudge/nudge.toml":
                err(f"{cname}: NUDGE_CONFIG must be /etc/nudge/nudge.toml")
            if command in WORKER_COMMANDS and "NUDGE_CRYPTO__SUBSCRIBER_KEY" in envs:
                err(f"{cname}: workers must not have the subscriber key")
            if command in WORKER_COMMANDS and "NUDGE_CRYPTO__TENANT_SECRET_KEY" in envs:
                err(f"{cname}: workers must not have the tenant secret key")
            url_key = envs.get("NUDGE_DATABASE__URL", {}).get("valueFrom", {}).get(
                "secretKeyRef", {}).get("key")
            if command in DATABASE_URL_KEYS and url_key != DATABASE_URL_KEYS[command]:
                err(f"{cname}: NUDGE_DATABASE__URL from Secret key {url_key}, expected "
                    f"{DATABASE_URL_KEYS[command]} (the binary's own role, docs/database-roles.md)")
            if "NUDGE_CRYPTO__SUBSCRIBER_KEY" in envs and "NUDGE_CRYPTO__DESTINATION_KEY" not in envs:
                err(f"{cname}: the subscriber key without the destination key: nudge refuses "
                    "to start with one and not the other")
            # A provider's token by its entry's index: the entry must exist, belong to this
            # worker's channel (no process holds another channel's tokens), and the Secret's key
            # be named after the account, so that a reordered nudge.toml is caught here.
            providers = config.get("providers", [])
            for ename, e in envs.items():
                m = re.match(r"^NUDGE_PROVIDERS__([0-9]+)__AUTH_TOKEN$", ename)
                if not m:
                    continue
                i = int(m.group(1))
                if i >= len(providers):
                    err(f"{cname}: {ename}: nudge.toml has {len(providers)} providers")
                    continue
                account, channel = providers[i].get("account"), providers[i].get("channel")
                if WORKER_COMMANDS.get(command) != channel:
                    err(f"{cname}: {ename} is the token of {account} ({channel}), not of this "
                        "worker's channel")
                ref = e.get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("key") != f"{account}-token":
                    err(f"{cname}: {ename} should come from Secret key {account}-token "
                        f"(providers[{i}] is {account}), not {ref.get('key')}")
            if r["kind"] != "Deployment":
                continue
            # Probes: /healthz for liveness, /readyz for readiness, on a declared port that is
            # the one the configuration listens on.
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                p = c.get(probe, {}).get("httpGet")
                if not p:
                    err(f"{cname}: no {probe} over HTTP")
                    continue
                if p.get("path") != path:
                    err(f"{cname}: {probe} path {p.get('path')}, expected {path}")
                port = ports.get(p["port"], p["port"])
                if p["port"] == "admin" and port != admin_port:
                    err(f"{cname}: {probe} on admin port {port}, but telemetry.metrics_addr "
                        f"listens on {admin_port}")
                if p["port"] == "http" and port != listen_ports.get(command):
                    err(f"{cname}: {probe} on http port {port}, but {command} listens on "
                        f"{listen_ports.get(command)}")
                if p["port"] not in ("admin", "http"):
                    err(f"{cname}: {probe} port must be the named port admin or http")
            if "admin" in ports and ports["admin"] != admin_port:
                err(f"{cname}: admin port {ports['admin']} is not telemetry.metrics_addr's {admin_port}")
            if "http" in ports and command in LISTENERS and ports["http"] != listen_ports[command]:
                err(f"{cname}: http port {ports['http']} is not "
                    f"{LISTENERS[command][0]}.listen_addr's {listen_ports[command]}")
            if "http" in ports and command not in LISTENERS:
                err(f"{cname}: an http port, but {command} serves nothing but the admin port")
            grace = spec.get("terminationGracePeriodSeconds", 30)
            if command in WORKER_COMMANDS and grace * 1000 <= grace_ms:
                err(f"{cname}: terminationGracePeriodSeconds {grace} s is not longer than "
                    f"worker.shutdown_grace_ms {grace_ms} ms")
            if command == "nudge-intake":
                pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                pre_s = int(pre[1]) if pre[:1] == ["sleep"] else 0
                if grace <= pre_s + 10:
                    err(f"{cname}: terminationGracePeriodSeconds {grace} s is not longer than "
                        f"the preStop ({pre_s} s) and the intake's 10 s for requests in progress")
            if command == "nudge-janitor" and grace * 1000 <= statement_ms:
                err(f"{cname}: terminationGracePeriodSeconds {grace} s is not longer than "
                    f"database.statement_timeout_ms {statement_ms} ms")
            if command == "nudge-events" and grace * 1000 <= request_ms:
                err(f"{cname}: terminationGracePeriodSeconds {grace} s is not longer than "
                    f"events.request_timeout_ms {request_ms} ms (a SIGTERM lets the requests "
                    "in flight finish)")
            replicas = r["spec"].get("replicas", 1)
            if command in WORKER_COMMANDS and r["metadata"]["name"] in scaled:
                replicas = scaled[r["metadata"]["name"]]["spec"].get("maxReplicaCount", 100)
            pool = config.get("database", {}).get("max_connections", 10)
            if "NUDGE_DATABASE__MAX_CONNECTIONS" in envs:
                try:
                    pool = int(envs["NUDGE_DATABASE__MAX_CONNECTIONS"].get("value", ""))
                except ValueError:
                    err(f"{cname}: NUDGE_DATABASE__MAX_CONNECTIONS must be a number")
            max_connections += replicas * pool
            connections.append(f"{r['metadata']['name']} {replicas} x {pool}")

        if r["kind"] != "Deployment":
            continue
        labels = r["spec"]["template"]["metadata"].get("labels", {})
        if r["spec"]["selector"]["matchLabels"].items() - labels.items():
            err(f"{name}: selector does not match the pod template's labels")
        covering = [p for p in pdbs if p["metadata"].get("namespace") == r["metadata"].get("namespace")
                    and p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        if len(covering) != 1:
            err(f"{name}: {len(covering)} PodDisruptionBudgets select it, expected 1")
        command = (spec["containers"][0].get("command") or [""])[0]
        if command in WORKER_COMMANDS:
            channel = WORKER_COMMANDS[command]
            so = scaled.get(r["metadata"]["name"])
            if so is None:
                err(f"{name}: no ScaledObject targets it")
                continue
            sname = f"{where}: ScaledObject/{so['metadata']['name']}"
            triggers = so["spec"]["triggers"]
            if len(triggers) != 1 or triggers[0]["type"] != "rabbitmq":
                err(f"{sname}: expected one rabbitmq trigger")
                continue
            md = triggers[0]["metadata"]
            queue = f"{namespace}work.{channel}"
            if md.get("queueName") != queue:
                err(f"{sname}: queueName {md.get('queueName')}, the worker consumes {queue}")
            if md.get("protocol") != "amqp" or md.get("mode") != "QueueLength":
                err(f"{sname}: protocol amqp and mode QueueLength count the ready messages")
            if md.get("value") != str(prefetch):
                err(f"{sname}: value {md.get('value')} should be amqp.prefetch ({prefetch})")
            auth = triggers[0].get("authenticationRef", {}).get("name")
            if auth not in auths:
                err(f"{sname}: authenticationRef {auth} is not in the rendering")
            else:
                for ref in auths[auth]["spec"].get("secretTargetRef", []):
                    s = secrets.get(ref["name"])
                    if s is not None and ref["key"] not in set(s.get("data", {})) | set(s.get("stringData", {})):
                        err(f"{sname}: TriggerAuthentication {auth} names key {ref['key']}, "
                            f"not in Secret {ref['name']}")
            rates = [p["rate_per_second"] for p in config.get("providers", [])
                     if p.get("channel") == channel and "rate_per_second" in p]
            rate = sum(rates) if rates else None
            window = max_w if rate is None else min(max(math.ceil(rate * in_flight_s), min_w), max_w)
            bound = max(so["spec"].get("minReplicaCount", 0), math.ceil(window / prefetch))
            most = so["spec"].get("maxReplicaCount", 100)
            if most > bound:
                err(f"{sname}: maxReplicaCount {most} exceeds ceil(window {window} / prefetch "
                    f"{prefetch}) = {bound}: the extra pods would find nothing to take")
            notes.append(f"{channel}: rate {rate if rate is not None else 'unlimited'}/s, window "
                         f"{window}, maxReplicaCount {most} (bound {bound})")
    # A Service reaches one Deployment's pods, on a port they declare.
    for svc in by_kind.get("Service", []):
        sname = f"{where}: Service/{svc['metadata']['name']}"
        selector = svc["spec"].get("selector", {})
        targets = [d for d in by_kind.get("Deployment", [])
                   if d["metadata"].get("namespace") == svc["metadata"].get("namespace")
                   and selector.items()
                   <= d["spec"]["template"]["metadata"].get("labels", {}).items()]
        if len(targets) != 1:
            err(f"{sname}: its selector matches {len(targets)} Deployments, expected 1")
            continue
        container_ports = [p for c in containers_of(targets[0]) for p in c.get("ports", [])]
        declared = ({p.get("name") for p in container_ports}
                    | {p["containerPort"] for p in container_ports})
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if target not in declared:
                err(f"{sname}: targetPort {target} is not a port of Deployment/"
                    f"{targets[0]['metadata']['name']}")
    notes.append(f"database connections at the most replicas: {max_connections} of the budget "
                 f"{CONNECTION_BUDGET} ({', '.join(connections)})")
    if max_connections > CONNECTION_BUDGET:
        err(f"{where}: database connections at the most replicas: {max_connections}, over the "
            f"budget of {CONNECTION_BUDGET} ({', '.join(connections)}): lower a pool "
            "(NUDGE_DATABASE__MAX_CONNECTIONS) or a maximum, or raise CONNECTION_BUDGET with "
            "PostgreSQL's max_connections")
    check_postgres_cluster(by_kind, secrets, where, err, notes)
    return errors, notes


def check_postgres_cluster(by_kind, secrets, where, err, notes) -> None:
    """A CloudNativePG Cluster in the rendering is nudge's ledger: it must replicate
    synchronously (an outcome committed on a primary that dies before a standby has it is
    forgotten, and the reminder is sent again), keep a standby to fail over to while another
    is lost, create the binaries' roles, and be reached only through its read-write Service."""
    from urllib.parse import urlsplit

    clusters = [c for c in by_kind.get("Cluster", [])
                if c.get("apiVersion") == CNPG_CLUSTER[0]]
    if not clusters:
        return
    if len(clusters) > 1:
        err(f"{where}: {len(clusters)} CloudNativePG Clusters: nudge's ledger is one")
        return
    cluster = clusters[0]
    cname = cluster["metadata"]["name"]
    name = f"{where}: Cluster/{cname}"
    spec = cluster.get("spec", {})
    if spec.get("instances", 1) < 3:
        err(f"{name}: {spec.get('instances', 1)} instances: at least 3, so that a standby still "
            "confirms commits while another is lost or rebuilt")
    sync = spec.get("postgresql", {}).get("synchronous")
    if sync is None:
        err(f"{name}: no postgresql.synchronous: replication must be synchronous, or a "
            "failover forgets committed outcomes and resends their reminders")
    else:
        if sync.get("number", 0) < 1:
            err(f"{name}: postgresql.synchronous.number must be at least 1")
        if sync.get("dataDurability", "required") != "required":
            err(f"{name}: postgresql.synchronous.dataDurability {sync['dataDurability']}: "
                "must be required (preferred commits without a standby when none answers)")
    roles = {r.get("name"): r for r in spec.get("managed", {}).get("roles", [])}
    for role in sorted(BINARY_ROLES):
        r = roles.get(role)
        if r is None or r.get("ensure", "present") != "present" or not r.get("login"):
            err(f"{name}: managed.roles has no {role} with login: its binary could not connect")
        elif "passwordSecret" in r and r["passwordSecret"]["name"] not in secrets:
            err(f"{name}: role {role}'s passwordSecret {r['passwordSecret']['name']} is not in "
                "the rendering")
    owner_secret = spec.get("bootstrap", {}).get("initdb", {}).get("secret", {}).get("name")
    if owner_secret is not None and owner_secret not in secrets:
        err(f"{name}: bootstrap.initdb.secret {owner_secret} is not in the rendering")
    rw = f"{cname}-rw"
    for sname, s in secrets.items():
        values = {**s.get("stringData", {})}
        for key, value in values.items():
            if not key.endswith("database-url"):
                continue
            host = urlsplit(value).hostname or ""
            if host.split(".")[0] != rw:
                err(f"{where}: Secret/{sname} {key} names host {host}: nudge's ledger is the "
                    f"Cluster's read-write Service {rw} (the -ro and -r Services reach "
                    "read-only standbys)")
    params = spec.get("postgresql", {}).get("parameters", {})
    max_conn = int(params.get("max_connections", 100))
    if max_conn < 100:
        err(f"{name}: max_connections {max_conn}: the connection budget of {CONNECTION_BUDGET} "
            "assumes PostgreSQL's default of 100")
    notes.append(f"Cluster/{cname}: {spec.get('instances', 1)} instances, synchronous "
                 f"{(sync or {}).get('method')} {(sync or {}).get('number')} "
                 f"({(sync or {}).get('dataDurability', 'required')}), nudge through {rw}")


def find(resources: list[dict], kind: str, name: str) -> dict:
    return next(r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name)


def first_container(resources: list[dict], name: str) -> dict:
    return find(resources, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


# Each a way the manifests could go wrong, and words the checks must answer it with: proof that
# the checks bite, run before the real ones.
def _m_service_links(rs):
    find(rs, "Deployment", "nudge-sms")["spec"]["template"]["spec"].pop("enableServiceLinks")


def _m_probe_port(rs):
    first_container(rs, "nudge-producer")["ports"][0]["containerPort"] = 9465


def _m_liveness_path(rs):
    first_container(rs, "nudge-janitor")["livenessProbe"]["httpGet"]["path"] = "/metrics"


def _m_grace(rs):
    find(rs, "Deployment", "nudge-email")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20


def _m_events_grace(rs):
    find(rs, "Deployment", "nudge-events")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10


def _m_max_replicas(rs):
    find(rs, "ScaledObject", "nudge-sms")["spec"]["maxReplicaCount"] = 10


def _m_queue(rs):
    find(rs, "ScaledObject", "nudge-push")["spec"]["triggers"][0]["metadata"]["queueName"] = "push"


def _m_env_name(rs):
    first_container(rs, "nudge-producer")["env"].append({"name": "NUDGE_DATABASE_URL", "value": "x"})


def _m_subscriber_key(rs):
    first_container(rs, "nudge-push")["env"].append({"name": "NUDGE_CRYPTO__SUBSCRIBER_KEY", "value": "x"})


def _m_no_pdb(rs):
    rs.remove(find(rs, "PodDisruptionBudget", "nudge-intake"))


def _m_no_limits(rs):
    first_container(rs, "nudge-intake")["resources"].pop("limits")


def _m_secret_in_config(rs):
    cm = next(r for r in rs if r["kind"] == "ConfigMap")
    cm["data"]["nudge.toml"] += "\n[crypto]\ndestination_key = \"x\"\n"


def _m_typo(rs):
    c = first_container(rs, "nudge-sms")
    c["livenesProbe"] = c.pop("livenessProbe")


def _m_keda_typo(rs):
    find(rs, "ScaledObject", "nudge-email")["spec"]["maxReplicas"] = 4


def _m_missing_secret_key(rs):
    s = next(r for r in rs if r["kind"] == "Secret")
    s["stringData"].pop("destination-key")


def _m_token_order(rs):
    cm = next(r for r in rs if r["kind"] == "ConfigMap")
    text = cm["data"]["nudge.toml"]
    cm["data"]["nudge.toml"] = text.replace('account = "sms-main"', 'account = "sms-a"', 1)


def _m_token_channel(rs):
    env = first_container(rs, "nudge-push")["env"]
    env.append({"name": "NUDGE_PROVIDERS__0__AUTH_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "nudge-secrets", "key": "sms-main-token"}}})


def _m_subscriber_alone(rs):
    c = find(rs, "Job", "nudge-migrate")["spec"]["template"]["spec"]["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "NUDGE_CRYPTO__DESTINATION_KEY"]


def _m_pool_budget(rs):
    env = first_container(rs, "nudge-push")["env"]
    next(e for e in env if e["name"] == "NUDGE_DATABASE__MAX_CONNECTIONS")["value"] = "10"


def _m_worker_tenant_key(rs):
    first_container(rs, "nudge-sms")["env"].append({
        "name": "NUDGE_CRYPTO__TENANT_SECRET_KEY",
        "valueFrom": {"secretKeyRef": {"name": "nudge-secrets", "key": "tenant-secret-key"}}})


def _m_cluster_async(rs):
    find(rs, "Cluster", "nudge-pg")["spec"]["postgresql"].pop("synchronous")


def _m_cluster_preferred(rs):
    find(rs, "Cluster", "nudge-pg")["spec"]["postgresql"]["synchronous"]["dataDurability"] = "preferred"


def _m_cluster_read_only_url(rs):
    s = find(rs, "Secret", "nudge-secrets")
    s["stringData"]["worker-database-url"] = "postgres://nudge_worker:x@nudge-pg-ro:5432/nudge"


def _m_cluster_role(rs):
    roles = find(rs, "Cluster", "nudge-pg")["spec"]["managed"]["roles"]
    roles[:] = [r for r in roles if r["name"] != "nudge_janitor"]


def _m_cluster_typo(rs):
    spec = find(rs, "Cluster", "nudge-pg")["spec"]
    spec["instance"] = spec.pop("instances")


def _m_cluster_two(rs):
    find(rs, "Cluster", "nudge-pg")["spec"]["instances"] = 2


def _m_owner_url(rs):
    env = first_container(rs, "nudge-email")["env"]
    url = next(e for e in env if e["name"] == "NUDGE_DATABASE__URL")
    url["valueFrom"]["secretKeyRef"]["key"] = "database-url"


def _m_console_owner_url(rs):
    env = first_container(rs, "nudge-console")["env"]
    url = next(e for e in env if e["name"] == "NUDGE_DATABASE__URL")
    url["valueFrom"]["secretKeyRef"]["key"] = "database-url"


def _m_console_destination_key(rs):
    first_container(rs, "nudge-console")["env"].append({
        "name": "NUDGE_CRYPTO__DESTINATION_KEY",
        "valueFrom": {"secretKeyRef": {"name": "nudge-secrets", "key": "destination-key"}}})


def _m_console_no_session_key(rs):
    c = first_container(rs, "nudge-console")
    c["env"] = [e for e in c["env"] if e["name"] != "NUDGE_CONSOLE__SESSION_KEY"]


def _m_console_insecure(rs):
    first_container(rs, "nudge-console")["env"].append(
        {"name": "NUDGE_CONSOLE__SECURE_COOKIES", "value": "false"})


def _m_console_port(rs):
    c = first_container(rs, "nudge-console")
    next(p for p in c["ports"] if p["name"] == "http")["containerPort"] = 8096


def _m_session_key_elsewhere(rs):
    first_container(rs, "nudge-intake")["env"].append({
        "name": "NUDGE_CONSOLE__SESSION_KEY",
        "valueFrom": {"secretKeyRef": {"name": "nudge-secrets", "key": "console-session-key"}}})


def _m_service_target(rs):
    find(rs, "Service", "nudge-console")["spec"]["ports"][0]["targetPort"] = "web"


def _m_cluster_console_role(rs):
    roles = find(rs, "Cluster", "nudge-pg")["spec"]["managed"]["roles"]
    roles[:] = [r for r in roles if r["name"] != "nudge_console"]


MUTATIONS = [
    (_m_console_owner_url, "from Secret key database-url, expected console-database-url"),
    (_m_console_destination_key, "the console must not have NUDGE_CRYPTO__DESTINATION_KEY"),
    (_m_console_no_session_key, "no NUDGE_CONSOLE__SESSION_KEY"),
    (_m_console_insecure, "NUDGE_CONSOLE__SECURE_COOKIES false"),
    (_m_console_port, "http port 8096 is not console.listen_addr's 8095"),
    (_m_session_key_elsewhere, "only nudge-console signs sessions"),
    (_m_service_target, "targetPort web is not a port of Deployment/nudge-console"),
    (_m_cluster_console_role, "managed.roles has no nudge_console"),
    (_m_cluster_async, "no postgresql.synchronous"),
    (_m_cluster_preferred, "dataDurability preferred"),
    (_m_cluster_read_only_url, "worker-database-url names host nudge-pg-ro"),
    (_m_cluster_role, "managed.roles has no nudge_janitor"),
    (_m_cluster_typo, "'instance' was unexpected"),
    (_m_cluster_two, "2 instances: at least 3"),
    (_m_pool_budget, "over the budget of 87"),
    (_m_worker_tenant_key, "workers must not have the tenant secret key"),
    (_m_owner_url, "from Secret key database-url, expected worker-database-url"),
    (_m_subscriber_alone, "the subscriber key without the destination key"),
    (_m_token_order, "should come from Secret key sms-a-token"),
    (_m_token_channel, "is the token of sms-main (sms), not of this worker's channel"),
    (_m_service_links, "enableServiceLinks must be false"),
    (_m_probe_port, "telemetry.metrics_addr listens on 9464"),
    (_m_liveness_path, "livenessProbe path /metrics"),
    (_m_grace, "is not longer than worker.shutdown_grace_ms"),
    (_m_events_grace, "is not longer than events.request_timeout_ms"),
    (_m_max_replicas, "maxReplicaCount 10 exceeds"),
    (_m_queue, "the worker consumes work.push"),
    (_m_env_name, "NUDGE_DATABASE_URL is not NUDGE_<SECTION>__<KEY>"),
    (_m_subscriber_key, "workers must not have the subscriber key"),
    (_m_no_pdb, "0 PodDisruptionBudgets select it"),
    (_m_no_limits, "no limits.cpu"),
    (_m_secret_in_config, "nudge.toml sets crypto.destination_key"),
    (_m_typo, "Additional properties are not allowed ('livenesProbe'"),
    (_m_keda_typo, "'maxReplicas' was unexpected"),
    (_m_missing_secret_key, "names key destination-key, not in Secret nudge-secrets"),
]


def self_test(directory: Path, versions: list[str]) -> int:
    clean = render(directory)
    failures = 0
    for mutate, expected in MUTATIONS:
        rs = copy.deepcopy(clean)
        mutate(rs)
        errors = validate_schemas(rs, versions[:1], "self-test") + check_nudge(rs, "self-test")[0]
        if not any(expected in e for e in errors):
            print(f"FAIL self-test {mutate.__name__[3:]}: no error saying {expected!r}; got {errors}")
            failures += 1
    print(f"self-test: {len(MUTATIONS) - failures} of {len(MUTATIONS)} broken renderings of "
          f"{os.path.relpath(directory.resolve(), ROOT)} refused with the expected error")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kustomizations", nargs="+", type=Path)
    ap.add_argument("--kubernetes-version", action="append", dest="versions",
                    help="validate against this Kubernetes version (repeatable)")
    ap.add_argument("--print", action="store_true", help="print each rendering")
    ap.add_argument("--self-test", type=Path, metavar="OVERLAY",
                    help="first break a rendering of OVERLAY in known ways and require each refused")
    args = ap.parse_args()
    versions = args.versions or ["1.30.0"]
    failed = False
    if args.self_test and self_test(args.self_test, versions):
        failed = True
    for directory in args.kustomizations:
        where = os.path.relpath(directory.resolve(), ROOT)
        try:
            resources = render(directory)
            compared = compare_with_kubectl(directory, copy.deepcopy(resources))
        except CheckFailed as e:
            print(f"FAIL {e}")
            failed = True
            continue
        if args.print:
            print(yaml.safe_dump_all(resources, sort_keys=False))
        errors = validate_schemas(resources, versions, where)
        nudge_errors, notes = check_nudge(resources, where)
        errors += nudge_errors
        kinds = sorted({r["kind"] for r in resources})
        print(f"{where}: {len(resources)} resources ({', '.join(kinds)}); {compared}")
        print(f"  schemas: Kubernetes {', '.join(versions)} (strict) for the built-in kinds, "
              f"{os.path.relpath(KEDA_SCHEMA, ROOT)} for ScaledObject and TriggerAuthentication, "
              f"{os.path.relpath(CNPG_SCHEMA, ROOT)} (strict) for Cluster")
        for n in notes:
            print(f"  {n}")
        for e in errors:
            print(f"FAIL {e}")
        failed |= bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
