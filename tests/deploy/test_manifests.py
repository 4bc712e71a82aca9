"""The Kubernetes manifests of deploy/ (docs/deployment.md), checked without a cluster.

`kubectl apply --dry-run=client` still asks an API server for the kinds it maps (and the
InferencePool and LeaderWorkerSet CRDs would have to be installed there), so the manifests are
validated here against a vendored, trimmed JSON schema of the fields they use
(tests/deploy/k8s_schemas.json: each object closed, upstream's required fields, enums and
ranges), and then against vx itself: every `vx serve` command line parses with vx's own
parser, the probes name vx's routes, and the pool selects the replicas' pods on their port.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from vx.cli import build_serve_parser  # noqa: E402
from vx.config import parse_kv_events_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((pathlib.Path(__file__).parent / "k8s_schemas.json").read_text())


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def problems(doc: dict) -> list[str]:
    key = f"{doc.get('apiVersion')} {doc.get('kind')}"
    if key not in SCHEMA["kinds"]:
        return [f"no schema for {key}"]
    validator = jsonschema.Draft202012Validator({"$defs": SCHEMA["$defs"], **SCHEMA["kinds"][key]})
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def pod_specs(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "Deployment":
        return [spec["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        t = spec["leaderWorkerTemplate"]
        return [t[k] for k in ("leaderTemplate", "workerTemplate") if k in t]
    return []


def test_every_manifest_validates() -> None:
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "InferencePool", "LeaderWorkerSet", "Service"} <= kinds
    for name, doc in docs:
        assert problems(doc) == [], (name, doc["kind"])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={}),
        lambda d: d["spec"].pop("selector"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
            containerPort=70000
        ),
    ],
    ids=["misspelt field", "missing selector", "port out of range"],
)
def test_the_schema_refuses_broken_deployments(mutate) -> None:
    (deployment,) = [d for _, d in documents() if d["kind"] == "Deployment"]
    broken = copy.deepcopy(deployment)
    mutate(broken)
    assert problems(broken)


def test_the_schema_refuses_a_broken_pool() -> None:
    (pool,) = [d for _, d in documents() if d["kind"] == "InferencePool"]
    broken = copy.deepcopy(pool)
    broken["spec"]["endpointPickerRef"]["failureMode"] = "FailSoft"
    broken["spec"]["targetPorts"] = []
    assert len(problems(broken)) == 2


def test_vx_accepts_every_command_line() -> None:
    """Each container's `vx serve` arguments parse with vx's parser ($(VAR) references, which
    the kubelet expands, replaced by a sample value); readiness probes /ready, liveness /health,
    on the port the server listens on."""
    parser = argparse.ArgumentParser()
    build_serve_parser(parser)
    seen = 0
    for name, doc in documents():
        for template in pod_specs(doc):
            for c in template["spec"]["containers"]:
                assert c["command"] == ["vx", "serve"], name
                args = [re.sub(r"\$\((\w+)\)", "1", a) for a in c["args"]]
                ns, unknown = parser.parse_known_args(args)
                assert not unknown, (name, unknown)
                parse_kv_events_config(ns.kv_events_config)  # raises on a bad one
                seen += 1
                if ns.headless:
                    assert "readinessProbe" not in c  # no HTTP server on a headless node
                    continue
                ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
                assert ports["http"] == ns.port and ns.host == "0.0.0.0"
                assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
                assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert seen == 3


def test_the_pool_selects_the_replicas() -> None:
    docs = [d for _, d in documents()]
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["containerPort"] for p in container["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
