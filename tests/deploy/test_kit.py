"""The deployment kit, checked offline by the real tools: ``docker-compose config`` (Debian's
docker-compose; no container engine needed) for compose.yaml, ``kubernetes-validate`` for the
Kubernetes manifests, and the image installing kvwarden exactly as the Makefile does."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataplane.server.config import Settings
from tests.helpers import ROOT

K8S = ROOT / "deploy" / "k8s"
BUILTIN = ["daemonset.yaml", "service.yaml", "secret.example.yaml"]


def compose(*args: str, token: str | None = "t0ken", cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(cwd)}
    if token is not None:
        env["KVWARDEN_ADMIN_TOKEN"] = token
    return subprocess.run(
        ["docker-compose", "-f", str(cwd / "compose.yaml"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_config_accepts_the_stack() -> None:
    p = compose("config")
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    svc = cfg["services"]
    assert set(svc) == {"kvwarden", "fs-init", "redis", "prometheus", "grafana"}
    one_shot = {"fs-init"}  # runs once and exits: waited for as completed, not healthy
    for name, s in svc.items():
        for port in s.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)  # loopback only
        for dep_name, dep in s.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep_name in one_shot else "service_healthy"
            assert dep["condition"] == want, (name, dep_name)
        assert ("healthcheck" in s) == (name not in one_shot), name
    assert "ports" not in svc["redis"]  # the remote tier is not published
    kv = svc["kvwarden"]
    assert kv["build"]["context"] == str(ROOT) and kv["environment"]["KVWARDEN_ADMIN_TOKEN"] == "t0ken"
    assert kv["shm_size"] and "--remote-url" in kv["command"]
    mounts = [str(v).split(":")[0] for s in svc.values() for v in s.get("volumes", [])]
    binds = [m for m in mounts if m.startswith("/")]
    assert len(binds) == 3 and all(Path(m).exists() for m in binds), mounts


def _image_uid() -> int:
    """The uid the image runs as (the Dockerfile's ``useradd --uid``)."""
    m = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert m is not None
    return int(m.group(1))


def _fs_settings(env: dict[str, str], tmp_path: Path) -> Settings:
    """The settings ``env`` (KVWARDEN_* variables) gives the server, its fs_path a directory of
    ``tmp_path`` (the server checks that it exists)."""
    assert all(k.startswith("KVWARDEN_") for k in env)
    fields = {k[len("KVWARDEN_") :].lower(): v for k, v in env.items()}
    assert set(fields) <= set(Settings.model_fields), sorted(set(fields) - set(Settings.model_fields))
    fields["fs_path"] = str(tmp_path)
    fields.pop("admin_token", None)
    return Settings.model_validate(fields)


def test_compose_puts_the_file_tier_on_a_volume_the_server_owns(tmp_path: Path) -> None:
    p = compose("config")
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    kv, init = cfg["services"]["kvwarden"], cfg["services"]["fs-init"]
    env = {k: str(v) for k, v in kv["environment"].items()}
    path = env["KVWARDEN_FS_PATH"]
    volume = {str(v).split(":")[1]: str(v).split(":")[0] for v in kv["volumes"]}[path]
    assert volume in cfg["volumes"]  # a named volume, not a directory of the host
    assert f"{volume}:{path}:rw" in init["volumes"]
    assert init["command"] == ["chown", f"{_image_uid()}:{_image_uid()}", path]
    s = _fs_settings(env, tmp_path)
    assert s.fs_size_gb > 0


def test_compose_names_the_missing_admin_token() -> None:
    p = compose("config", token=None)
    assert p.returncode != 0 and "KVWARDEN_ADMIN_TOKEN" in p.stderr and ".env" in p.stderr


def test_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    text = (ROOT / "compose.yaml").read_text().replace("condition: service_healthy", "condition: healthy", 1)
    (tmp_path / "compose.yaml").write_text(text)
    p = compose("config", cwd=tmp_path)
    assert p.returncode != 0 and "condition" in p.stderr


def _makefile_install() -> str:
    """The command the Makefile installs kvwarden with (its plain install recipe)."""
    mk = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(INSTALL_STAMP\):.*\n((?:\t.*\n)+)", mk, re.M)
    assert recipe is not None
    (line,) = [ln.strip() for ln in recipe.group(1).splitlines() if "pip install" in ln]
    return line.replace("$(BIN)/python", "python")


def test_the_image_installs_kvwarden_as_the_makefile_does() -> None:
    docker = (ROOT / "Dockerfile").read_text()
    runs = [
        ln[len("RUN ") :].strip()
        for ln in docker.splitlines()
        if ln.startswith("RUN ") and "pip install" in ln
    ]
    assert runs == [_makefile_install()] == ["python -m pip install -e ."]
    assert re.search(r"^USER kvwarden$", docker, re.M)  # not root
    health = next(ln for ln in docker.splitlines() if ln.strip().startswith('CMD ["python"'))
    assert "/livez" in health and "curl" not in docker
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", docker, re.M)
    assert "download.pytorch.org/whl/cpu" in docker


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubernetes-validate") or str(
        Path(__import__("sys").executable).parent / "kubernetes-validate"
    )
    return subprocess.run([exe, "--strict", *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_kubernetes_manifests_validate_offline() -> None:
    p = validate(*(K8S / f for f in BUILTIN))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("passed") == len(BUILTIN)


def test_kubernetes_validate_catches_a_broken_manifest(tmp_path: Path) -> None:
    bad = tmp_path / "daemonset.yaml"
    bad.write_text((K8S / "daemonset.yaml").read_text().replace("livenessProbe:", "livenesProbe:"))
    p = validate(bad)
    assert p.returncode != 0 and "livenesProbe" in p.stdout + p.stderr


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((K8S / name).read_text())
    return doc


def test_the_daemonset_probes_shares_memory_and_is_sized_from_l1() -> None:
    ds = load("daemonset.yaml")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert (
        c["livenessProbe"]["httpGet"]["path"] == "/livez"
        and c["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    (secret,) = [e for e in c["env"] if e["name"] == "KVWARDEN_ADMIN_TOKEN"]
    assert secret["valueFrom"]["secretKeyRef"]["name"] == load("secret.example.yaml")["metadata"]["name"]
    l1_gb = float(c["args"][c["args"].index("--l1-size-gb") + 1])
    request = c["resources"]["requests"]["memory"]
    assert request.endswith("Gi") and float(request[:-2]) >= l1_gb + 1
    shm = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert shm and any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    svc, mon = load("service.yaml"), load("servicemonitor.yaml")
    assert svc["spec"]["selector"] == ds["spec"]["template"]["metadata"]["labels"]
    assert mon["spec"]["selector"]["matchLabels"] == svc["metadata"]["labels"]
    assert mon["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).exists() for r in kust["resources"])


def test_the_daemonset_puts_the_file_tier_on_the_node_disk_owned_by_the_server(tmp_path: Path) -> None:
    spec = load("daemonset.yaml")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    path = env["KVWARDEN_FS_PATH"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["type"] == "DirectoryOrCreate"
    uid = spec["securityContext"]["runAsUser"]
    assert uid == _image_uid()
    (init,) = spec["initContainers"]
    assert init["command"] == ["chown", f"{uid}:{uid}", path]
    assert {"name": mount["name"], "mountPath": path} in init["volumeMounts"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    s = _fs_settings(env, tmp_path)
    assert s.fs_size_gb > 0 and s.host == "0.0.0.0"


@pytest.mark.parametrize("name", ["servicemonitor.yaml", "prometheusrule.yaml"])
def test_operator_resources_name_their_kind(name: str) -> None:
    doc = load(name)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["metadata"]["name"] == "kvwarden"
