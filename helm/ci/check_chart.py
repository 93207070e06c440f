#!/usr/bin/env python3
"""Lint and render the agq Helm chart, then check the rendered objects.

Helm comes from the PyPI package helm-sdkpy: Helm's Go library compiled into
a shared object (helm_sdkpy/_lib/<os>-<arch>/libhelm_sdkpy.so) and called
through cffi. It has no `helm` executable and no `template` action, so:

* `helm lint`     is helm_sdkpy.Lint(config).run(chart_dir);
* `helm template` is helm_sdkpy.Install(...).run(..., wait=False) against a
  tiny fake Kubernetes API server that this script runs on 127.0.0.1 (it
  answers discovery and accepts every create); the release it returns
  carries the rendered manifest and hooks. Values go through the chart's
  values.schema.json exactly as in a real install.

Each check prints one line; the last line reads
`helm-chart: N passed, M failed`, and the exit status is non-zero on any
failure. Needs Python >= 3.11 (tomllib), helm-sdkpy and PyYAML. With
AGQ_CHART_DUMP=<dir> set, the rendered objects are written there as YAML.

The live-metrics check runs the debug build's `agq serve` and `agw`
(AGQ_BIN / AGW_BIN override the paths) on 127.0.0.1, drives one job to
dead so every labelled family has samples, and checks that each metric and
label named by the dashboard, the PrometheusRule, the ScaledObject and the
HPA is on /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parent / "agq"
AUTH_VALUES = HERE / "values-auth.yaml"
RELEASE = "agq-ci"
NAMESPACE = "agq-ci"
FULLNAME = "agq-ci"  # the release name contains the chart name
GRPC_PORT = 6380
METRICS_PORT = 6381
CONSOLE_PORT = 6382
WATCHDOG_SECS = 300
REPO = HERE.parent.parent
DASHBOARD = CHART / "dashboards" / "agq.json"

# Labels Prometheus attaches at scrape time (target labels of a
# ServiceMonitor scrape), not served on /metrics.
TARGET_LABELS = {"namespace", "service", "job", "instance", "pod", "endpoint", "container"}

# ---------------------------------------------------------------- fake API

# Resources the fake API server advertises, by group/version.
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("services", "Service", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("pods", "Pod", True),
        ("persistentvolumeclaims", "PersistentVolumeClaim", True),
        ("namespaces", "Namespace", False),
    ],
    "apps/v1": [("statefulsets", "StatefulSet", True), ("deployments", "Deployment", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True),
                                 ("prometheusrules", "PrometheusRule", True)],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    "keda.sh/v1alpha1": [("scaledobjects", "ScaledObject", True)],
}

# Objects the fake cluster holds, by API path; `lookup` finds these. The
# default is a live cluster with an existing namespace (Kubernetes publishes
# kube-root-ca.crt into every namespace); set_cluster() swaps it.
ROOT_CA_PATH = f"/api/v1/namespaces/{NAMESPACE}/configmaps/kube-root-ca.crt"
LIVE_CLUSTER = {ROOT_CA_PATH: {"kind": "ConfigMap", "apiVersion": "v1",
                               "metadata": {"name": "kube-root-ca.crt", "namespace": NAMESPACE},
                               "data": {"ca.crt": "-----BEGIN CERTIFICATE-----"}}}
CLUSTER: dict[str, dict[str, Any]] = dict(LIVE_CLUSTER)


def set_cluster(objects: dict[str, dict[str, Any]]) -> None:
    CLUSTER.clear()
    CLUSTER.update(objects)


def stored_secret(name: str, data: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A Secret as the API returns it (base64 data), keyed by its path."""
    return {f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}": {
        "kind": "Secret", "apiVersion": "v1", "type": "Opaque",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/managed-by": "Helm"},
                     "annotations": {"meta.helm.sh/release-name": RELEASE,
                                     "meta.helm.sh/release-namespace": NAMESPACE}},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}}


def _resource_list(group_version: str) -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": name,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            }
            for name, kind, namespaced in RESOURCES[group_version]
        ],
    }


def _group_list() -> dict[str, Any]:
    groups = []
    for gv in RESOURCES:
        if "/" not in gv:
            continue
        name, version = gv.split("/")
        entry = {"groupVersion": gv, "version": version}
        groups.append({"name": name, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


class FakeKube(BaseHTTPRequestHandler):
    """Just enough of the Kubernetes API for `helm install` to run."""

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "reason": "NotFound", "code": 404})

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        if path == "/version":
            return self._reply(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"})
        if path == "/api":
            return self._reply(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            return self._reply(200, _group_list())
        if path == "/api/v1":
            return self._reply(200, _resource_list("v1"))
        if path.startswith("/apis/") and path.count("/") == 3:
            gv = path[len("/apis/"):]
            if gv in RESOURCES:
                return self._reply(200, _resource_list(gv))
        if path in CLUSTER:
            return self._reply(200, CLUSTER[path])
        # A collection (.../namespaces/<ns>/<resource>) is empty; any other
        # single object does not exist yet.
        parts = path.strip("/").split("/")
        if "namespaces" in parts and len(parts) - parts.index("namespaces") == 3:
            return self._reply(200, {"kind": "List", "apiVersion": "v1",
                                     "metadata": {}, "items": []})
        return self._not_found()

    def _echo(self, code: int) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            obj = json.loads(body)
        except ValueError:  # Helm stores its release Secret as protobuf
            obj = {"kind": "Secret", "apiVersion": "v1", "metadata": {}}
        self._reply(code, obj)

    def do_POST(self) -> None:  # noqa: N802
        self._echo(201)

    def do_PUT(self) -> None:  # noqa: N802
        self._echo(200)

    def do_PATCH(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        if path in CLUSTER:  # an adopted object: answer with what is stored
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            return self._reply(200, CLUSTER[path])
        self._echo(200)

    def do_DELETE(self) -> None:  # noqa: N802
        self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})


def start_fake_kube() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKube)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake",
                      "context": {"cluster": "fake", "user": "fake", "namespace": NAMESPACE}}],
        "current-context": "fake",
    })
    return server, kubeconfig


# ---------------------------------------------------------------- helm


class Helm:
    def __init__(self, kubeconfig: str) -> None:
        import helm_sdkpy  # imported late: its library is large

        self.sdk = helm_sdkpy
        self.config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)

    def lint(self) -> dict[str, Any]:
        return asyncio.run(self.sdk.Lint(self.config).run(str(CHART)))

    def template(self, values: dict[str, Any] | None,
                 chart: Path = CHART) -> tuple[list[dict], list[dict]]:
        """Render the chart; returns (objects, hook objects)."""
        release = asyncio.run(self.sdk.Install(self.config).run(
            release_name=RELEASE, chart_path=str(chart), values=values or None,
            wait=False, timeout=120,
        ))
        objects = [o for o in yaml.safe_load_all(release.get("manifest") or "") if o]
        hooks = [o for h in release.get("hooks") or []
                 for o in yaml.safe_load_all(h.get("manifest") or "") if o]
        return objects, hooks


# ---------------------------------------------------------------- checks


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            self.failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        else:
            self.passed += 1
            print(f"ok   {name}", flush=True)


def expect(cond: Any, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o.get("kind") == kind
            and (name is None or o["metadata"]["name"] == name)]
    expect(len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}")
    return hits[0]


def container(obj: dict, name: str) -> dict:
    hits = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    expect(len(hits) == 1, f"expected one container {name} in {obj['metadata']['name']}")
    return hits[0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env") or []}


def server_workload(objs: list[dict]) -> dict:
    """The agq server: the StatefulSet (store.type=sqlite) or the Deployment
    (store.type=postgres) named FULLNAME; exactly one of them."""
    hits = [o for o in objs if o.get("kind") in ("StatefulSet", "Deployment")
            and o["metadata"]["name"] == FULLNAME]
    expect(len(hits) == 1, f"expected one server StatefulSet or Deployment {FULLNAME}, "
           f"found {[o['kind'] for o in hits]}")
    return hits[0]


def check_probes(objs: list[dict]) -> None:
    agq = container(server_workload(objs), "agq")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        p = agq.get(probe)
        expect(p, f"{probe} missing")
        expect(set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"},
               f"{probe} is not a grpc probe: {p}")
        expect(p["grpc"].get("port") == GRPC_PORT and isinstance(p["grpc"]["port"], int),
               f"{probe} grpc port is {p['grpc'].get('port')!r}, want numeric {GRPC_PORT}")
    # Liveness asks the `liveness` service (SERVING while the process runs);
    # readiness asks the server's "" health, NOT_SERVING while the store
    # cannot commit or (PostgreSQL) the database is unreachable.
    live = agq["livenessProbe"]["grpc"].get("service")
    expect(live == "liveness", f"livenessProbe service {live!r}, want 'liveness'")
    ready = agq["readinessProbe"]["grpc"].get("service", "")
    expect(ready == "", f"readinessProbe service {ready!r}, want the server's \"\" health")


def check_ports(objs: list[dict]) -> None:
    sts = server_workload(objs)
    ports = {p["name"]: p["containerPort"] for p in container(sts, "agq")["ports"]}
    expect(ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT, "console": CONSOLE_PORT},
           f"container ports {ports}")
    env = env_of(container(sts, "agq"))
    expect(env["AGQ_LISTEN"]["value"] == f"0.0.0.0:{GRPC_PORT}", "AGQ_LISTEN")
    expect(env["AGQ_METRICS_LISTEN"]["value"] == f"0.0.0.0:{METRICS_PORT}", "AGQ_METRICS_LISTEN")
    expect(env["AGQ_JOB_RETENTION_SECS"]["value"] == "604800", "AGQ_JOB_RETENTION_SECS")
    svc = find(objs, "Service", FULLNAME)
    sports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    expect(sports == {"grpc": (GRPC_PORT, "grpc"), "metrics": (METRICS_PORT, "metrics"),
                      "console": (CONSOLE_PORT, "console")},
           f"service ports {sports}")
    expect(svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"],
           f"service selector differs from the {sts['kind']}'s")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    expect(all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
           "service selector does not match the server pods' labels")
    if sts["kind"] == "Deployment":
        expect(not [o for o in objs if o["kind"] == "Service"
                    and o["metadata"]["name"] == f"{FULLNAME}-headless"],
               "a headless Service beside the Deployment (it governs the StatefulSet only)")
        return
    headless = find(objs, "Service", f"{FULLNAME}-headless")
    expect(sts["spec"]["serviceName"] == headless["metadata"]["name"]
           and headless["spec"]["clusterIP"] == "None", "StatefulSet serviceName/headless")
    hports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    expect(hports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}, f"headless ports {hports}")


def check_console(objs: list[dict], mode: str, service_port: int = CONSOLE_PORT) -> None:
    """The web console's env, container port and Service port. mode:
    "public" (auth on: 0.0.0.0:6382 behind the Service port `console`),
    "loopback" (auth off: agq refuses a public console without tokens, so
    it stays on the pod's loopback with no port anywhere), or "off"
    (console.enabled=false: AGQ_NO_CONSOLE=true, no port)."""
    sts = server_workload(objs)
    clustered = sts["kind"] == "Deployment"
    agq = container(sts, "agq")
    env = env_of(agq)
    listen = env.get("AGQ_CONSOLE_LISTEN", {}).get("value")
    no_console = env.get("AGQ_NO_CONSOLE", {}).get("value")
    ports = {p["name"]: p["containerPort"] for p in agq["ports"]}
    services = [o for o in objs if o["kind"] == "Service"]
    expect(len(services) == (1 if clustered else 2), f"{len(services)} Services")
    sports = {s["metadata"]["name"]: {p["name"]: p for p in s["spec"]["ports"]} for s in services}
    if not clustered:
        headless = sports.pop(f"{FULLNAME}-headless")
        expect("console" not in headless
               and CONSOLE_PORT not in {p["port"] for p in headless.values()},
               "a console port on the headless Service")
    svc = sports[FULLNAME]
    if mode == "public":
        expect("AGQ_AUTH_FILE" in env and "AGQ_INSECURE" not in env,
               "console exposed without an auth file")
        expect(listen == f"0.0.0.0:{CONSOLE_PORT}", f"AGQ_CONSOLE_LISTEN {listen!r}")
        expect(no_console is None, "AGQ_NO_CONSOLE set while the console is on")
        expect(ports.get("console") == CONSOLE_PORT, f"container ports {ports}")
        c = svc.get("console")
        expect(c and c["port"] == service_port and c["targetPort"] == "console"
               and c.get("appProtocol") == "http",
               f"Service console port {c}, want {service_port} -> console")
        return
    expect("console" not in ports and CONSOLE_PORT not in ports.values(),
           f"a console container port in mode {mode}: {ports}")
    expect("console" not in svc and service_port not in {p["port"] for p in svc.values()},
           f"a console Service port in mode {mode}: {sorted(svc)}")
    if mode == "loopback":
        expect(env.get("AGQ_INSECURE", {}).get("value") == "true", "not the auth-off render")
        expect(no_console is None, "AGQ_NO_CONSOLE set while console.enabled")
        expect(listen == f"127.0.0.1:{CONSOLE_PORT}",
               f"AGQ_CONSOLE_LISTEN {listen!r}, want the pod's loopback")
    else:
        expect(mode == "off", f"unknown mode {mode}")
        expect(no_console == "true", f"AGQ_NO_CONSOLE {no_console!r}")
        expect(listen is None, f"AGQ_CONSOLE_LISTEN {listen!r} with the console off")
    extra = " ".join(str(a) for a in agq["args"])
    expect("console" not in extra, f"console flags on the command line: {extra}")


def check_security(objs: list[dict]) -> None:
    pods = [(server_workload(objs), "agq")]
    if any(o["kind"] == "Deployment" and o["metadata"]["name"] == f"{FULLNAME}-worker"
           for o in objs):
        pods.append((find(objs, "Deployment", f"{FULLNAME}-worker"), "agw"))
    for obj, cname in pods:
        sc = container(obj, cname)["securityContext"]
        want_uid = SERVER_UID if cname == "agq" else WORKER_UID
        expect(sc.get("runAsNonRoot") is True, f"{cname}: runAsNonRoot")
        expect(sc.get("runAsUser") == want_uid,
               f"{cname}: runAsUser {sc.get('runAsUser')}, want {want_uid}")
        expect(sc.get("readOnlyRootFilesystem") is True, f"{cname}: readOnlyRootFilesystem")
        expect(sc.get("allowPrivilegeEscalation") is False, f"{cname}: allowPrivilegeEscalation")
        expect(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{cname}: drop ALL")
        expect(not sc.get("capabilities", {}).get("add"),
               f"{cname}: capabilities added {sc['capabilities'].get('add')} in the non-root mode")
        mounts = {m["mountPath"] for m in container(obj, cname).get("volumeMounts") or []}
        expect("/tmp" in mounts, f"{cname}: no writable /tmp with a read-only root")
        spec = obj["spec"]["template"]["spec"]
        expect(spec.get("enableServiceLinks") is False, f"{cname}: enableServiceLinks")
        expect(c_resources(container(obj, cname)), f"{cname}: no resources")


def c_resources(c: dict) -> bool:
    r = c.get("resources") or {}
    return bool(r.get("requests")) and bool(r.get("limits"))


def check_grace(objs: list[dict], want_drain: int) -> None:
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    env = env_of(container(dep, "agw"))
    drain = int(env["AGW_DRAIN_TIMEOUT_SECS"]["value"])
    expect(drain == want_drain, f"AGW_DRAIN_TIMEOUT_SECS {drain}, want {want_drain}")
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    expect(isinstance(grace, int) and grace > drain,
           f"terminationGracePeriodSeconds {grace} not > drain timeout {drain}")


def check_worker(objs: list[dict], replicas: int, tools: str | None, jobs: str) -> None:
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    expect(dep["spec"]["replicas"] == replicas, f"worker replicas {dep['spec']['replicas']}")
    agw = container(dep, "agw")
    expect(agw["args"][0] == "agw", f"agw args {agw['args']}")
    env = env_of(agw)
    expect(env["AGW_SERVER"]["value"] == f"http://{FULLNAME}:{GRPC_PORT}",
           f"AGW_SERVER {env['AGW_SERVER']}")
    expect(env["AGW_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name",
           "AGW_WORKER_ID is not the pod name")
    expect(env["AGW_MAX_CONCURRENT_JOBS"]["value"] == jobs, "AGW_MAX_CONCURRENT_JOBS")
    expect(env.get("AGW_TOOLS", {}).get("value") == tools, f"AGW_TOOLS {env.get('AGW_TOOLS')}")
    # The task sandbox is on (agw fails closed without Landlock), tasks get
    # no network, and the worker pod is non-root, so tasks are too.
    for var in ("AGW_INSECURE_NO_SANDBOX", "AGW_ALLOW_NETWORK", "AGW_RUN_AS"):
        expect(var not in env, f"{var} set by default")
    expect(not any("--insecure-no-sandbox" in str(a) or "--allow-network" in str(a)
                   for a in agw["args"]), "sandbox turned off on the command line")
    pod_sc = dep["spec"]["template"]["spec"]["securityContext"]
    expect(pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) != 0,
           "worker pod may run as root")
    expect(pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
           "worker pod without the RuntimeDefault seccomp profile")


def check_default_storage(objs: list[dict]) -> None:
    sts = find(objs, "StatefulSet", FULLNAME)
    vcts = sts["spec"].get("volumeClaimTemplates") or []
    expect([v["metadata"]["name"] for v in vcts] == ["data"], "volumeClaimTemplates [data]")
    expect(vcts[0]["spec"]["resources"]["requests"]["storage"] == "1Gi", "claim size")
    vols = {v["name"] for v in sts["spec"]["template"]["spec"].get("volumes") or []}
    expect("data" not in vols, "a plain data volume shadows the claim template")
    check_data_mount(sts)
    expect(sts["spec"]["replicas"] == 1, "StatefulSet replicas != 1")
    # SQLite, the default store: no AGQ_STORE (agq's default is sqlite), no
    # store Secret, no Deployment of the server.
    expect("AGQ_STORE" not in env_of(container(sts, "agq")), "AGQ_STORE set on SQLite")
    expect(not [o for o in objs if o["metadata"]["name"] == f"{FULLNAME}-store"],
           "a store Secret on SQLite")
    expect(not [o for o in objs if o["kind"] == "PersistentVolumeClaim"],
           "a plain PersistentVolumeClaim beside the claim template")


def check_existing_claim(objs: list[dict]) -> None:
    sts = find(objs, "StatefulSet", FULLNAME)
    expect(not sts["spec"].get("volumeClaimTemplates"), "volumeClaimTemplates still rendered")
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    expect(vols["data"].get("persistentVolumeClaim", {}).get("claimName") == "agq-data",
           f"data volume {vols.get('data')}")
    check_data_mount(sts)


def check_data_mount(sts: dict) -> None:
    agq = container(sts, "agq")
    mounts = {m["name"]: m["mountPath"] for m in agq["volumeMounts"]}
    expect(mounts.get("data") == "/data", f"data mounted at {mounts.get('data')}")
    expect(env_of(agq)["AGQ_DB"]["value"].startswith("/data/"), "AGQ_DB not under /data")


def check_auth(objs: list[dict], extra_tokens: list[dict], worker_token: str | None) -> None:
    sts = server_workload(objs)
    agq = container(sts, "agq")
    env = env_of(agq)
    expect("AGQ_INSECURE" not in env, "AGQ_INSECURE set while auth is on")
    auth_file = env["AGQ_AUTH_FILE"]["value"]
    mounts = {m["name"]: m for m in agq["volumeMounts"]}
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    secret_vol = vols["auth"]["secret"]
    expect(mounts["auth"].get("readOnly") is True, "auth mount not read-only")
    key = secret_vol["items"][0]["key"]
    expect(auth_file == f"{mounts['auth']['mountPath']}/{secret_vol['items'][0]['path']}",
           f"AGQ_AUTH_FILE {auth_file} is not the mounted file")
    secret = find(objs, "Secret", secret_vol["secretName"])
    data = secret.get("stringData") or {}
    toml = tomllib.loads(data[key])
    tokens = toml["tokens"]
    # The worker Deployment holds exactly one token: the worker-pool token
    # of its own pods, mounted as a file from the same Secret. No admin
    # token, no auth file, nothing in its environment.
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    agw = container(dep, "agw")
    agw_env = env_of(agw)
    expect("AGW_TOKEN" not in agw_env, "AGW_TOKEN in the worker environment")
    expect(not any("token" in str(a).lower() for a in agw.get("args", [])),
           "a token on the worker command line")
    dep_vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    agw_mounts = {m["name"]: m for m in agw["volumeMounts"]}
    secret_vols = [v for v in dep_vols.values() if "secret" in v]
    expect(len(secret_vols) == 1, f"{len(secret_vols)} Secret volumes in the worker pod")
    tok_vol = secret_vols[0]["secret"]
    expect(tok_vol["secretName"] == secret["metadata"]["name"], "worker token from another Secret")
    items = tok_vol.get("items") or []
    expect(len(items) == 1, "the worker pod mounts more than its token from the Secret")
    mount = agw_mounts[secret_vols[0]["name"]]
    expect(mount.get("readOnly") is True, "worker token mount not read-only")
    expect(agw_env["AGW_TOKEN_FILE"]["value"] == f"{mount['mountPath']}/{items[0]['path']}",
           "AGW_TOKEN_FILE is not the mounted token")
    token = data[items[0]["key"]]
    expect(len(token) >= 32, "worker token too short")
    if worker_token is not None:
        expect(token == worker_token, "worker token is not auth.workerToken")
    entries = [t for t in tokens if t["token"] == token]
    expect(len(entries) == 1, "the worker token is not exactly one auth-file entry")
    expect(entries[0] == {"token": token, "role": "worker",
                          "worker_id_prefix": f"{FULLNAME}-worker-"},
           f"worker token entry is {dict(entries[0], token='…')}, not a pool token "
           "for this Deployment's pods")
    expect(all(t["role"] != "admin" for t in tokens if t["token"] == token),
           "the worker token is an admin token")
    for t in extra_tokens:
        expect(t in tokens, f"token for role {t['role']} missing from auth file")
    expect(len(tokens) == 1 + len(extra_tokens), f"{len(tokens)} tokens in auth file")
    ann = sts["spec"]["template"]["metadata"].get("annotations") or {}
    expect("checksum/auth" in ann, "no checksum/auth annotation to roll the server")


def check_insecure(objs: list[dict]) -> None:
    sts = server_workload(objs)
    env = env_of(container(sts, "agq"))
    expect(env.get("AGQ_INSECURE", {}).get("value") == "true", "AGQ_INSECURE not true")
    expect("AGQ_AUTH_FILE" not in env, "AGQ_AUTH_FILE set with auth off")
    expect(not [o for o in objs if o["kind"] == "Secret"
                and o["metadata"]["name"] != f"{FULLNAME}-store"],
           "an auth Secret rendered with auth off")
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    env = env_of(container(dep, "agw"))
    expect("AGW_TOKEN" not in env and "AGW_TOKEN_FILE" not in env, "a worker token with auth off")


def check_optional(objs: list[dict], enabled: bool) -> None:
    sms = [o for o in objs if o["kind"] == "ServiceMonitor"]
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    if not enabled:
        expect(not sms and not pdbs, "ServiceMonitor/PDB rendered while disabled")
        return
    expect(len(sms) == 1, "no ServiceMonitor")
    sm = sms[0]
    expect(sm["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor apiVersion")
    expect([e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"], "ServiceMonitor port")
    svc = find(objs, "Service", FULLNAME)
    labels = svc["metadata"]["labels"]
    expect(all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
           "ServiceMonitor does not select the Service")
    headless = find(objs, "Service", f"{FULLNAME}-headless")["metadata"]["labels"]
    expect(not all(headless.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
           "ServiceMonitor also selects the headless Service (double scrape)")
    expect(sm["metadata"]["labels"].get("release") == "prometheus", "ServiceMonitor labels")
    expect([p["metadata"]["name"] for p in pdbs] == [f"{FULLNAME}-worker"],
           f"PDBs {[p['metadata']['name'] for p in pdbs]}")


def check_test_hook(hooks: list[dict]) -> None:
    pods = [h for h in hooks if h["kind"] == "Pod"]
    expect(len(pods) == 1, f"{len(pods)} test pods")
    pod = pods[0]
    expect(pod["metadata"]["annotations"]["helm.sh/hook"] == "test", "not a test hook")
    c = pod["spec"]["containers"][0]
    image = c["image"]
    expect(":" in image and not image.endswith(":latest"), f"test image {image} not pinned")
    expect(f"{FULLNAME}:{GRPC_PORT}" in c["args"] and "grpc.health.v1.Health/Check" in c["args"],
           f"test args {c['args']}")


NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-probe
data:
  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | toJson }}
"""


def render_notes(helm: Helm, values: dict[str, Any] | None) -> str:
    """NOTES.txt as rendered for `values` (Helm returns no notes without a
    cluster, so a scratch copy of the chart renders them into a ConfigMap)."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp, "agq")
        shutil.copytree(CHART, chart)
        (chart / "templates" / "zz-notes-probe.yaml").write_text(NOTES_PROBE)
        objs, _ = helm.template(values, chart)
    return find(objs, "ConfigMap", "notes-probe")["data"]["notes"]


def check_notes(helm: Helm, auth_values: dict[str, Any]) -> None:
    want_all = [f"helm -n {NAMESPACE} test {RELEASE}", "agq job status",
                f"svc/{FULLNAME} 6380:6380"]
    console_public = [f"svc/{FULLNAME} 6380:6380 6381:6381 6382:{CONSOLE_PORT}",
                      f"http://{FULLNAME}.{NAMESPACE}.svc:{CONSOLE_PORT}/",
                      "http://localhost:6382/", "client", '"Token"']
    console_loopback = [f"port-forward pod/{FULLNAME}-0 6382", "loopback only",
                        "http://localhost:6382/"]
    cases = [
        (None, ["worker-pool token", "data-agq-ci-0", *console_public],
         ["WARNING", "loopback", "pod/"]),
        (auth_values, ["on claim agq-data", "3 replicas", *console_public], ["WARNING"]),
        ({"auth": {"enabled": False}}, ["WARNING", "AGQ_INSECURE=true", *console_loopback],
         ["get secret", "6382:", "Console: http"]),
        (CONSOLE_OFF, [f"svc/{FULLNAME} 6380:6380 6381:6381\n"], ["6382", "onsole"]),
        (CONSOLE_OFF_INSECURE, ["WARNING"], ["6382", "onsole"]),
        (CONSOLE_PORT_VALUES, [f"6382:{CONSOLE_PORT_VALUES['service']['consolePort']}",
                               f".svc:{CONSOLE_PORT_VALUES['service']['consolePort']}/"], []),
        (EDGE_VALUES, ["my-agq-tokens", "LOST"], ["Workers:"]),
        (ALL_ON_KEDA, ["0-20 replicas by KEDA on the ready depth", "6381:6381"], ["WARNING"]),
        (ALL_ON_HPA, ["2-30 replicas by the HPA on the ready depth"], ["WARNING"]),
        # The clustered mode: a Deployment of 3, no claim, no pod -0.
        (yaml.safe_load(PG_VALUES.read_text()),
         ["Server: Deployment agq-ci (3 replicas sharing one PostgreSQL database",
          "from Secret pg-app, key uri", f"rollout status deployment/{FULLNAME}",
          f"logs --prefix -l app.kubernetes.io/instance={RELEASE},"
          "app.kubernetes.io/component=server", *console_public],
         ["StatefulSet", "statefulset/", "data-agq-ci-0", "/data", "pod/", "LOST"]),
        ({**PG_URL_VALUES, "auth": {"enabled": False}},
         [f"from Secret {FULLNAME}-store, key url", "WARNING",
          f"port-forward deployment/{FULLNAME} 6382", "loopback only"],
         ["pod/", "statefulset/", "postgres://", "ci-Pg-Passw0rd"]),
    ]
    for values, want, unwanted in cases:
        notes = render_notes(helm, values)
        for text in want_all + want:
            expect(text in notes, f"NOTES for {values} lack {text!r}")
        for text in unwanted:
            expect(text not in notes, f"NOTES for {values} contain {text!r}")


CONSOLE_OFF = {"console": {"enabled": False}}
CONSOLE_OFF_INSECURE = {"auth": {"enabled": False}, "console": {"enabled": False}}
CONSOLE_PORT_VALUES = {"service": {"consolePort": 8082}}

EDGE_VALUES = {
    "persistence": {"enabled": False},
    "auth": {"existingSecret": "my-agq-tokens"},
    "worker": {"enabled": False},
    "server": {"podDisruptionBudget": {"enabled": True}},
    "serviceAccount": {"create": False},
}


def check_edge(objs: list[dict]) -> None:
    """existingSecret, no persistence, no workers, server PDB, no ServiceAccount."""
    kinds = sorted(o["kind"] for o in objs)
    expect(kinds == ["PodDisruptionBudget", "Service", "Service", "StatefulSet"],
           f"rendered kinds {kinds}")
    sts = find(objs, "StatefulSet", FULLNAME)
    spec = sts["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    expect("emptyDir" in vols["data"] and not sts["spec"].get("volumeClaimTemplates"),
           "data is not an emptyDir with persistence off")
    expect(vols["auth"]["secret"]["secretName"] == "my-agq-tokens", "existingSecret not mounted")
    expect(spec["serviceAccountName"] == "default", "serviceAccountName")
    pdb = find(objs, "PodDisruptionBudget", FULLNAME)
    expect(pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"],
           "server PDB selector")
    expect(pdb["spec"].get("minAvailable") == 1 and "maxUnavailable" not in pdb["spec"],
           f"server PDB on SQLite {pdb['spec']}, want minAvailable 1")


# ---------------------------------------------------------------- worker identity

SERVER_UID = 10001
# The workers' own uid: agw's --max-processes is RLIMIT_NPROC, which the
# kernel counts per uid over the whole node (every pod without a user
# namespace shares the host's), so the server's threads must not count
# against the tasks' limit.
WORKER_UID = 10002
# What a root agw (worker.runAs) needs, each for one thing it does to its
# tasks (src/worker/sandbox.rs, executor.rs): CHOWN to hand each job's
# scratch directory to the task user; SETUID, SETGID to switch the task to
# it (setgid, setgroups, setuid between fork and exec); KILL to kill the
# task's process group at its end, timeout or cancel (another uid);
# DAC_OVERRIDE and FOWNER to remove the scratch directory with what the
# task left in it (its 0700 directories, sticky ones included).
ROOT_AGW_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"]
ROOT_AGW_VALUES = {"worker": {"runAs": "nobody"}}


def pod_uid(obj: dict, cname: str) -> tuple[Any, Any, Any]:
    """(effective runAsUser, effective runAsGroup, fsGroup) of a container."""
    pod = obj["spec"]["template"]["spec"].get("securityContext") or {}
    sc = container(obj, cname).get("securityContext") or {}
    return (sc.get("runAsUser", pod.get("runAsUser")), sc.get("runAsGroup", pod.get("runAsGroup")),
            pod.get("fsGroup"))


def check_worker_uid(objs: list[dict]) -> None:
    """The worker pods run as a uid of their own, never the server's."""
    server = pod_uid(server_workload(objs), "agq")
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    worker = pod_uid(dep, "agw")
    expect(server == (SERVER_UID, SERVER_UID, SERVER_UID), f"server uid/gid/fsGroup {server}")
    expect(worker == (WORKER_UID, WORKER_UID, WORKER_UID), f"worker uid/gid/fsGroup {worker}")
    pod = dep["spec"]["template"]["spec"]["securityContext"]
    expect(pod.get("runAsUser") == worker[0],
           f"worker pod-level runAsUser {pod.get('runAsUser')} differs from the container's")
    expect(worker[0] != server[0], "the workers share the server's uid: its threads count "
           "against the tasks' RLIMIT_NPROC (--max-processes)")


def check_worker_root_mode(objs: list[dict], run_as: str = "nobody",
                           extra_caps: tuple[str, ...] = ()) -> None:
    """worker.runAs: agw as root with AGW_RUN_AS and only the capabilities
    it uses; the rest of the container's restrictions and the server stay."""
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    agw = container(dep, "agw")
    env = env_of(agw)
    expect(env.get("AGW_RUN_AS", {}).get("value") == run_as,
           f"AGW_RUN_AS {env.get('AGW_RUN_AS')}, want {run_as!r}")
    sc = agw["securityContext"]
    expect(sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is False,
           f"agw not root: runAsUser {sc.get('runAsUser')}, runAsNonRoot {sc.get('runAsNonRoot')}")
    caps = sc.get("capabilities") or {}
    expect(caps.get("drop") == ["ALL"], f"agw drops {caps.get('drop')}, want [ALL]")
    want = sorted(set(ROOT_AGW_CAPS) | set(extra_caps))
    expect(caps.get("add") == want, f"agw adds {caps.get('add')}, want {want}")
    expect(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True,
           f"root agw lost its other restrictions: {sc}")
    pod = dep["spec"]["template"]["spec"]["securityContext"]
    expect(pod.get("runAsNonRoot") is False and pod.get("runAsUser") == 0,
           f"worker pod securityContext {pod} contradicts the root container")
    expect(pod.get("seccompProfile", {}).get("type") == "RuntimeDefault",
           "root worker pod without the RuntimeDefault seccomp profile")
    srv = container(server_workload(objs), "agq")["securityContext"]
    expect(srv.get("runAsNonRoot") is True and srv.get("runAsUser") == SERVER_UID
           and srv.get("capabilities") == {"drop": ["ALL"]},
           f"worker.runAs changed the server: {srv}")


def check_run_as(helm: Helm) -> None:
    """worker.runAs renders the root mode, keeps capabilities the user adds
    (once), and refuses root as the task user."""
    objs, _ = helm.template(ROOT_AGW_VALUES)
    check_worker_root_mode(objs)
    objs, _ = helm.template(deep_merge(ROOT_AGW_VALUES, {"worker": {"securityContext": {
        "capabilities": {"add": ["KILL", "NET_BIND_SERVICE"]}}}}))
    check_worker_root_mode(objs, extra_caps=("NET_BIND_SERVICE",))
    msg = render_error(helm, {"worker": {"runAs": "root"}})
    expect("worker.runAs" in msg and "root" in msg, f"unhelpful failure for runAs=root: {msg}")


SECRET_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: secret-probe
data:
  secret: {{ include (print $.Template.BasePath "/secret.yaml") . | toJson }}
"""


def check_token_once(helm: Helm) -> None:
    """With auth.workerToken empty, a first install draws one token per
    render: the Secret and the checksum/auth annotations of the server and
    the workers all hold it, so the first upgrade (which finds it stored)
    changes no pod template and restarts nothing."""
    try:
        set_cluster(dict(LIVE_CLUSTER))
        with tempfile.TemporaryDirectory() as tmp:
            chart = Path(tmp, "agq")
            shutil.copytree(CHART, chart)
            (chart / "templates" / "zz-secret-probe.yaml").write_text(SECRET_PROBE)
            objs, _ = helm.template(None, chart)
        secret = find(objs, "Secret", f"{FULLNAME}-auth")
        text = find(objs, "ConfigMap", "secret-probe")["data"]["secret"]
        expect(yaml.safe_load(text) == secret,
               "secret.yaml included again renders another worker token than the Secret's")
        pods = {"server": server_workload(objs),
                "workers": find(objs, "Deployment", f"{FULLNAME}-worker")}
        want = hashlib.sha256(text.encode()).hexdigest()
        first = {}
        for who, obj in pods.items():
            first[who] = obj["spec"]["template"]["metadata"]["annotations"]["checksum/auth"]
            expect(first[who] == want,
                   f"the {who}' checksum/auth hashes another Secret than the one rendered")
        token = worker_token_of(objs)
        set_cluster({**LIVE_CLUSTER, **stored_secret(f"{FULLNAME}-auth", {"worker-token": token})})
        again, _ = helm.template(None)
        expect(worker_token_of(again) == token, "the upgrade did not keep the stored token")
        for who, obj in (("server", server_workload(again)),
                         ("workers", find(again, "Deployment", f"{FULLNAME}-worker"))):
            ann = obj["spec"]["template"]["metadata"]["annotations"]["checksum/auth"]
            expect(ann == first[who], f"the first upgrade changes the {who}' checksum/auth: "
                   "it would restart them for an unchanged Secret")
    finally:
        set_cluster(dict(LIVE_CLUSTER))


def check_schema_rejects(helm: Helm) -> None:
    for bad in ({"worker": {"replicas": "three"}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "root"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "worker"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "worker", "worker_id": "w1",
                                      "worker_id_prefix": "w-"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "admin",
                                      "worker_id_prefix": "w-"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "client", "worker_id": "w1"}]}},
                {"server": {"logFormat": "xml"}},
                {"console": {"enabled": "yes"}},
                {"console": {"listen": "0.0.0.0:6382"}},
                {"service": {"consolePort": 0}},
                {"autoscaling": {"keda": {"prometheusAddress": "prometheus:9090"}}},
                {"autoscaling": {"hpa": {"enabeld": True}}},
                {"autoscaling": {"maxReplicas": 0}},
                {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}},
                {"prometheusRule": {"deadJobs": {"for": "5 minutes"}}},
                {"prometheusRule": {"enqueueToLeaseP99": {"thresholdSeconds": 0}}},
                {"monitoring": {"selector": '{job="agq"}'}},
                {"store": {"type": "mysql"}},
                {"store": {"type": "postgres", "postgres": {"url": PG_URL, "password": "x"}}},
                {"store": {"postgres": {"secretKey": ""}}},
                {"store": {"postgres": {"secretKey": "a/b"}}},
                {"store": {"postgresql": {}}},
                {"server": {"replicas": "three"}},
                {"server": {"replicas": -1}},
                {"server": {"podDisruptionBudget": {"enabled": "yes"}}},
                {"worker": {"runAs": 65534}},
                {"worker": {"runAs": "no body"}}):
        try:
            helm.template(bad)
        except Exception as exc:  # noqa: BLE001
            expect("schema" in str(exc).lower(),
                   f"{bad} failed for another reason: {exc}")
        else:
            raise AssertionError(f"values {bad} were accepted")


# ---------------------------------------------------------------- new objects

EXTRA_VOLUME_VALUES = {
    "worker": {
        "readPaths": ["/inputs"],
        "extraVolumes": [{"name": "inputs",
                          "persistentVolumeClaim": {"claimName": "agq-inputs", "readOnly": True}}],
        "extraVolumeMounts": [{"name": "inputs", "mountPath": "/inputs", "readOnly": True}],
    },
}

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

# Every optional object on, with KEDA (HPA is the alternative below).
ALL_ON_KEDA = {
    "auth": {"workerToken": "ci-all-on-worker-token-0123456789"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "server": {"podDisruptionBudget": {"enabled": True}},
    "worker": dict(EXTRA_VOLUME_VALUES["worker"], podDisruptionBudget={"enabled": True}),
    "autoscaling": {"minReplicas": 0, "maxReplicas": 20,
                    "keda": {"enabled": True, "prometheusAddress": PROMETHEUS,
                             "authenticationRef": "prom-auth",
                             "extraTriggerMetadata": {"ignoreNullValues": "false"}}},
    "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1", "team": "infra"},
                         "annotations": {"grafana_folder": "AGQ"}, "namespace": "monitoring"},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                       "alertLabels": {"team": "infra"}},
}
ALL_ON_HPA = {
    **{k: v for k, v in ALL_ON_KEDA.items() if k != "autoscaling"},
    "worker": {"maxConcurrentJobs": 6},
    "autoscaling": {"minReplicas": 2, "maxReplicas": 30, "hpa": {"enabled": True}},
    "monitoring": {"selector": 'job="agq-ci"'},
}


def check_readme() -> None:
    sys.path.insert(0, str(HERE))
    import gen_readme  # noqa: PLC0415 - a sibling script

    missing = gen_readme.undocumented()
    expect(not missing, f"values without a `# --` comment: {missing}")
    docs = gen_readme.documented((CHART / "values.yaml").read_text())
    expect(all(d for _, d in docs), f"empty descriptions: {[k for k, d in docs if not d]}")
    readme = (CHART / "README.md").read_text()
    expect(readme == gen_readme.render(readme),
           "helm/agq/README.md is stale: run python3 helm/ci/gen_readme.py")
    for key, _ in docs:
        expect(f"\n| {key} |" in readme, f"{key} not in the README table")
    for key in ("auth.workerToken", "console.enabled", "service.consolePort",
                "autoscaling.keda.query", "grafanaDashboard.labels",
                "prometheusRule.enqueueToLeaseP99.thresholdSeconds", "worker.extraVolumes",
                "store.type", "store.postgres.existingSecret", "store.postgres.secretKey",
                "store.postgres.url", "server.replicas",
                "server.podDisruptionBudget.maxUnavailable"):
        expect(key in dict(docs), f"{key} undocumented")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_extra_volumes(objs: list[dict]) -> None:
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    spec = dep["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    expect(vols.get("inputs") == EXTRA_VOLUME_VALUES["worker"]["extraVolumes"][0],
           f"extra volume {vols.get('inputs')}")
    expect({"tmp", "worker-token", "inputs"} <= set(vols), f"worker volumes {sorted(vols)}")
    agw = container(dep, "agw")
    mounts = {m["name"]: m for m in agw["volumeMounts"]}
    expect(mounts.get("inputs") == {"name": "inputs", "mountPath": "/inputs", "readOnly": True},
           f"extra mount {mounts.get('inputs')}")
    expect(env_of(agw)["AGW_READ_PATHS"]["value"] == "/inputs", "AGW_READ_PATHS")
    expect(all(m["name"] in vols for m in agw["volumeMounts"]), "a mount without its volume")
    expect(len(vols) == len(spec["volumes"]), "duplicate volume names")


def check_keda(objs: list[dict], values: dict[str, Any]) -> None:
    a = values["autoscaling"]
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    expect("replicas" not in dep["spec"], "worker replicas rendered while KEDA owns them")
    so = find(objs, "ScaledObject", f"{FULLNAME}-worker")
    expect(so["apiVersion"] == "keda.sh/v1alpha1", so["apiVersion"])
    spec = so["spec"]
    expect(spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": dep["metadata"]["name"]},
           f"scaleTargetRef {spec['scaleTargetRef']}")
    expect((spec["minReplicaCount"], spec["maxReplicaCount"]) == (a["minReplicas"], a["maxReplicas"]),
           "min/max replica count")
    expect(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
           ["stabilizationWindowSeconds"] == 600, "scale-down behavior not passed on")
    [trig] = spec["triggers"]
    md = trig["metadata"]
    expect(trig["type"] == "prometheus" and trig.get("metricType") == "AverageValue",
           f"trigger {trig['type']}/{trig.get('metricType')}")
    expect(md["serverAddress"] == a["keda"]["prometheusAddress"], "serverAddress")
    want = f'sum(agq_queue_length{{queue="ready",namespace="{NAMESPACE}",service="{FULLNAME}"}})'
    expect(md["query"] == want, f"query {md['query']!r}, want {want!r}")
    jobs = values.get("worker", {}).get("maxConcurrentJobs", 4)
    expect(md["threshold"] == str(jobs), f"threshold {md['threshold']} != maxConcurrentJobs")
    expect(all(isinstance(v, str) for v in md.values()), f"non-string trigger metadata {md}")
    for k, v in a["keda"].get("extraTriggerMetadata", {}).items():
        expect(md.get(k) == v, f"extra trigger metadata {k}")
    if ref := a["keda"].get("authenticationRef"):
        expect(trig["authenticationRef"] == {"name": ref}, "authenticationRef")
    expect(not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"],
           "an HPA rendered beside the ScaledObject")


KEDA_OVERRIDE = {
    "monitoring": {"selector": 'job="agq"'},
    "autoscaling": {"targetReadyJobsPerWorker": 10,
                    "keda": {"enabled": True, "prometheusAddress": PROMETHEUS,
                             "query": 'sum(agq_queue_length{queue=~"ready|running",job="agq"})'}},
}


def check_keda_override(objs: list[dict]) -> None:
    so = find(objs, "ScaledObject", f"{FULLNAME}-worker")
    md = so["spec"]["triggers"][0]["metadata"]
    expect(md["query"] == KEDA_OVERRIDE["autoscaling"]["keda"]["query"], f"query {md['query']}")
    expect(md["threshold"] == "10", f"threshold {md['threshold']}, want targetReadyJobsPerWorker")
    expect("authenticationRef" not in so["spec"]["triggers"][0], "authenticationRef by default")
    expect((so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 10),
           "default min/max")


def check_hpa(objs: list[dict], values: dict[str, Any]) -> None:
    a = values["autoscaling"]
    dep = find(objs, "Deployment", f"{FULLNAME}-worker")
    expect("replicas" not in dep["spec"], "worker replicas rendered while the HPA owns them")
    hpa = find(objs, "HorizontalPodAutoscaler", f"{FULLNAME}-worker")
    expect(hpa["apiVersion"] == "autoscaling/v2", hpa["apiVersion"])
    spec = hpa["spec"]
    expect(spec["scaleTargetRef"]["name"] == dep["metadata"]["name"]
           and spec["scaleTargetRef"]["kind"] == "Deployment", "scaleTargetRef")
    expect((spec["minReplicas"], spec["maxReplicas"]) == (a["minReplicas"], a["maxReplicas"]),
           "min/max replicas")
    [m] = spec["metrics"]
    expect(m["type"] == "External", f"metric type {m['type']}")
    ext = m["external"]
    expect(ext["metric"]["name"] == "agq_queue_length", f"metric {ext['metric']['name']}")
    expect(ext["metric"]["selector"]["matchLabels"] == {"queue": "ready", "service": FULLNAME},
           f"selector {ext['metric']['selector']}")
    jobs = values.get("worker", {}).get("maxConcurrentJobs", 4)
    expect(ext["target"] == {"type": "AverageValue", "averageValue": str(jobs)},
           f"target {ext['target']}")
    expect(spec["behavior"]["scaleDown"]["policies"][0]["type"] == "Pods", "behavior")
    expect(not [o for o in objs if o["kind"] == "ScaledObject"], "a ScaledObject beside the HPA")


def check_dashboard_file() -> None:
    dash = json.loads(DASHBOARD.read_text())
    expect(dash.get("uid") and dash.get("title") and dash.get("schemaVersion"), "uid/title/schema")
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    expect(len(ids) == len(set(ids)), f"duplicate panel ids {ids}")
    tvars = {v["name"]: v for v in dash["templating"]["list"]}
    expect(tvars["datasource"]["type"] == "datasource"
           and tvars["datasource"]["query"] == "prometheus", "no Prometheus datasource variable")
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        expect(0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, f"panel {p['id']} gridPos {g}")
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        expect(not mine & cells, f"panel {p['title']!r} overlaps another")
        cells |= mine
        expect(p["datasource"]["uid"] == "${datasource}", f"panel {p['title']!r} datasource")
        expect(p.get("targets"), f"panel {p['title']!r} has no queries")
        refs = [t["refId"] for t in p["targets"]]
        expect(len(refs) == len(set(refs)), f"panel {p['title']!r} refIds {refs}")
        for t in p["targets"]:
            balanced(t["expr"])
            expect('job=~"$job"' in t["expr"], f"{t['expr']!r} ignores the job variable")
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needle in ('sum by (queue) (agq_queue_length', 'sum by (status) (rate(agq_jobs_total',
                   'histogram_quantile(0.5, sum by (le) (rate(agq_enqueue_to_lease_seconds_bucket',
                   'histogram_quantile(0.99, sum by (le) (rate(agq_enqueue_to_lease_seconds_bucket',
                   'agq_job_duration_seconds_bucket', 'sum by (state, fresh) (agq_workers',
                   'sum by (reason) (rate(agq_requeues_total', 'agq_fencing_rejections_total',
                   'sum by (method, code) (rate(agq_rpc_requests_total',
                   'agq_commit_batch_ops', 'agq_store_write_errors_total',
                   'histogram_quantile(0.99, sum by (le) (rate(agq_store_commit_seconds_bucket'):
        expect(needle in exprs, f"no dashboard query with {needle!r}")


def balanced(expr: str) -> None:
    stack = []
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            expect(stack and "([{"[")]}".index(ch)] == stack.pop(), f"unbalanced {expr!r}")
    expect(not stack, f"unbalanced {expr!r}")


def check_dashboard_configmap(objs: list[dict], values: dict[str, Any]) -> None:
    g = values["grafanaDashboard"]
    cm = find(objs, "ConfigMap", f"{FULLNAME}-dashboard")
    for k, v in g["labels"].items():
        expect(cm["metadata"]["labels"].get(k) == v, f"dashboard label {k}")
    expect(cm["metadata"]["labels"].get("grafana_dashboard") == "1", "no sidecar label")
    expect(cm["metadata"].get("annotations", {}) == g.get("annotations", {}), "annotations")
    expect(cm["metadata"].get("namespace") == (g.get("namespace") or None), "namespace")
    expect(list(cm["data"]) == ["agq.json"], f"data keys {list(cm['data'])}")
    expect(json.loads(cm["data"]["agq.json"]) == json.loads(DASHBOARD.read_text()),
           "ConfigMap JSON differs from dashboards/agq.json")


ALERTS = {"AgqNoFreshWorkers", "AgqDeadJobsRising", "AgqEnqueueToLeaseP99High",
          "AgqStoreWriteErrors"}


def check_prometheus_rule(objs: list[dict], selector: str) -> None:
    pr = find(objs, "PrometheusRule", FULLNAME)
    expect(pr["apiVersion"] == "monitoring.coreos.com/v1", pr["apiVersion"])
    expect(pr["metadata"]["labels"].get("release") == "prometheus", "rule labels")
    rules = [r for g in pr["spec"]["groups"] for r in g["rules"]]
    by = {r["alert"]: r for r in rules}
    expect(set(by) == ALERTS and len(rules) == len(ALERTS), f"alerts {sorted(by)}")
    for name, r in by.items():
        expr = r["expr"]
        balanced(expr)
        expect(r["labels"]["severity"] in ("warning", "critical"), f"{name} severity")
        expect(r["labels"].get("team") == "infra", f"{name} lacks alertLabels")
        expect(re.fullmatch(r"\d+[smh]", r["for"]), f"{name} for {r['for']!r}")
        expect("{{ $value" in r["annotations"]["description"], f"{name}: $value not escaped")
        for sel in re.findall(r"agq_\w+\{([^}]*)\}", expr):
            expect(selector in sel, f"{name}: selector {sel!r} lacks {selector!r}")
    nf = by["AgqNoFreshWorkers"]["expr"]
    expect('agq_queue_length{queue="ready"' in nf and 'state="active",fresh="true"' in nf
           and "unless" in nf, f"AgqNoFreshWorkers {nf!r}")
    expect('status="dead"' in by["AgqDeadJobsRising"]["expr"], "dead jobs alert")
    p99 = by["AgqEnqueueToLeaseP99High"]["expr"]
    expect(p99.startswith("histogram_quantile(0.99, sum by (le) (rate(agq_enqueue_to_lease_seconds_bucket")
           and p99.endswith("> 30"), f"p99 alert {p99!r}")
    expect("agq_store_write_errors_total" in by["AgqStoreWriteErrors"]["expr"], "store alert")


def check_mutually_exclusive(helm: Helm) -> None:
    both = {"autoscaling": {"keda": {"enabled": True, "prometheusAddress": PROMETHEUS},
                            "hpa": {"enabled": True}}}
    try:
        helm.template(both)
    except Exception as exc:  # noqa: BLE001
        expect("alternatives" in str(exc), f"failed for another reason: {exc}")
    else:
        raise AssertionError("KEDA and HPA together rendered")
    for bad, why in (({"autoscaling": {"keda": {"enabled": True}}}, "prometheusAddress is required"),
                     ({"autoscaling": {"minReplicas": 0, "hpa": {"enabled": True}}},
                      "at least 1")):
        try:
            helm.template(bad)
        except Exception as exc:  # noqa: BLE001
            expect(why in str(exc), f"{bad} failed for another reason: {exc}")
        else:
            raise AssertionError(f"{bad} rendered")


def check_defaults_off(objs: list[dict]) -> None:
    kinds = {o["kind"] for o in objs}
    for kind in ("ScaledObject", "HorizontalPodAutoscaler", "PrometheusRule"):
        expect(kind not in kinds, f"{kind} rendered by default")
    expect(not any(o["kind"] == "ConfigMap" for o in objs), "dashboard ConfigMap by default")


# ---------------------------------------------------------------- PostgreSQL

PG_VALUES = HERE / "values-postgres.yaml"
# store.postgres.url: the chart renders the Secret <full name>-store.
PG_URL = "postgres://agq:ci-Pg-Passw0rd@pg-rw.agq-ci.svc:5432/agq?sslmode=require"
PG_URL_VALUES = {"store": {"type": "postgres", "postgres": {"url": PG_URL}},
                 "auth": {"workerToken": "ci-pg-url-worker-token-0123456789"}}


def check_pg_workload(objs: list[dict], replicas: int = 3) -> None:
    """A Deployment, not a StatefulSet; N replicas; nothing on disk; a
    surge-only rolling update; replicas spread over nodes."""
    dep = server_workload(objs)
    expect(dep["kind"] == "Deployment", f"server is a {dep['kind']}, want a Deployment")
    expect(not [o for o in objs if o["kind"] == "StatefulSet"], "a StatefulSet rendered")
    expect(dep["metadata"]["labels"].get("app.kubernetes.io/component") == "server",
           "server Deployment not labelled component=server")
    spec = dep["spec"]
    expect(spec["replicas"] == replicas, f"server replicas {spec['replicas']}, want {replicas}")
    expect(spec.get("strategy") == {"type": "RollingUpdate",
                                    "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
           f"strategy {spec.get('strategy')}, want RollingUpdate maxUnavailable 0 maxSurge 1")
    expect("volumeClaimTemplates" not in spec, "volumeClaimTemplates on a Deployment")
    expect(not [o for o in objs if o["kind"] == "PersistentVolumeClaim"], "a PVC rendered")
    pod = spec["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes") or []}
    expect(not [v for v in vols.values() if "persistentVolumeClaim" in v or "hostPath" in v],
           f"a persistent volume in the server pod: {sorted(vols)}")
    expect("data" not in vols, "a data volume in the server pod")
    agq = container(dep, "agq")
    mounts = {m["mountPath"] for m in agq.get("volumeMounts") or []}
    expect("/data" not in mounts, "/data mounted in the clustered mode")
    expect("AGQ_DB" not in env_of(agq), "AGQ_DB set in the clustered mode")
    labels = spec["template"]["metadata"]["labels"]
    sel = spec["selector"]["matchLabels"]
    expect(all(labels.get(k) == v for k, v in sel.items()), "selector does not match the pods")
    terms = (pod.get("affinity", {}).get("podAntiAffinity", {})
             .get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    expect(len(terms) == 1, f"pod anti-affinity {pod.get('affinity')}")
    term = terms[0]["podAffinityTerm"]
    expect(term["topologyKey"] == "kubernetes.io/hostname"
           and term["labelSelector"]["matchLabels"] == sel,
           f"anti-affinity term {term}, want the server pods across kubernetes.io/hostname")
    expect("requiredDuringSchedulingIgnoredDuringExecution"
           not in pod["affinity"]["podAntiAffinity"], "required (not preferred) anti-affinity")


def check_pg_store_env(objs: list[dict], secret: str, key: str) -> None:
    """AGQ_STORE from a secretKeyRef; the URL in no plain env value, args,
    annotation or ConfigMap: only in a Secret."""
    dep = server_workload(objs)
    env = env_of(container(dep, "agq"))
    store = env.get("AGQ_STORE")
    expect(store and "value" not in store, f"AGQ_STORE {store}: want valueFrom only")
    ref = store["valueFrom"].get("secretKeyRef")
    expect(ref == {"name": secret, "key": key},
           f"AGQ_STORE secretKeyRef {ref}, want {{name: {secret}, key: {key}}}")
    for o in objs:
        if o["kind"] == "Secret":
            continue
        text = json.dumps(o)
        expect("postgres://" not in text and "postgresql://" not in text
               and "ci-Pg-Passw0rd" not in text,
               f"the PostgreSQL URL appears in {o['kind']} {o['metadata']['name']}")


def check_pg_url_secret(objs: list[dict]) -> None:
    name = f"{FULLNAME}-store"
    sec = find(objs, "Secret", name)
    expect(sec.get("type") == "Opaque" and sec.get("stringData") == {"url": PG_URL},
           f"store Secret {sec.get('type')} with keys {sorted(sec.get('stringData') or {})}")
    check_pg_store_env(objs, name, "url")
    ann = server_workload(objs)["spec"]["template"]["metadata"].get("annotations") or {}
    expect("checksum/store" in ann, "no checksum/store annotation to roll the servers")


def check_pg_existing_secret(objs: list[dict], values: dict[str, Any]) -> None:
    pg = values["store"]["postgres"]
    check_pg_store_env(objs, pg["existingSecret"], pg["secretKey"])
    expect(not [o for o in objs if o["metadata"]["name"] == f"{FULLNAME}-store"],
           "the chart rendered a store Secret beside existingSecret")
    ann = server_workload(objs)["spec"]["template"]["metadata"].get("annotations") or {}
    expect("checksum/store" not in ann, "checksum/store of a Secret the chart does not render")


def check_pg_pdb(objs: list[dict], want: dict[str, Any] | None = None) -> None:
    dep = server_workload(objs)
    pdb = find(objs, "PodDisruptionBudget", FULLNAME)
    expect(pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"],
           "server PDB selector differs from the Deployment's")
    got = {k: v for k, v in pdb["spec"].items() if k in ("minAvailable", "maxUnavailable")}
    expect(got == (want or {"maxUnavailable": 1}), f"server PDB {got}")


def check_pg_service_monitor(objs: list[dict]) -> None:
    sm = find(objs, "ServiceMonitor", FULLNAME)
    svc = find(objs, "Service", FULLNAME)
    sel = sm["spec"]["selector"]["matchLabels"]
    selected = [o for o in objs if o["kind"] == "Service"
                and all(o["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    expect(selected == [svc], f"ServiceMonitor selects {[o['metadata']['name'] for o in selected]}")
    expect([e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"], "ServiceMonitor port")


def check_pg_worker_pool(objs: list[dict]) -> None:
    """The workers still dial the one Service, whose pods are the replicas."""
    check_worker(objs, 2, None, "4")
    dep = server_workload(objs)
    svc = find(objs, "Service", FULLNAME)
    expect(svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"],
           "Service does not select the server Deployment")
    workers = find(objs, "Deployment", f"{FULLNAME}-worker")
    wl = workers["spec"]["template"]["metadata"]["labels"]
    expect(not all(wl.get(k) == v for k, v in svc["spec"]["selector"].items()),
           "the server Service selects the worker pods")


def check_pg_queries(objs: list[dict]) -> None:
    """Every replica reports the shared database's depths: the default KEDA
    query and AgqNoFreshWorkers take max over them, not sum."""
    so = find(objs, "ScaledObject", f"{FULLNAME}-worker")
    q = so["spec"]["triggers"][0]["metadata"]["query"]
    want = f'max(agq_queue_length{{queue="ready",namespace="{NAMESPACE}",service="{FULLNAME}"}})'
    expect(q == want, f"query {q!r}, want {want!r}")
    pr = find(objs, "PrometheusRule", FULLNAME)
    rules = {r["alert"]: r for g in pr["spec"]["groups"] for r in g["rules"]}
    nf = rules["AgqNoFreshWorkers"]["expr"]
    expect(nf.startswith("max(agq_queue_length{") and "max(agq_workers{" in nf
           and "sum(" not in nf, f"AgqNoFreshWorkers {nf!r}")
    desc = rules["AgqStoreWriteErrors"]["annotations"]["description"]
    expect("PostgreSQL" in desc and "volume" not in desc, f"store alert text {desc!r}")


def render_error(helm: Helm, values: dict[str, Any]) -> str:
    try:
        helm.template(values)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    raise AssertionError(f"values {values} rendered")


def check_store_fails(helm: Helm) -> None:
    """Bad store settings fail the render with a message that says what to
    set, and never print the URL (it holds a password)."""
    pg = {"type": "postgres"}
    cases = [
        ({"store": pg}, ["store.type=postgres needs the database URL",
                         "store.postgres.existingSecret", "store.postgres.url", "uri"]),
        ({"server": {"replicas": 2}}, ["server.replicas=2 needs store.type=postgres", "SQLite"]),
        ({"server": {"replicas": 3}, "persistence": {"existingClaim": "agq-data"}},
         ["server.replicas=3 needs store.type=postgres"]),
        ({"store": {**pg, "postgres": {"url": PG_URL, "existingSecret": "pg-app"}}},
         ["alternatives", "not both"]),
        ({"store": {**pg, "postgres": {"url": "mysql://agq:ci-Pg-Passw0rd@db/agq"}}},
         ["must start with postgres://, postgresql:// or host="]),
        ({"store": {"postgres": {"url": PG_URL}}}, ["store.type is sqlite", "store.type=postgres"]),
        ({"store": {"postgres": {"existingSecret": "pg-app"}}}, ["store.type is sqlite"]),
        ({**PG_URL_VALUES, "server": {"podDisruptionBudget": {"minAvailable": 2,
                                                              "maxUnavailable": 1}}},
         ["at most one of minAvailable and maxUnavailable"]),
    ]
    for values, want in cases:
        msg = render_error(helm, values)
        expect("schema" not in msg.lower(), f"{values} failed on the schema, not a fail: {msg}")
        for text in want:
            expect(text in msg, f"{values}: message lacks {text!r}: {msg}")
        expect("ci-Pg-Passw0rd" not in msg, f"{values}: the message shows the password")


def check_store_accepts(helm: Helm) -> None:
    """Replica counts and PDB settings each mode takes."""
    objs, _ = helm.template({"server": {"replicas": 1}, "auth": {"workerToken": "x" * 32}})
    expect(find(objs, "StatefulSet", FULLNAME)["spec"]["replicas"] == 1, "sqlite replicas 1")
    objs, _ = helm.template({"server": {"replicas": 0}, "auth": {"workerToken": "x" * 32}})
    expect(find(objs, "StatefulSet", FULLNAME)["spec"]["replicas"] == 0, "sqlite replicas 0")
    for k in ("host=pg-rw dbname=agq user=agq", "postgresql://agq@pg/agq"):
        objs, _ = helm.template(deep_merge(PG_URL_VALUES, {"store": {"postgres": {"url": k}}}))
        expect(find(objs, "Secret", f"{FULLNAME}-store")["stringData"]["url"] == k, k)
    objs, _ = helm.template(deep_merge(PG_URL_VALUES, {"server": {"replicas": 5}}))
    check_pg_workload(objs, replicas=5)
    objs, _ = helm.template(deep_merge(PG_URL_VALUES,
                                       {"server": {"podDisruptionBudget": {"enabled": False}}}))
    expect(not [o for o in objs if o["kind"] == "PodDisruptionBudget"], "PDB with enabled=false")
    objs, _ = helm.template(deep_merge(PG_URL_VALUES,
                                       {"server": {"podDisruptionBudget": {"minAvailable": 2}}}))
    check_pg_pdb(objs, {"minAvailable": 2})
    objs, _ = helm.template(deep_merge(PG_URL_VALUES, {"server": {"affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": ["agq"]}]}]}}}}}))
    aff = server_workload(objs)["spec"]["template"]["spec"]["affinity"]
    expect(list(aff) == ["nodeAffinity"], f"server.affinity does not replace the default: {aff}")


# ---------------------------------------------------------------- the token


def worker_token_of(objs: list[dict]) -> str:
    return find(objs, "Secret", f"{FULLNAME}-auth")["stringData"]["worker-token"]


def check_token_stability(helm: Helm) -> None:
    """The worker token never changes between renders of the same inputs."""
    try:
        # No cluster behind `lookup` (helm template, Argo CD): no token set
        # must fail with a message naming the values to set...
        set_cluster({})
        try:
            helm.template(None)
        except Exception as exc:  # noqa: BLE001
            msg = str(exc)
            expect("auth.workerToken" in msg and "auth.existingSecret" in msg
                   and "openssl rand" in msg, f"unhelpful failure: {msg}")
        else:
            raise AssertionError("rendered a random worker token without a cluster")
        # ...while a set token, or existingSecret, renders identically twice.
        values = {"auth": {"workerToken": "gitops-worker-token-0123456789"}}
        a, b = helm.template(values)[0], helm.template(values)[0]
        expect(a == b, "two renders with auth.workerToken differ")
        expect(worker_token_of(a) == "gitops-worker-token-0123456789", "workerToken not used")
        a = helm.template({"auth": {"existingSecret": "mine"}})[0]
        expect(a == helm.template({"auth": {"existingSecret": "mine"}})[0],
               "two renders with existingSecret differ")
        # An upgrade keeps the token stored in the release's Secret.
        set_cluster({**LIVE_CLUSTER, **stored_secret(f"{FULLNAME}-auth",
                                                     {"worker-token": "stored-token-" + "x" * 40})})
        a, b = helm.template(None)[0], helm.template(None)[0]
        expect(worker_token_of(a) == worker_token_of(b) == "stored-token-" + "x" * 40,
               "an upgrade does not keep the stored worker token")
        # A first install against a live cluster generates one.
        set_cluster(dict(LIVE_CLUSTER))
        tok = worker_token_of(helm.template(None)[0])
        expect(len(tok) == 48 and tok.isalnum(), "no generated token on a first install")
    finally:
        set_cluster(dict(LIVE_CLUSTER))


# ---------------------------------------------------------------- live metrics


def agq_binary() -> Path:
    if env := os.environ.get("AGQ_BIN"):
        return Path(env)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    return target / "debug" / "agq"


def parse_metrics(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Series names (with their family type) and each one's label names."""
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind == "counter":
                series = [name if name.endswith("_total") else name + "_total"]
            elif kind == "histogram":
                series = [name + s for s in ("_bucket", "_sum", "_count")]
            elif kind == "summary":
                series = [name, name + "_sum", name + "_count"]
            elif kind == "info":
                series = [name + "_info", name]
            else:
                series = [name]
            for s in series:
                types[s] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
            expect(m, f"unparsable sample line {line!r}")
            types.setdefault(m.group(1), "untyped")
            labels.setdefault(m.group(1), set()).update(
                re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
    return types, labels


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
        return resp.read().decode()


def live_metrics() -> str:
    """Start `agq serve` on loopback, drive one job to dead through a real
    agw (so every labelled family has samples), return /metrics."""
    agq = agq_binary()
    agw = Path(os.environ.get("AGW_BIN") or agq.with_name("agw"))
    expect(agq.is_file() and agw.is_file(),
           f"{agq} or {agw} missing: `cargo build` first, or set AGQ_BIN/AGW_BIN")
    tmp = tempfile.mkdtemp(prefix="agq-metrics-")
    procs: list[subprocess.Popen] = []
    try:
        log = open(Path(tmp, "serve.log"), "w+")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [str(agq), "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             # several servers may run at once: not the default 6382
             "--console-listen", "127.0.0.1:0",
             "--db", str(Path(tmp, "agq.db"))],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"}))
        grpc = metrics = None
        for _ in range(300):
            out = Path(tmp, "serve.log").read_text()
            grpc = grpc or (m.group(1) if (m := re.search(r"listening on (\S+)", out)) else None)
            metrics = metrics or (m.group(1) if (m := re.search(r"metrics on (\S+)", out)) else None)
            if grpc and metrics or procs[0].poll() is not None:
                break
            time.sleep(0.1)
        expect(grpc and metrics, f"agq serve printed no addresses: {out[-2000:]}")
        url = metrics if metrics.startswith("http") else f"http://{metrics}/metrics"
        server = f"http://{grpc}"
        plan = Path(tmp, "plan.json")
        plan.write_text(json.dumps({"plan_id": "ci-metrics", "tasks": [
            {"task_number": 1, "command": "false", "args": [], "timeout_secs": 10}]}))
        cli = [str(agq), "--server", server]
        for args in (["plan", "submit", str(plan)],
                     ["action", "submit", "--plan", "ci-metrics", "--input", "x=1",
                      "--max-attempts", "1"]):
            subprocess.run(cli + args, check=True, capture_output=True, timeout=30)
        procs.append(subprocess.Popen(
            [str(agw), "--server", server, "--worker-id", "ci-metrics", "--tools", "false",
             "--insecure-no-sandbox"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while True:
            text = scrape(url)
            if ('agq_jobs_total{status="dead"}' in text
                    and "agq_requeues_total{" in text):
                return text
            expect(time.time() < deadline, "the job did not go dead within 60s")
            time.sleep(0.2)
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                "and", "or", "unless", "offset"}


def promql_uses(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """Metric names, (metric, matcher label names) pairs and grouping labels
    in a PromQL expression (or a Grafana label_values() query)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    lv = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", bare)
    groups: set[str] = set()
    if lv:
        bare, groups = lv.group(1), {lv.group(2)}
    names = set(re.findall(r"\b(agq_\w+)", bare))
    names |= {n for n in re.findall(r"\b([a-zA-Z_:][\w:]*)\s*(?=[{\[])", bare)
              if n not in PROMQL_WORDS}
    sels = [(n, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body)))
            for n, body in re.findall(r"\b([a-zA-Z_:][\w:]*)\{([^}]*)\}", bare)]
    for g in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", bare):
        groups |= {x.strip() for x in g.split(",") if x.strip()}
    return names, sels, groups


def rendered_queries(objs: list[dict]) -> dict[str, str]:
    out: dict[str, str] = {}
    for o in objs:
        if o["kind"] == "PrometheusRule":
            for g in o["spec"]["groups"]:
                for r in g["rules"]:
                    out[f"PrometheusRule {r['alert']}"] = r["expr"]
        elif o["kind"] == "ScaledObject":
            for t in o["spec"]["triggers"]:
                out["ScaledObject query"] = t["metadata"]["query"]
        elif o["kind"] == "HorizontalPodAutoscaler":
            for m in o["spec"]["metrics"]:
                metric = m["external"]["metric"]
                labels = ",".join(f'{k}=""' for k in metric["selector"]["matchLabels"])
                out["HPA external metric"] = f"{metric['name']}{{{labels}}}"
    return out


def check_live_metrics(queries: dict[str, str]) -> None:
    types, labels = parse_metrics(live_metrics())
    expect("agq_queue_length" in types and "agq_requeues_total" in labels, "scrape looks empty")
    problems = []
    for where, expr in queries.items():
        names, sels, groups = promql_uses(expr)
        expect(names, f"{where}: no metric in {expr!r}")
        for n in names:
            if n not in types:
                problems.append(f"{where}: {n} is not on /metrics")
        for n, used in sels:
            if n in labels:
                extra = used - labels[n] - TARGET_LABELS
                if extra:
                    problems.append(f"{where}: {n} has no label(s) {sorted(extra)}")
        known = set().union(*(labels.get(n, set()) for n in names)) | TARGET_LABELS
        if all(n in labels for n in names) and groups - known:
            problems.append(f"{where}: grouping by {sorted(groups - known)}, not a label of "
                            f"{sorted(names)}")
    expect(not problems, "; ".join(problems))


def main() -> int:
    # Keep Helm away from the user's own config, cache and clusters.
    scratch = tempfile.mkdtemp(prefix="agq-helm-")
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        os.environ[var] = os.path.join(scratch, var.lower())
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    os.environ.pop("KUBECONFIG", None)

    def watchdog() -> None:
        print(f"FAIL watchdog: no result after {WATCHDOG_SECS}s", flush=True)
        print("helm-chart: 0 passed, 1 failed", flush=True)
        os._exit(1)

    timer = threading.Timer(WATCHDOG_SECS, watchdog)
    timer.daemon = True
    timer.start()

    server, kubeconfig = start_fake_kube()
    helm = Helm(kubeconfig)
    checks = Checks()
    auth_values = yaml.safe_load(AUTH_VALUES.read_text())
    pg_values = yaml.safe_load(PG_VALUES.read_text())
    rendered: dict[str, tuple[list[dict], list[dict]]] = {}

    def lint() -> None:
        result = helm.lint()
        msgs = result.get("Messages") or []
        worst = {m.get("Path"): m.get("Severity") for m in msgs if m.get("Severity", 0) >= 2}
        # helm-sdkpy returns each lint message's severity and path but not its
        # text; the render checks below print Helm's own error messages.
        expect(not result.get("Errors") and not worst,
               f"lint warnings/errors (severity by path) {worst}, "
               f"{len(result.get('Errors') or [])} errors")

    def render(label: str, values: dict[str, Any] | None) -> Callable[[], None]:
        def go() -> None:
            rendered[label] = helm.template(values)
            if dump := os.environ.get("AGQ_CHART_DUMP"):
                Path(dump).mkdir(parents=True, exist_ok=True)
                Path(dump, f"{label}.yaml").write_text(
                    yaml.safe_dump_all(rendered[label][0] + rendered[label][1], sort_keys=False))
        return go

    checks.run("helm lint helm/agq", lint)

    def lint_with(values: dict[str, Any]) -> None:
        """`helm lint` of a scratch copy whose values.yaml has `values` merged in."""
        with tempfile.TemporaryDirectory() as tmp:
            chart = Path(tmp, "agq")
            shutil.copytree(CHART, chart)
            merged = deep_merge(yaml.safe_load((CHART / "values.yaml").read_text()), values)
            (chart / "values.yaml").write_text(yaml.safe_dump(merged))
            result = asyncio.run(helm.sdk.Lint(helm.config).run(str(chart)))
        msgs = result.get("Messages") or []
        worst = {m.get("Path"): m.get("Severity") for m in msgs if m.get("Severity", 0) >= 2}
        expect(not result.get("Errors") and not worst,
               f"lint warnings/errors (severity by path) {worst}, {result.get('Errors')}")
    checks.run("render default values", render("default", None))
    checks.run("render values-auth.yaml", render("auth", auth_values))
    checks.run("render auth.enabled=false", render("insecure", {"auth": {"enabled": False}}))
    checks.run("render existingSecret, no persistence, no workers", render("edge", EDGE_VALUES))
    checks.run("render console.enabled=false", render("console-off", CONSOLE_OFF))
    checks.run("render console.enabled=false, auth.enabled=false",
               render("console-off-insecure", CONSOLE_OFF_INSECURE))
    checks.run("render service.consolePort=8082", render("console-port", CONSOLE_PORT_VALUES))

    def on(label: str, fn: Callable[[list[dict]], None]) -> Callable[[], None]:
        def go() -> None:
            expect(label in rendered, f"{label} did not render")
            fn(rendered[label][0])
        return go

    auth_worker = auth_values["worker"]
    for label in ("default", "auth"):
        checks.run(f"{label}: StatefulSet probes are grpc on port {GRPC_PORT}",
                   on(label, check_probes))
        checks.run(f"{label}: container ports 6380/6381/6382, Service ports grpc/metrics/console",
                   on(label, check_ports))
        checks.run(f"{label}: securityContext non-root, read-only root, drop ALL",
                   on(label, check_security))
    checks.run("default: volumeClaimTemplates for /data, replicas 1",
               on("default", check_default_storage))
    checks.run("default: worker grace period > drain timeout (300)",
               on("default", lambda o: check_grace(o, 300)))
    checks.run("default: worker Deployment env (server, worker id, jobs), sandbox on, non-root",
               on("default", lambda o: check_worker(o, 2, None, "4")))
    checks.run("default: auth Secret mounted as AGQ_AUTH_FILE; workers hold only a pool token file",
               on("default", lambda o: check_auth(o, [], None)))
    checks.run("default: no ServiceMonitor, no PodDisruptionBudget",
               on("default", lambda o: check_optional(o, False)))
    checks.run("default: helm test pod checks grpc.health.v1 on the Service",
               lambda: (expect("default" in rendered, "default did not render"),
                        check_test_hook(rendered["default"][1])))
    checks.run("auth: existingClaim used, no volumeClaimTemplates",
               on("auth", check_existing_claim))
    checks.run("auth: 3 worker replicas, tools, max concurrent jobs, sandbox on, non-root",
               on("auth", lambda o: check_worker(o, 3, ",".join(auth_worker["tools"]),
                                                 str(auth_worker["maxConcurrentJobs"]))))
    checks.run(f"auth: worker grace period > drain timeout ({auth_worker['drainTimeoutSecs']})",
               on("auth", lambda o: check_grace(o, auth_worker["drainTimeoutSecs"])))
    checks.run("auth: Secret holds every token; workers hold only their pool token (no admin)",
               on("auth", lambda o: check_auth(o, auth_values["auth"]["tokens"],
                                               auth_values["auth"]["workerToken"])))
    checks.run("auth: ServiceMonitor on metrics port, worker PodDisruptionBudget",
               on("auth", lambda o: check_optional(o, True)))
    checks.run("auth.enabled=false: AGQ_INSECURE=true, no Secret, no worker token",
               on("insecure", check_insecure))
    for label in ("default", "auth", "edge"):
        checks.run(f"{label}: console on 0.0.0.0:{CONSOLE_PORT}, container and Service port "
                   "`console` (auth on)", on(label, lambda o: check_console(o, "public")))
    checks.run("console-port: Service port `console` 8082 -> container port 6382",
               on("console-port", lambda o: check_console(o, "public", 8082)))
    checks.run("auth.enabled=false: console on the pod's loopback, no container or Service port",
               on("insecure", lambda o: check_console(o, "loopback")))
    for label in ("console-off", "console-off-insecure"):
        checks.run(f"{label}: AGQ_NO_CONSOLE=true, no console port",
                   on(label, lambda o: check_console(o, "off")))
    checks.run("existingSecret, persistence off, workers off, server PDB",
               on("edge", check_edge))
    checks.run("default: no ScaledObject, HPA, PrometheusRule or dashboard ConfigMap",
               on("default", check_defaults_off))
    for label, values in (("all-on-keda", ALL_ON_KEDA), ("all-on-hpa", ALL_ON_HPA)):
        checks.run(f"helm lint helm/agq with every option on ({label})",
                   lambda values=values: lint_with(values))
        checks.run(f"render {label}", render(label, values))
    checks.run("render worker extraVolumes/extraVolumeMounts",
               render("extra-volumes", EXTRA_VOLUME_VALUES))
    checks.run("extra-volumes: the volume, its read-only mount, AGW_READ_PATHS",
               on("extra-volumes", check_extra_volumes))
    checks.run("all-on-keda: extraVolumes render beside every other option",
               on("all-on-keda", check_extra_volumes))
    checks.run("all-on-keda: ScaledObject on the ready depth, Deployment without replicas",
               on("all-on-keda", lambda o: check_keda(o, ALL_ON_KEDA)))
    checks.run("render KEDA with autoscaling.keda.query and targetReadyJobsPerWorker",
               render("keda-override", KEDA_OVERRIDE))
    checks.run("keda-override: the ScaledObject uses the query and target given",
               on("keda-override", check_keda_override))
    checks.run("all-on-hpa: autoscaling/v2 HPA on the External ready depth metric",
               on("all-on-hpa", lambda o: check_hpa(o, ALL_ON_HPA)))
    checks.run("KEDA and HPA are exclusive; KEDA needs a Prometheus; HPA min >= 1",
               lambda: check_mutually_exclusive(helm))
    checks.run("dashboards/agq.json: valid JSON, panels, queries for every topic",
               check_dashboard_file)
    checks.run("all-on-keda: dashboard ConfigMap with the sidecar label holds agq.json",
               on("all-on-keda", lambda o: check_dashboard_configmap(o, ALL_ON_KEDA)))
    checks.run("all-on-keda: PrometheusRule alerts on this release's series",
               on("all-on-keda", lambda o: check_prometheus_rule(
                   o, f'namespace="{NAMESPACE}",service="{FULLNAME}"')))
    checks.run("all-on-hpa: PrometheusRule alerts use monitoring.selector",
               on("all-on-hpa", lambda o: check_prometheus_rule(
                   o, ALL_ON_HPA["monitoring"]["selector"])))
    checks.run("worker token is stable under helm template (set, stored, or fail)",
               lambda: check_token_stability(helm))
    checks.run("worker token drawn once per render: the Secret and both checksum/auth "
               "annotations agree, and the first upgrade restarts nothing",
               lambda: check_token_once(helm))
    for label in ("default", "auth"):
        checks.run(f"{label}: worker pods run as uid {WORKER_UID}, not the server's {SERVER_UID}",
                   on(label, check_worker_uid))
    checks.run("worker.runAs=nobody: agw root with AGW_RUN_AS and only "
               f"{','.join(ROOT_AGW_CAPS)} added; runAs=root refused",
               lambda: check_run_as(helm))

    # The clustered mode (store.type=postgres).
    pg_all_on_keda = deep_merge(ALL_ON_KEDA, pg_values)
    pg_all_on_hpa = deep_merge(ALL_ON_HPA, PG_URL_VALUES)
    for label, values in (("postgres", pg_values), ("postgres-url", PG_URL_VALUES),
                          ("postgres-all-on-keda", pg_all_on_keda),
                          ("postgres-all-on-hpa", pg_all_on_hpa)):
        checks.run(f"helm lint helm/agq with store.type=postgres ({label})",
                   lambda values=values: lint_with(values))
        checks.run(f"render {label}", render(label, values))
    checks.run("render postgres-url with auth.enabled=false",
               render("postgres-insecure", {**PG_URL_VALUES, "auth": {"enabled": False}}))
    for label in ("postgres", "postgres-url"):
        checks.run(f"{label}: server is a Deployment of 3, no StatefulSet, no PVC or /data, "
                   "rolling update maxUnavailable 0 maxSurge 1, anti-affinity across nodes",
                   on(label, check_pg_workload))
        checks.run(f"{label}: readiness grpc on the \"\" health (fails while the database is "
                   "unreachable), liveness on `liveness`, startup grpc", on(label, check_probes))
        checks.run(f"{label}: server PodDisruptionBudget maxUnavailable 1 on the Deployment's pods",
                   on(label, check_pg_pdb))
        checks.run(f"{label}: one Service (no headless) selecting the Deployment's pods; ports",
                   on(label, check_ports))
        checks.run(f"{label}: securityContext non-root, read-only root, drop ALL",
                   on(label, check_security))
        checks.run(f"{label}: console on 0.0.0.0:{CONSOLE_PORT} behind the Service (auth on)",
                   on(label, lambda o: check_console(o, "public")))
        checks.run(f"{label}: workers dial the Service; it selects the server pods only",
                   on(label, check_pg_worker_pool))
        checks.run(f"{label}: helm test pod checks grpc.health.v1 on the Service",
                   lambda label=label: (expect(label in rendered, f"{label} did not render"),
                                        check_test_hook(rendered[label][1])))
    checks.run("postgres: AGQ_STORE from secretKeyRef pg-app/uri (CloudNativePG), no chart "
               "Secret, the URL nowhere else", on("postgres", lambda o: check_pg_existing_secret(
                   o, pg_values)))
    checks.run("postgres-url: Secret agq-ci-store holds store.postgres.url; AGQ_STORE from its "
               "secretKeyRef; checksum/store rolls the pods", on("postgres-url",
                                                                 check_pg_url_secret))
    checks.run("postgres-url: auth Secret mounted as AGQ_AUTH_FILE; workers hold a pool token",
               on("postgres-url", lambda o: check_auth(
                   o, [], PG_URL_VALUES["auth"]["workerToken"])))
    checks.run("postgres: ServiceMonitor selects the one server Service",
               on("postgres", check_pg_service_monitor))
    checks.run("postgres-insecure: AGQ_INSECURE, console on the loopback, store Secret kept",
               on("postgres-insecure", lambda o: (check_insecure(o),
                                                   check_console(o, "loopback"),
                                                   check_pg_url_secret(o))))
    checks.run("postgres-all-on-keda: KEDA query and AgqNoFreshWorkers take max over the "
               "replicas; ScaledObject on the worker Deployment",
               on("postgres-all-on-keda", check_pg_queries))
    checks.run("postgres-all-on-keda: PrometheusRule alerts on this release's series",
               on("postgres-all-on-keda", lambda o: check_prometheus_rule(
                   o, f'namespace="{NAMESPACE}",service="{FULLNAME}"')))
    checks.run("postgres-all-on-keda: server PDB and worker PDB both rendered",
               on("postgres-all-on-keda", lambda o: (check_pg_pdb(o), find(
                   o, "PodDisruptionBudget", f"{FULLNAME}-worker"))))
    checks.run("postgres-all-on-hpa: autoscaling/v2 HPA on the worker Deployment",
               on("postgres-all-on-hpa", lambda o: check_hpa(o, pg_all_on_hpa)))
    checks.run("store: postgres without a URL, sqlite with replicas > 1, url and existingSecret, "
               "a non-PostgreSQL URL, postgres values on sqlite, two PDB bounds fail the render",
               lambda: check_store_fails(helm))
    checks.run("store: replica counts, host= and postgresql:// URLs, PDB overrides, "
               "server.affinity render", lambda: check_store_accepts(helm))

    def live() -> None:
        expect("all-on-keda" in rendered and "all-on-hpa" in rendered
               and "postgres-all-on-keda" in rendered, "all-on did not render")
        dash = json.loads(DASHBOARD.read_text())
        queries = {f"dashboard {p['title']!r}": t["expr"]
                   for p in dash["panels"] for t in p["targets"]}
        queries |= {f"dashboard variable {v['name']}": v["query"]["query"]
                    for v in dash["templating"]["list"] if v["type"] == "query"}
        queries |= rendered_queries(rendered["all-on-keda"][0])
        queries |= {f"{k} (hpa)": v for k, v in rendered_queries(rendered["all-on-hpa"][0]).items()}
        queries["ScaledObject query (autoscaling.keda.query)"] = \
            KEDA_OVERRIDE["autoscaling"]["keda"]["query"]
        if "postgres-all-on-keda" in rendered:
            queries |= {f"{k} (postgres)": v
                        for k, v in rendered_queries(rendered["postgres-all-on-keda"][0]).items()}
        expect(sum(k.startswith("PrometheusRule") for k in queries) == 3 * len(ALERTS)
               and "ScaledObject query" in queries and "HPA external metric (hpa)" in queries,
               f"queries checked: {sorted(queries)}")
        check_live_metrics(queries)

    checks.run("dashboard, PrometheusRule, KEDA and HPA queries name metrics and labels "
               "a live agq serve exposes", live)
    checks.run("helm/agq/README.md lists every value, generated from values.yaml comments",
               check_readme)
    checks.run("NOTES.txt renders for every values set",
               lambda: check_notes(helm, auth_values))
    checks.run("values.schema.json rejects bad values", lambda: check_schema_rejects(helm))

    timer.cancel()
    server.shutdown()
    print(f"helm-chart: {checks.passed} passed, {checks.failed} failed", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
