"""Deployment files: they parse, and every probe and command points at something real."""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.main import get_command

from fastpubsub.api.app import create_app
from fastpubsub.cli import app as cli_app
from fastpubsub.embedded import free_port
from fastpubsub.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
# The image's user (Dockerfile USER), which every workload names explicitly.
IMAGE_UID = IMAGE_GID = 10001


def cli_commands() -> set[str]:
    return set(get_command(cli_app).commands)  # type: ignore[attr-defined]


def api_paths() -> set[str]:
    app = create_app(Settings(_env_file=None, database_url="postgresql://unused@127.0.0.1:1/x"))
    return set(app.openapi()["paths"])


def pod_spec(document: dict[str, Any]) -> dict[str, Any]:
    """The pod template's spec of a workload; {} for other kinds."""
    spec = document.get("spec", {})
    if document["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec.get("template", {}).get("spec", {}))


def pod_labels(document: dict[str, Any]) -> dict[str, str]:
    spec = document["spec"]
    if document["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["metadata"]["labels"])


def containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(document)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def applied_documents() -> list[dict[str, Any]]:
    """Every document `kubectl apply -k deploy/kubernetes` applies."""
    folder = ROOT / "deploy/kubernetes"
    names = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    return [doc for name in names for doc in yaml.safe_load_all((folder / name).read_text())]


def workloads() -> list[dict[str, Any]]:
    return [doc for doc in applied_documents() if doc["kind"] in ("Deployment", "Job", "CronJob")]


def named(kind: str, name: str, documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The one document of this kind and name."""
    found = [
        doc
        for doc in (applied_documents() if documents is None else documents)
        if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_every_manifest_parses_and_is_listed_in_the_kustomization() -> None:
    kustomization = yaml.safe_load((ROOT / "deploy/kubernetes/kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    # The example Secret is documentation: applying it would replace real values.
    on_disk = {path.name for path in MANIFESTS} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == on_disk
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            assert document["apiVersion"]
            assert document["kind"]


def test_the_applied_set_has_no_secret_and_says_how_to_create_it() -> None:
    kustomization_path = ROOT / "deploy/kubernetes/kustomization.yaml"
    for name in yaml.safe_load(kustomization_path.read_text())["resources"]:
        kinds = {doc["kind"] for doc in yaml.safe_load_all((ROOT / "deploy/kubernetes" / name).read_text())}
        assert "Secret" not in kinds, name
    (example,) = yaml.safe_load_all((ROOT / "deploy/kubernetes/secret.example.yaml").read_text())
    assert example["kind"] == "Secret"
    for text in (kustomization_path.read_text(), (ROOT / "README.md").read_text()):
        assert "kubectl create secret generic fastpubsub" in text
        for key in example["stringData"]:
            assert f"--from-literal={key}=" in text


def test_kubernetes_containers_run_real_commands_and_probe_real_endpoints() -> None:
    commands, paths = cli_commands(), api_paths()
    kinds = {}
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            kinds.setdefault(document["kind"], []).append(document)
            for container in containers(document):
                assert container["args"][0] in commands, (path.name, container["args"])
                ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if probe in container:
                        http = container[probe]["httpGet"]
                        assert http["path"] in paths
                        assert http["port"] in ports or http["port"] in ports.values()
    deployment = named("Deployment", "fastpubsub", kinds["Deployment"])
    (server,) = containers(deployment)
    assert server["args"] == ["server"]
    (push_worker,) = containers(named("Deployment", "fastpubsub-push-worker", kinds["Deployment"]))
    assert push_worker["args"] == ["push-worker"]
    assert server["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert server["readinessProbe"]["httpGet"]["path"] == "/readiness"
    # /readiness answers 503 until the database can serve: a startup probe on it
    # would restart servers that are only waiting for the database.
    assert server["startupProbe"]["httpGet"]["path"] == "/liveness"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    (job,) = kinds["Job"]
    assert containers(job)[0]["args"] == ["db-migrate"]
    cron = {containers(c)[0]["args"][0]: c["spec"] for c in kinds["CronJob"]}
    assert set(cron) == {"cleanup-acked-messages", "cleanup-stuck-messages", "archive"}
    for spec in cron.values():
        assert len(spec["schedule"].split()) == 5
        assert spec["concurrencyPolicy"] == "Forbid"
    (service,) = kinds["Service"]
    assert service["metadata"]["annotations"]["prometheus.io/path"] in paths


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_kubernetes_uses_the_local_image_without_pulling_it() -> None:
    image = f"fastpubsub:{project_version()}"
    # The archive runs Spark: the image's `spark` target (Java, PySpark, the JDBC driver).
    spark_image = f"fastpubsub-spark:{project_version()}"
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            for container in containers(document):
                # A versioned tag, never :latest, so every pod of a release runs the same build.
                expected = spark_image if container["args"][0] == "archive" else image
                assert container["image"] == expected, (path.name, container["name"])
                # The local build is not on any registry: never make the kubelet pull it.
                assert container["imagePullPolicy"] == "IfNotPresent", (path.name, container["name"])
    kustomization = (ROOT / "deploy/kubernetes/kustomization.yaml").read_text()
    assert "docker push" in kustomization
    assert f"docker build -t {image} ." in kustomization
    assert f"docker build --target spark -t {spark_image} ." in kustomization
    readme = (ROOT / "README.md").read_text()
    assert f"docker build -t {image} ." in readme
    assert "fastpubsub:latest" not in readme + kustomization


# Volume types the restricted Pod Security Standard admits.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"
}  # fmt: skip


def test_every_workload_meets_the_restricted_pod_security_standard() -> None:
    """The fields of the "restricted" profile, plus a read-only root and resource limits."""
    kinds = sorted(doc["kind"] for doc in workloads())
    assert kinds == ["CronJob", "CronJob", "CronJob", "Deployment", "Deployment", "Job"]
    for document in workloads():
        name = document["metadata"]["name"]
        spec = pod_spec(document)
        assert spec["automountServiceAccountToken"] is False, name
        for host in ("hostNetwork", "hostPID", "hostIPC", "hostUsers"):
            assert host not in spec, (name, host)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, name
        assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (IMAGE_UID, IMAGE_GID, IMAGE_GID)
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for volume in volumes.values():
            assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, (name, volume)
        for container in containers(document):
            where = (name, container["name"])
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context.get("runAsNonRoot", True) is True, where
            assert context.get("runAsUser", IMAGE_UID) == IMAGE_UID, where
            assert not context.get("privileged", False), where
            assert context.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}
            for bound in ("requests", "limits"):
                assert set(container["resources"][bound]) == {"cpu", "memory"}, (where, bound)
            # The server writes its Prometheus multiprocess files and gunicorn its
            # heartbeats under the temporary directory: a writable emptyDir.
            (tmp,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], where
            assert {"name": "TMPDIR", "value": "/tmp"} in container["env"], where


def test_the_server_writes_only_under_the_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """readOnlyRootFilesystem holds while `serve` writes nowhere but the temp dir (the /tmp emptyDir)."""
    from gunicorn.app.base import BaseApplication

    from fastpubsub.cli import serve

    seen: dict[str, Any] = {}

    def run(self: Any) -> None:
        seen["metrics_dir"] = os.environ["PROMETHEUS_MULTIPROC_DIR"]
        seen["worker_tmp_dir"] = self.cfg.worker_tmp_dir

    monkeypatch.setattr(BaseApplication, "run", run)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "restored-after-the-test")
    serve(Settings(_env_file=None), "127.0.0.1", free_port(), 1)
    assert Path(seen["metrics_dir"]).parent == tmp_path
    # gunicorn's worker heartbeat files: None means the temp dir too.
    assert seen["worker_tmp_dir"] is None


def test_jobs_clean_up_after_themselves_and_cannot_hang() -> None:
    documents = applied_documents()
    (job,) = [doc for doc in documents if doc["kind"] == "Job"]
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["activeDeadlineSeconds"] > 0
    intervals = {"0 * * * *": 3600, "30 * * * *": 3600, "*/5 * * * *": 300}
    for cron in (doc for doc in documents if doc["kind"] == "CronJob"):
        spec = cron["spec"]
        assert spec["successfulJobsHistoryLimit"] >= 1
        assert spec["failedJobsHistoryLimit"] >= 1
        interval = intervals[spec["schedule"]]
        assert 10 <= spec["startingDeadlineSeconds"] < interval
        # concurrencyPolicy Forbid: a run that never ends would hold back every later one.
        assert spec["jobTemplate"]["spec"]["activeDeadlineSeconds"] < interval


def test_the_server_keeps_one_pod_through_disruptions_and_its_network_is_fenced() -> None:
    documents = applied_documents()
    deployment = named("Deployment", "fastpubsub", documents)
    (budget,) = [doc for doc in documents if doc["kind"] == "PodDisruptionBudget"]
    (service,) = [doc for doc in documents if doc["kind"] == "Service"]
    policy = named("NetworkPolicy", "fastpubsub", documents)
    labels = pod_labels(deployment)
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["minAvailable"] == 1 < deployment["spec"]["replicas"]
    # The budget and the Service select the server's pods and no Job's.
    for document in workloads():
        selected = budget["spec"]["selector"]["matchLabels"].items() <= pod_labels(document).items()
        is_server = (document["kind"], document["metadata"]["name"]) == ("Deployment", "fastpubsub")
        assert selected is is_server, document["metadata"]["name"]
        assert (service["spec"]["selector"].items() <= pod_labels(document).items()) is selected
        # The NetworkPolicy covers every fastpubsub pod.
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(document).items()
    (server,) = containers(deployment)
    (port,) = server["ports"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = policy["spec"]["ingress"]
    assert ingress == {"ports": [{"protocol": "TCP", "port": port["containerPort"]}]}
    egress = {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress == {("UDP", 53), ("TCP", 53), ("TCP", 5432)}
    assert "to adjust" in (ROOT / "deploy/kubernetes/networkpolicy.yaml").read_text().lower()


def test_the_push_worker_runs_apart_from_the_server_and_may_reach_https() -> None:
    documents = applied_documents()
    worker = named("Deployment", "fastpubsub-push-worker", documents)
    (container,) = containers(worker)
    assert container["args"] == ["push-worker"]
    assert worker["spec"]["replicas"] >= 2  # safe side by side: each lease is one worker's
    # Its own name label: the server's Service and PodDisruptionBudget leave it alone.
    assert pod_labels(worker)["app.kubernetes.io/name"] == "fastpubsub-push-worker"
    assert pod_labels(worker)["app.kubernetes.io/part-of"] == "fastpubsub"
    # Graceful stop (--shutdown-grace, 5 s by default) fits in the pod's grace period.
    assert pod_spec(worker)["terminationGracePeriodSeconds"] > 5
    (port,) = container["ports"]
    assert {"name": "FASTPUBSUB_PUSH_METRICS_HOST", "value": "0.0.0.0"} in container["env"]
    assert port["containerPort"] == Settings.model_fields["push_metrics_port"].default
    assert container["livenessProbe"]["httpGet"]["port"] == port["name"]
    policy = named("NetworkPolicy", "fastpubsub-push-worker", documents)
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(worker).items()
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": port["containerPort"]}]}]
    egress = {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress == {("TCP", 443)}
    # No other pod may reach the endpoints.
    for document in workloads():
        if document["metadata"]["name"] != worker["metadata"]["name"]:
            assert not policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(document).items()


# The oldest Kubernetes the manifests are written for (README): the
# PodDisruptionBudget's unhealthyPodEvictionPolicy is on by default from 1.27.
OLDEST_KUBERNETES = (1, 27)


def schema_errors(document: dict[str, Any], version: str) -> str | None:
    from kubernetes_validate import ValidationError, validate

    try:
        validate(document, version, strict=True)
    except ValidationError as exc:
        return f"{exc.json_path}: {exc.message}"
    return None


def test_manifests_match_the_kubernetes_api_schemas() -> None:
    """Strict validation against the API's own schemas: a misspelt or misplaced field fails.

    kubernetes-validate (a dev extra) ships the schemas, so this runs offline.
    """
    from kubernetes_validate.utils import all_versions, latest_version

    def as_tuple(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    oldest = min((v for v in all_versions() if as_tuple(v)[:2] >= OLDEST_KUBERNETES), key=as_tuple)
    failures = [
        (path.name, document["kind"], version, error)
        for path in MANIFESTS
        if path.name != "kustomization.yaml"  # kustomize's own file: no API schema
        for document in yaml.safe_load_all(path.read_text())
        for version in sorted({oldest, latest_version()})
        if (error := schema_errors(document, version))
    ]
    assert failures == []
    # The check has teeth: a misspelt field is refused.
    deployment = named("Deployment", "fastpubsub")
    context = containers(deployment)[0]["securityContext"]
    context["readOnlyRootFilesytem"] = context.pop("readOnlyRootFilesystem")
    assert "readOnlyRootFilesytem" in (schema_errors(deployment, latest_version()) or "")


def test_kustomize_renders_the_applied_set() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize deploy/kubernetes` not tried")
    result = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/kubernetes")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    rendered = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout))
    assert rendered == sorted(doc["kind"] for doc in applied_documents())
    assert "Secret" not in rendered


# checkov's Kubernetes checks. Its pinned dependencies clash with the project's,
# so it lives in a virtualenv of its own under the user's cache folder,
# installed by the first run (about 300 MB, under a minute).
CHECKOV = "checkov==3.3.30"
# Checks the manifests do not meet on purpose, and why.
CHECKOV_SKIPPED = {
    "CKV_K8S_15": "imagePullPolicy Always: the manifests name a local build (kind/minikube image load) "
    "that no registry has, under a versioned tag, so IfNotPresent",
    "CKV_K8S_21": "the default namespace: the manifests name none, so that `kubectl apply -k -n NAME` "
    "or an overlay chooses it",
    "CKV_K8S_35": "secrets as files: fastpubsub reads its settings from FASTPUBSUB_* environment "
    "variables only",
    "CKV_K8S_43": "image digests: a local build has none to name in advance; kustomization.yaml "
    "shows how to pin one under images:",
}


def checkov_executable() -> Path:
    """checkov in its own cached virtualenv; skips the test, saying why, when it cannot be installed."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastpubsub"
    venv = cache / CHECKOV.replace("==", "-")
    executable, installed = venv / "bin" / "checkov", venv / ".installed"
    cache.mkdir(parents=True, exist_ok=True)
    # Test sessions in other work trees may install it at the same moment.
    with (cache / "checkov.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed.exists():
            return executable
        shutil.rmtree(venv, ignore_errors=True)  # an install cut short
        pip = [str(venv / "bin/python"), "-m", "pip", "--disable-pip-version-check"]
        steps = ([sys.executable, "-m", "venv", str(venv)], [*pip, "install", "--quiet", CHECKOV])
        for step in steps:
            try:
                result = subprocess.run(step, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                reason = "it took over 15 minutes"
            else:
                if result.returncode == 0:
                    continue
                reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"could not install {CHECKOV} into {venv} ({reason}): checkov's checks not run")
        installed.touch()
    return executable


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_checkov_finds_nothing_in_the_kubernetes_manifests() -> None:
    command = [
        str(checkov_executable()),
        *("--directory", str(ROOT / "deploy/kubernetes")),
        *("--framework", "kubernetes"),
        *("--skip-check", ",".join(sorted(CHECKOV_SKIPPED))),
        *("--output", "json", "--skip-download"),
    ]
    # Offline: no platform downloads (--skip-download), no check for a newer release.
    env = {**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode in (0, 1), result.stderr  # 1: some check failed
    report = json.loads(result.stdout)
    failed = [
        (check["check_id"], check["check_name"], check["resource"], check["file_path"])
        for check in report["results"]["failed_checks"]
    ]
    assert failed == []
    assert report["summary"]["parsing_errors"] == 0
    documents = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]
    # Every document but the Kustomization was read (checkov counts some twice).
    assert report["summary"]["resource_count"] >= len(documents) - 1
    assert report["summary"]["passed"] > 0


def test_compose_services_run_real_commands() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", "server", "cleanup", "push-worker"}
    assert services["push-worker"]["command"] == ["push-worker"]
    assert services["push-worker"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    commands = cli_commands()
    assert services["migrate"]["command"] == ["db-migrate"]
    assert services["server"]["command"] == ["server"]
    loop = services["cleanup"]["command"][0]
    used = re.findall(r"fastpubsub ([a-z-]+)", loop)
    assert used == ["cleanup-stuck-messages", "cleanup-acked-messages"]
    assert set(used) <= commands
    assert services["server"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    url = services["server"]["environment"]["FASTPUBSUB_DATABASE_URL"]
    assert "@postgres:5432/" in url


def test_compose_checks_each_service_by_what_it_serves_and_stops_it_gracefully() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    # The image's HEALTHCHECK asks the API's /liveness: only the server serves it.
    assert "healthcheck" not in services["server"]
    assert services["cleanup"]["healthcheck"] == {"disable": True}
    check = " ".join(services["push-worker"]["healthcheck"]["test"])
    settings = Settings(_env_file=None)
    assert f"127.0.0.1:{settings.push_metrics_port}/metrics" in check
    # A shell as process 1 ignores SIGTERM: an init passes it on to the loop.
    assert services["cleanup"]["init"] is True
    # Longer than gunicorn's graceful_timeout (the graceful seconds + 5).
    grace = int(services["server"]["stop_grace_period"].removesuffix("s"))
    assert grace > settings.api_graceful_seconds + 5


def test_the_server_pod_pauses_before_it_stops() -> None:
    deployment = named("Deployment", "fastpubsub")
    (server,) = containers(deployment)
    pause = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    # The pause, then gunicorn's graceful_timeout, within the pod's grace period.
    graceful = Settings(_env_file=None).api_graceful_seconds + 5
    assert int(pause[1]) + graceful < deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_compose_publishes_ports_on_the_loopback_address_only() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert services["server"]["ports"] == ["127.0.0.1:8000:8000"]
    # The image listens on 0.0.0.0, which the server refuses with auth off unless told it is meant.
    environment = services["server"]["environment"]
    assert environment.get("FASTPUBSUB_AUTH_ENABLED") == "true" or (
        environment.get("FASTPUBSUB_API_INSECURE_NO_AUTH") == "true"
    )
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_is_multi_stage_non_root_and_checks_liveness() -> None:
    instructions = dockerfile_instructions()
    stages = [arg for op, arg in instructions if op == "FROM"]
    assert len(stages) >= 2
    # Every stage starts from a slim image, or from a stage before it that did.
    named: set[str] = set()
    for stage in stages:
        assert "slim" in stage or stage.split()[0] in named, stage
        named.add(stage.split()[-1])
    users = [arg for op, arg in instructions if op == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    # The uid and gid the Kubernetes manifests run as (runAsUser, runAsGroup).
    assert users[-1] == f"{IMAGE_UID}:{IMAGE_GID}"
    entrypoint = dict(instructions)["ENTRYPOINT"]
    assert entrypoint == '["fastpubsub"]'
    assert dict(instructions)["CMD"] == '["server"]'
    healthcheck = dict(instructions)["HEALTHCHECK"]
    assert "/liveness" in healthcheck
    assert "/liveness" in api_paths()
    assert "FASTPUBSUB_API_PORT" in healthcheck


class _Liveness(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/liveness" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def run_healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    """Run the image's HEALTHCHECK command (its Python) with FASTPUBSUB_API_PORT set."""
    healthcheck = dict(dockerfile_instructions())["HEALTHCHECK"]
    command = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert command[:2] == ["python", "-c"]
    env = {**os.environ, "FASTPUBSUB_API_PORT": str(port)}
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_the_healthcheck_follows_fastpubsub_api_port(status: int, healthy: bool) -> None:
    handler = type("Handler", (_Liveness,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = run_healthcheck(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy, result.stderr
    assert "Traceback" not in result.stderr


def test_the_healthcheck_fails_when_nothing_listens() -> None:
    result = run_healthcheck(free_port())
    assert result.returncode != 0
    assert result.stderr.startswith("unhealthy: ")


@pytest.mark.parametrize(
    "command", ["server", "db-migrate", "cleanup-acked-messages", "cleanup-stuck-messages"]
)
def test_documented_container_commands_exist(command: str) -> None:
    assert command in cli_commands()
    readme = (ROOT / "README.md").read_text()
    assert f"fastpubsub {command}" in readme or shlex.quote(command) in readme


def every_cli_command() -> list[str]:
    """Every command as typed after `fastpubsub`, hidden spellings and sub-commands included."""
    names = []
    for name, command in get_command(cli_app).commands.items():  # type: ignore[attr-defined]
        names.append(name)
        names += [f"{name} {sub}" for sub in getattr(command, "commands", {})]
    return names


def test_readme_names_every_cli_command() -> None:
    readme = (ROOT / "README.md").read_text()
    names = every_cli_command()
    for expected in ("report", "bench", "bench all", "bench sql", "cleanup_acked_messages", "db_migrate"):
        assert expected in names
    missing = [name for name in names if not re.search(rf"fastpubsub {re.escape(name)}(?![\w-])", readme)]
    assert missing == []


def test_readme_names_every_api_route() -> None:
    app = create_app(Settings(_env_file=None, database_url="postgresql://unused@127.0.0.1:1/x"))
    routes = set(app.openapi()["paths"]) | {
        path for route in app.routes if (path := getattr(route, "path", None))
    }
    assert {"/oauth/token", "/subscriptions/{subscription_id}/stream", "/docs", "/redoc"} <= routes
    readme = (ROOT / "README.md").read_text()
    # The README writes every path parameter as {id}.
    missing = [
        route
        for route in sorted(routes)
        if not re.search(re.escape(re.sub(r"\{\w+\}", "{id}", route)) + r"(?![\w/{-])", readme)
    ]
    assert missing == []


def test_the_archive_and_the_cleanup_are_paired_and_the_spark_image_has_what_spark_needs() -> None:
    documents = applied_documents()
    (config,) = [doc for doc in documents if doc["kind"] == "ConfigMap"]
    assert config["data"]["FASTPUBSUB_CLEANUP_ACKED_ONLY_ARCHIVED"] == "true"
    where = config["data"]["FASTPUBSUB_ARCHIVE_URI"]
    Settings(_env_file=None, archive_uri=where, cleanup_acked_only_archived=True)  # a valid pair
    (archive,) = [doc for doc in workloads() if containers(doc)[0]["args"][0] == "archive"]
    (container,) = containers(archive)
    volumes = {volume["name"]: volume for volume in pod_spec(archive)["volumes"]}
    (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == where]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in {doc["metadata"]["name"] for doc in documents if doc["kind"] == "PersistentVolumeClaim"}
    # Spark's scratch space and HOME are the writable /tmp volume (the root is read-only).
    assert {"name": "HOME", "value": "/tmp"} in container["env"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    spark_stage = dockerfile[dockerfile.index(" AS spark") : dockerfile.index("\nFROM runtime-slim\n")]
    assert "openjdk-17-jre-headless" in spark_stage
    # Debian's driver lands where fastpubsub looks first after FASTPUBSUB_JDBC_JAR.
    from fastpubsub.spark.launch import SYSTEM_JDBC_JAR

    assert "libpostgresql-jdbc-java" in spark_stage
    assert str(SYSTEM_JDBC_JAR) == "/usr/share/java/postgresql.jar"
    assert 'pip install ".[spark]"' in dockerfile
    assert "USER 10001:10001" in spark_stage
