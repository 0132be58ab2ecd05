"""Deployment files: they parse, and every probe and command points at something real."""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import subprocess
import sys
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


def containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {})
    if document["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return list(spec.get("template", {}).get("spec", {}).get("containers", []))


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
                for probe in ("livenessProbe", "readinessProbe"):
                    if probe in container:
                        http = container[probe]["httpGet"]
                        assert http["path"] in paths
                        assert http["port"] in ports or http["port"] in ports.values()
    (deployment,) = kinds["Deployment"]
    (server,) = containers(deployment)
    assert server["args"] == ["server"]
    assert server["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert server["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    (job,) = kinds["Job"]
    assert containers(job)[0]["args"] == ["db-migrate"]
    cron = {containers(c)[0]["args"][0]: c["spec"] for c in kinds["CronJob"]}
    assert set(cron) == {"cleanup-acked-messages", "cleanup-stuck-messages"}
    for spec in cron.values():
        assert len(spec["schedule"].split()) == 5
        assert spec["concurrencyPolicy"] == "Forbid"
    (service,) = kinds["Service"]
    assert service["metadata"]["annotations"]["prometheus.io/path"] in paths


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_kubernetes_uses_the_local_image_without_pulling_it() -> None:
    image = f"fastpubsub:{project_version()}"
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            for container in containers(document):
                # A versioned tag, never :latest, so every pod of a release runs the same build.
                assert container["image"] == image, (path.name, container["name"])
                # The local build is not on any registry: never make the kubelet pull it.
                assert container["imagePullPolicy"] == "IfNotPresent", (path.name, container["name"])
    kustomization = (ROOT / "deploy/kubernetes/kustomization.yaml").read_text()
    assert "docker push" in kustomization
    assert f"docker build -t {image} ." in kustomization
    readme = (ROOT / "README.md").read_text()
    assert f"docker build -t {image} ." in readme
    assert "fastpubsub:latest" not in readme + kustomization


def test_compose_services_run_real_commands() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", "server", "cleanup"}
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


def test_compose_publishes_ports_on_the_loopback_address_only() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert services["server"]["ports"] == ["127.0.0.1:8000:8000"]
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
    assert all("slim" in stage for stage in stages)
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
