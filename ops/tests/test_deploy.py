"""Deployment checks without a cluster: every kustomize overlay renders
(`kubectl kustomize`) and validates against the Kubernetes schemas
(`kubernetes-validate`), every lakecache container's flags exist in the
real CLI (`lakecache SUBCOMMAND --help`), and the systemd units' command
lines are run as written (readiness over $NOTIFY_SOCKET, ExecStop
unmount)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helpers import S3_ENV, lakecache_bin, start_s3, stop_all, testproc

DEPLOY = Path(__file__).resolve().parent.parent.parent / "deploy"
OVERLAYS = sorted(p for p in (DEPLOY / "kubernetes" / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.33.0"


def render(overlay: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing (scripts/deps.sh installs kubernetes-client)"
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def flags_of(subcommand: str) -> tuple[set[str], set[str]]:
    """The long flags and environment variables `lakecache SUBCOMMAND` takes."""
    text = subprocess.run(
        [lakecache_bin(), subcommand, "--help"], check=True, capture_output=True, text=True
    ).stdout
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", text)), set(re.findall(r"\[env: (\w+)=", text))


def containers(objs: list[dict]) -> list[tuple[dict, dict]]:
    out = []
    for obj in objs:
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        for c in (spec or {}).get("containers", []):
            out.append((obj, c))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_every_object_passes_the_kubernetes_schemas(overlay: Path) -> None:
    objs = render(overlay)
    kinds = sorted(o["kind"] for o in objs)
    assert {"StatefulSet", "DaemonSet", "Service", "ServiceMonitor", "ConfigMap"} <= set(kinds)
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # A CRD: no upstream schema; check what the operator needs.
            ports = {ep["port"] for ep in obj["spec"]["endpoints"]}
            assert ports == {"api", "metrics"}
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay.name}: {obj['kind']}/{obj['metadata']['name']}: {e}")
    print(f"{overlay.name}: {len(objs)} objects valid for Kubernetes {K8S_VERSION}: {kinds}")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_container_flag_and_variable_is_one_the_cli_takes(overlay: Path) -> None:
    objs = render(overlay)
    config_keys = set()
    for obj in objs:
        if obj["kind"] == "ConfigMap":
            config_keys |= set(obj.get("data", {}))
    checked = 0
    for obj, c in containers(objs):
        if "lakecache" not in c["image"]:
            continue
        sub, *args = c["args"]
        flags, env_names = flags_of(sub)
        defined = {e["name"] for e in c.get("env", [])} | config_keys
        positional = [a for a in args if not a.startswith("--")]
        expect_positional = {"mount": 2, "worker": 0}[sub]
        assert len(positional) == expect_positional, f"{sub}: positional args {positional}"
        for arg in args:
            for ref in re.findall(r"\$\((\w+)\)", arg):
                assert ref in defined, f"{obj['metadata']['name']}: $({ref}) is not defined"
            if arg.startswith("--"):
                flag = arg.split("=", 1)[0]
                assert flag in flags, f"{obj['metadata']['name']}: {flag} is not a `{sub}` flag"
                checked += 1
        for e in c.get("env", []):
            name = e["name"]
            if name.startswith("LAKECACHE_"):
                assert name in env_names, f"{name} is not read by `lakecache {sub}`"
        # The API port the probes use is the one the worker listens on.
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                port = c[probe]["httpGet"]["port"]
                assert port in {p["name"] for p in c["ports"]}
        if sub == "mount":
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert mounts["/mnt/data"].get("mountPropagation") == "Bidirectional"
            assert c["securityContext"].get("privileged") is True
    for key in config_keys:
        if key.startswith("LAKECACHE_") and key != "LAKECACHE_BUCKET":
            assert any(key in flags_of(s)[1] for s in ("worker", "mount")), key
    assert checked >= 15


def unit_lines(unit: str, key: str) -> list[str]:
    text = (DEPLOY / "systemd" / unit).read_text()
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}=")]


def run_unit_command(line: str, replace: dict[str, str], env: dict[str, str]) -> list[str]:
    """A unit's command line as systemd would run it: ${VAR} from the
    environment file, paths moved into the test's directory."""
    line = line.lstrip("-")
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    argv = shlex.split(line)
    return [replace.get(a, a) for a in argv]


def test_systemd_units_run_as_written_and_report_readiness(tmp_path: Path) -> None:
    binary = lakecache_bin()
    s3, s3_port = start_s3(binary, tmp_path / "s3")
    procs = [s3]
    mnt = tmp_path / "mnt"
    try:
        notify_path = tmp_path / "notify"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(testproc.scaled(60))
        config = tmp_path / "worker.toml"
        config.write_text(
            f'listen = "127.0.0.1:0"\ncache_dir = "{tmp_path / "cache"}"\n'
            f'cache_size = "1GiB"\ninsecure_http = true\nno_auth = true\n'
            f's3_endpoint = "http://127.0.0.1:{s3_port}"\ns3_path_style = true\n'
        )
        env = dict(os.environ)
        env.update(S3_ENV, NOTIFY_SOCKET=str(notify_path))
        replace = {
            "/usr/local/bin/lakecache": binary,
            "/etc/lakecache/worker.toml": str(config),
            "/mnt/data": str(mnt),
        }
        (worker_line,) = unit_lines("lakecache-worker.service", "ExecStart")
        worker = testproc.Child("worker unit", run_unit_command(worker_line, replace, env), env=env)
        procs.append(worker)
        assert notify.recv(256).startswith(b"READY=1"), "the worker unit never became ready"
        worker_port = worker.wait_for_port("lakecache worker listening on")
        health = urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/v1/health", timeout=5)
        assert health.status == 200

        # The mount unit, with the environment file its header describes.
        mount_env = {
            "LAKECACHE_SOURCE": "s3://data",
            "LAKECACHE_REGISTRY": f"static:127.0.0.1:{worker_port}",
        }
        (mount_line,) = unit_lines("lakecache-mount.service", "ExecStart")
        argv = run_unit_command(mount_line, replace, mount_env)
        # Port 9501 may be taken on a test machine; same flag, a port of its own.
        argv[argv.index("127.0.0.1:9501")] = "127.0.0.1:0"
        mount = testproc.Child("mount unit", argv, env={**env, **mount_env})
        procs.append(mount)
        assert notify.recv(256).startswith(b"READY=1"), "the mount unit never became ready"
        # Ready means usable: a write lands and reads back.
        (mnt / "hello.txt").write_text("through the unit\n")
        assert (mnt / "hello.txt").read_text() == "through the unit\n"
        (stop_line,) = unit_lines("lakecache-mount.service", "ExecStop")
        subprocess.run(run_unit_command(stop_line, replace, mount_env), check=True)
        assert mount.proc.wait(timeout=testproc.scaled(60)) == 0, mount.describe()
        (post_line,) = unit_lines("lakecache-mount.service", "ExecStopPost")
        # Nothing left to detach: the '-' prefix makes its failure harmless.
        assert unit_lines("lakecache-mount.service", "ExecStopPost")[0].startswith("-")
        subprocess.run(run_unit_command(post_line, replace, mount_env), check=False)
        assert not os.path.ismount(mnt)
        worker.proc.terminate()
        assert worker.proc.wait(timeout=testproc.scaled(60)) == 0, worker.describe()
    finally:
        stop_all(procs)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
