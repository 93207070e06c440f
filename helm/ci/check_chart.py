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
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import tomllib
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
METRICS_PORT = 9090
WATCHDOG_SECS = 300

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
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True)],
}


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
        # A collection (.../namespaces/<ns>/<resource>) is empty; any single
        # object does not exist yet.
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


def check_probes(objs: list[dict]) -> None:
    sts = find(objs, "StatefulSet", FULLNAME)
    agq = container(sts, "agq")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        p = agq.get(probe)
        expect(p, f"{probe} missing")
        expect(set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"},
               f"{probe} is not a grpc probe: {p}")
        expect(p["grpc"].get("port") == GRPC_PORT and isinstance(p["grpc"]["port"], int),
               f"{probe} grpc port is {p['grpc'].get('port')!r}, want numeric {GRPC_PORT}")


def check_ports(objs: list[dict]) -> None:
    sts = find(objs, "StatefulSet", FULLNAME)
    ports = {p["name"]: p["containerPort"] for p in container(sts, "agq")["ports"]}
    expect(ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT},
           f"container ports {ports}")
    env = env_of(container(sts, "agq"))
    expect(env["AGQ_LISTEN"]["value"] == f"0.0.0.0:{GRPC_PORT}", "AGQ_LISTEN")
    expect(env["AGQ_METRICS_LISTEN"]["value"] == f"0.0.0.0:{METRICS_PORT}", "AGQ_METRICS_LISTEN")
    expect(env["AGQ_JOB_RETENTION_SECS"]["value"] == "604800", "AGQ_JOB_RETENTION_SECS")
    svc = find(objs, "Service", FULLNAME)
    sports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    expect(sports == {"grpc": (GRPC_PORT, "grpc"), "metrics": (METRICS_PORT, "metrics")},
           f"service ports {sports}")
    expect(svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"],
           "service selector differs from the StatefulSet's")
    headless = find(objs, "Service", f"{FULLNAME}-headless")
    expect(sts["spec"]["serviceName"] == headless["metadata"]["name"]
           and headless["spec"]["clusterIP"] == "None", "StatefulSet serviceName/headless")


def check_security(objs: list[dict]) -> None:
    pods = [(find(objs, "StatefulSet", FULLNAME), "agq")]
    if any(o["kind"] == "Deployment" for o in objs):
        pods.append((find(objs, "Deployment", f"{FULLNAME}-worker"), "agw"))
    for obj, cname in pods:
        sc = container(obj, cname)["securityContext"]
        expect(sc.get("runAsNonRoot") is True, f"{cname}: runAsNonRoot")
        expect(sc.get("runAsUser") == 10001, f"{cname}: runAsUser {sc.get('runAsUser')}")
        expect(sc.get("readOnlyRootFilesystem") is True, f"{cname}: readOnlyRootFilesystem")
        expect(sc.get("allowPrivilegeEscalation") is False, f"{cname}: allowPrivilegeEscalation")
        expect(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{cname}: drop ALL")
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
    for var in ("AGW_INSECURE_NO_SANDBOX", "AGW_ALLOW_NETWORK"):
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
    sts = find(objs, "StatefulSet", FULLNAME)
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
    sts = find(objs, "StatefulSet", FULLNAME)
    env = env_of(container(sts, "agq"))
    expect(env.get("AGQ_INSECURE", {}).get("value") == "true", "AGQ_INSECURE not true")
    expect("AGQ_AUTH_FILE" not in env, "AGQ_AUTH_FILE set with auth off")
    expect(not [o for o in objs if o["kind"] == "Secret"], "a Secret rendered with auth off")
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
    cases = [
        (None, ["worker-pool token", "data-agq-ci-0"], ["WARNING"]),
        (auth_values, ["on claim agq-data", "3 replicas"], ["WARNING"]),
        ({"auth": {"enabled": False}}, ["WARNING", "AGQ_INSECURE=true"], ["get secret"]),
        (EDGE_VALUES, ["my-agq-tokens", "LOST"], ["Workers:"]),
    ]
    for values, want, unwanted in cases:
        notes = render_notes(helm, values)
        for text in want_all + want:
            expect(text in notes, f"NOTES for {values} lack {text!r}")
        for text in unwanted:
            expect(text not in notes, f"NOTES for {values} contain {text!r}")


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


def check_schema_rejects(helm: Helm) -> None:
    for bad in ({"worker": {"replicas": "three"}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "root"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "worker"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "worker", "worker_id": "w1",
                                      "worker_id_prefix": "w-"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "admin",
                                      "worker_id_prefix": "w-"}]}},
                {"auth": {"tokens": [{"token": "x" * 20, "role": "client", "worker_id": "w1"}]}},
                {"server": {"logFormat": "xml"}}):
        try:
            helm.template(bad)
        except Exception as exc:  # noqa: BLE001
            expect("schema" in str(exc).lower(),
                   f"{bad} failed for another reason: {exc}")
        else:
            raise AssertionError(f"values {bad} were accepted")


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
    checks.run("render default values", render("default", None))
    checks.run("render values-auth.yaml", render("auth", auth_values))
    checks.run("render auth.enabled=false", render("insecure", {"auth": {"enabled": False}}))
    checks.run("render existingSecret, no persistence, no workers", render("edge", EDGE_VALUES))

    def on(label: str, fn: Callable[[list[dict]], None]) -> Callable[[], None]:
        def go() -> None:
            expect(label in rendered, f"{label} did not render")
            fn(rendered[label][0])
        return go

    auth_worker = auth_values["worker"]
    for label in ("default", "auth"):
        checks.run(f"{label}: StatefulSet probes are grpc on port {GRPC_PORT}",
                   on(label, check_probes))
        checks.run(f"{label}: container ports 6380/9090, Service ports grpc/metrics",
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
    checks.run("existingSecret, persistence off, workers off, server PDB",
               on("edge", check_edge))
    checks.run("NOTES.txt renders for every values set",
               lambda: check_notes(helm, auth_values))
    checks.run("values.schema.json rejects bad values", lambda: check_schema_rejects(helm))

    timer.cancel()
    server.shutdown()
    print(f"helm-chart: {checks.passed} passed, {checks.failed} failed", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
