"""The Kubernetes manifests hold together: the gateway ConfigMap decodes as a
gateway config and a policy, and the Deployment, Service, HPA and engine
Services agree with it on paths, ports and names."""

from __future__ import annotations

import json
import re

import posixpath
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from gateway.config import GatewayConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.routing.policy import load_policy

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "configs" / "k8s"
NAMESPACE = "onehop"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}

Doc = dict[str, Any]


def _docs() -> list[tuple[str, Doc]]:
    out: list[tuple[str, Doc]] = []
    for path in sorted(K8S.glob("*.yaml")):
        with path.open(encoding="utf-8") as fh:
            out.extend((path.name, doc) for doc in yaml.safe_load_all(fh) if doc is not None)
    return out


DOCS = _docs()


def _find(kind: str, name: str) -> Doc:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _gateway_text() -> str:
    text = _find("ConfigMap", "onehop-gateway")["data"]["gateway.yaml"]
    assert isinstance(text, str)
    return text


def _gateway_config() -> GatewayConfig:
    return msgspec.convert(yaml.safe_load(_gateway_text()), GatewayConfig)


def _container() -> Doc:
    containers = _find("Deployment", "onehop-gateway")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _port_number(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    assert named, f"no container port named {port!r}"
    return int(named[0])


def test_every_manifest_is_named_and_namespaced() -> None:
    assert {name for name, _ in DOCS} >= {"gateway.yaml", "vllm-decode.yaml", "vllm-prefill.yaml"}
    for file, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind"), file
        meta = doc.get("metadata") or {}
        assert meta.get("name"), f"{file}: {doc['kind']} without a name"
        if doc["kind"] not in CLUSTER_SCOPED:
            assert meta.get("namespace") == NAMESPACE, f"{file}: {doc['kind']} {meta['name']}"
    names = [(d["kind"], d["metadata"]["name"]) for _, d in DOCS]
    assert len(names) == len(set(names)), "a resource is defined twice"


def test_gateway_config_decodes() -> None:
    config = _gateway_config()
    assert config.host == "0.0.0.0"
    assert config.tokenizer is not None and config.tokenizer.startswith("/models/")
    assert config.admission.max_concurrency is not None
    assert config.tracing.endpoint is not None
    assert config.auth.api_keys_file is not None and not config.auth.protect_metrics


def test_gateway_policy_loads(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(_find("ConfigMap", "onehop-gateway")["data"]["policy.yaml"], encoding="utf-8")
    policy = load_policy(path)
    assert policy.default == "cost"


def test_config_typo_is_caught() -> None:
    text = _gateway_text()
    assert "max_concurrency:" in text
    bad = yaml.safe_load(text.replace("max_concurrency:", "max_concurency:"))
    with pytest.raises(msgspec.ValidationError, match="max_concurency"):
        msgspec.convert(bad, GatewayConfig)


def test_deployment_mounts_config_secret_and_models() -> None:
    config = _gateway_config()
    pod = _find("Deployment", "onehop-gateway")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in _container()["volumeMounts"]}

    def source(mount_dir: str) -> Doc:
        assert mount_dir in mounts, f"nothing mounted at {mount_dir}"
        assert "subPath" not in mounts[mount_dir], "a subPath mount never sees ConfigMap updates"
        return volumes[mounts[mount_dir]["name"]]

    assert config.policy is not None
    config_dir = posixpath.dirname(config.policy)
    assert source(config_dir)["configMap"]["name"] == "onehop-gateway"
    assert config.auth.api_keys_file is not None
    assert source(posixpath.dirname(config.auth.api_keys_file))["secret"]["secretName"] == "onehop-api-keys"
    claim = source("/models")["persistentVolumeClaim"]
    assert claim["claimName"] == "models" and mounts["/models"]["readOnly"] is True
    assert config.tokenizer is not None and config.tokenizer.startswith("/models/")


def test_deployment_runs_the_mounted_config() -> None:
    config = _gateway_config()
    assert config.policy is not None
    argv = [*_container().get("command", []), *_container().get("args", [])]
    assert argv[:3] == ["onehop", "gateway", "--config"]
    path = argv[3]
    assert posixpath.dirname(path) == posixpath.dirname(config.policy)
    assert posixpath.basename(path) in _find("ConfigMap", "onehop-gateway")["data"]


def test_probes_and_service_use_the_config_port() -> None:
    config = _gateway_config()
    container = _container()
    for probe in ("readinessProbe", "livenessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/health"
        assert _port_number(container, http["port"]) == config.port
    service = _find("Service", "onehop-gateway")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == 8000
    assert _port_number(container, port["targetPort"]) == config.port
    deployment = _find("Deployment", "onehop-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.port


def test_hpa_scales_the_deployment() -> None:
    hpa = _find("HorizontalPodAutoscaler", "onehop-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "onehop-gateway")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["averageUtilization"] == 70
    # Utilization is measured against the request: it must be set.
    assert _container()["resources"]["requests"]["cpu"]


def test_engine_urls_name_headless_services() -> None:
    config = _gateway_config()
    services: set[str] = set()
    for engine in [*config.engines, *config.prefill_engines]:
        url = urlsplit(engine.url)
        assert url.hostname is not None
        name, _, rest = url.hostname.partition(".")
        if rest:
            namespace = rest.split(".")[0]
            assert rest in (namespace, f"{namespace}.svc", f"{namespace}.svc.cluster.local")
        else:
            namespace = NAMESPACE
        service = _find("Service", name)
        assert service["metadata"]["namespace"] == namespace
        assert engine.resolve, f"{engine.url}: a Service name needs resolve: true"
        assert service["spec"].get("clusterIP") == "None", f"Service {name} is not headless"
        assert url.port in {p["port"] for p in service["spec"]["ports"]}
        services.add(name)
    assert services == {"vllm-decode", "vllm-prefill"}
    assert [urlsplit(e.url).hostname.split(".")[0] for e in config.prefill_engines] == ["vllm-prefill"]  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "flag"), [("vllm-decode", "--enable-scale-out"), ("vllm-prefill", "--tokens-only")])
def test_vllm_pools(name: str, flag: str) -> None:
    workloads = [d for _, d in DOCS if d["kind"] in ("StatefulSet", "Deployment") and d["metadata"]["name"] == name]
    assert len(workloads) == 1
    workload = workloads[0]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[:2] == ["vllm", "serve"] and flag in argv
    assert "--port=8000" in argv
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    kv = [a for a in argv if a.startswith("--kv-transfer-config=")]
    assert len(kv) == 1 and json.loads(kv[0].split("=", 1)[1])["kv_connector"] == "NixlConnector"  # the P/D hand-off
    service = _find("Service", name)
    assert service["spec"]["clusterIP"] == "None"
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == name


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text(encoding="utf-8")


def test_the_gateway_image_is_the_dockerfiles() -> None:
    """The Deployment runs the image the Dockerfile builds, as its tag and entrypoint say."""
    import re

    dockerfile = _dockerfile()
    tags = re.findall(r"docker build -t (\S+) \.", dockerfile)
    assert tags and set(tags) == {_container()["image"]}
    assert 'ENTRYPOINT ["onehop"]' in dockerfile
    assert _container()["command"][0] == "onehop"


def test_the_dockerfile_installs_pyprojects_python_and_torch() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dockerfile = _dockerfile()
    assert "FROM python:3.11-slim" in dockerfile and pyproject["requires-python"] == ">=3.11"
    (torch,) = [pin for pin in pyproject["optional-dependencies"]["engine"] if pin.startswith("torch")]
    assert f"pip install ${{TORCH_INDEX_URL:+--index-url \"$TORCH_INDEX_URL\"}} {torch}" in dockerfile
    assert "pip install '.[engine]'" in dockerfile


def test_the_keda_example_scales_the_decode_pool_on_metrics_the_gateway_exports() -> None:
    [scaled] = list(yaml.safe_load_all((K8S / "keda" / "vllm-decode-scaledobject.yaml").read_text(encoding="utf-8")))
    assert scaled["kind"] == "ScaledObject" and scaled["metadata"]["namespace"] == NAMESPACE
    target = scaled["spec"]["scaleTargetRef"]
    assert _find(target["kind"], target["name"])["metadata"]["namespace"] == NAMESPACE
    exported = {metric.name for metric in GatewayMetrics().registry.collect()}
    queries = [trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]]
    named = {word for query in queries for word in re.findall(r"onehop_gateway_\w+", query)}
    assert named and named <= exported, named - exported
