"""Containers started as Kubernetes would start a pod: the pod spec (what the operator renders
for a stage, or the chart for the operator) translated into one `podman run`, and stopped as
the kubelet stops it (SIGTERM, then SIGKILL after terminationGracePeriodSeconds).

There is no kubelet here, so this translation stands in for one. It takes from the pod spec:
the image, command and args, env (values and the downward API's pod name and namespace),
the user and group, capabilities, privilege escalation, a read-only root file system, the
volumes (a ConfigMap: its files, mounted read-only; an emptyDir: a tmpfs, of the pod's
size limit for medium Memory; a PersistentVolumeClaim: a host directory the test names), the
memory limit and the declared container ports, each published on 127.0.0.1 only. A spec
field it does not know fails the translation, so nothing is silently left out.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import free_port

ROOT = Path(__file__).resolve().parents[2]
# The project's podman settings (as the Makefile exports them); never the machine's /etc.
PODMAN_ENV = {
    "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "images" / "storage.conf"),
}

# Pod and container fields this translation carries over (or that have no meaning for one
# container on one machine: probes are the test's waits, labels/annotations are metadata).
_POD_KEYS = {"containers", "volumes", "securityContext", "terminationGracePeriodSeconds",
             "automountServiceAccountToken", "enableServiceLinks", "serviceAccountName",
             "nodeSelector", "tolerations"}
_CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "ports", "env", "resources",
                   "startupProbe", "readinessProbe", "livenessProbe", "volumeMounts", "securityContext"}


def podman(*args: str, check: bool = True, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, **PODMAN_ENV}
    result = subprocess.run(["podman", *args], env=env, timeout=timeout, capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:2])} ... exited {result.returncode}: {result.stderr[-3000:]}")
    return result


def _memory(quantity: str) -> str:
    """A Kubernetes memory quantity as podman's --memory wants it (bytes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return str(int(float(quantity[: -len(suffix)]) * factor))
    return str(int(quantity))


@dataclass
class PodContainer:
    """One running container of a pod spec; `url(port_name)` reaches a declared port."""

    name: str
    grace_seconds: int
    ports: dict[str, int]  # port name -> host port on 127.0.0.1 (host network: the container's own)
    exit_code: int | None = None
    removed: bool = False
    _log: str = field(default="", repr=False)

    def url(self, port_name: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_name]}"

    def inspect(self) -> dict[str, Any]:
        return json.loads(podman("inspect", self.name).stdout)[0]

    def running(self) -> bool:
        return self.inspect()["State"]["Running"]

    def ip(self) -> str:
        return self.inspect()["NetworkSettings"]["IPAddress"]

    def logs(self) -> str:
        if self.removed:
            return self._log
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def terminate(self) -> tuple[int, float]:
        """As the kubelet stops a pod: SIGTERM, SIGKILL after the grace period. Returns the exit
        code and the seconds it took."""
        start = time.monotonic()
        podman("stop", "--time", str(self.grace_seconds), self.name, timeout=self.grace_seconds + 60)
        elapsed = time.monotonic() - start
        self.exit_code = int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())
        return self.exit_code, elapsed

    def remove(self) -> None:
        """Stop (if still running) and remove the container, keeping its log for reports."""
        if self.removed:
            return
        self._log = self.logs()
        podman("rm", "--force", "--time", "5", self.name, check=False, timeout=90)
        self.removed = True


def start_pod(pod_spec: dict[str, Any], *, pod_name: str, namespace: str, config_maps: dict[str, dict[str, str]],
              claims: dict[str, Path] | None = None, hosts: dict[str, str] | None = None,
              host_network: bool = False, workdir: Path, container_name: str | None = None) -> PodContainer:
    """Start one container of the pod: its only one, or ``container_name`` (the entry stage's
    pod holds the pipeline's endpoint beside the stage: a second container this one-container
    translation leaves out). `config_maps`: ConfigMap name -> its data; `claims`:
    PersistentVolumeClaim name -> host directory; `hosts`: extra name -> IP (the cluster DNS
    of the Services the pod talks to). With host_network the container shares the machine's
    network (its declared ports must then be free there); else each declared port is
    published on a free port of 127.0.0.1."""
    unknown = set(pod_spec) - _POD_KEYS
    assert not unknown, f"pod spec fields this translation does not handle: {sorted(unknown)}"
    if container_name is None:
        (container,) = pod_spec["containers"]
    else:
        (container,) = [c for c in pod_spec["containers"] if c["name"] == container_name]
    unknown = set(container) - _CONTAINER_KEYS
    assert not unknown, f"container fields this translation does not handle: {sorted(unknown)}"
    pod_sc, sc = pod_spec.get("securityContext", {}), container.get("securityContext", {})
    name = f"omni-test-{pod_name}-{uuid.uuid4().hex[:8]}"
    argv = ["run", "--detach", "--name", name, "--hostname", pod_name]

    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if user is not None:
        argv += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if pod_sc.get("fsGroup") is not None:
        argv += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot"):
        assert user not in (None, 0), "runAsNonRoot needs a non-zero runAsUser (the kubelet would refuse)"
    if "ALL" in sc.get("capabilities", {}).get("drop", []):
        argv.append("--cap-drop=all")
    if sc.get("allowPrivilegeEscalation") is False:
        argv.append("--security-opt=no-new-privileges")
    if sc.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    if "memory" in container.get("resources", {}).get("limits", {}):
        argv += ["--memory", _memory(container["resources"]["limits"]["memory"])]

    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if "configMap" in volume:
            data = config_maps[volume["configMap"]["name"]]
            directory = workdir / f"{pod_name}-{mount['name']}"
            directory.mkdir(mode=0o755)
            directory.chmod(0o755)  # readable by the pod's user, like a ConfigMap volume
            for key, text in data.items():
                (directory / key).write_text(text)
                (directory / key).chmod(0o644)
            argv += ["--volume", f"{directory}:{path}:ro"]  # ConfigMap volumes are read-only
        elif "emptyDir" in volume:
            empty = volume["emptyDir"]
            if path == "/dev/shm":
                argv += ["--shm-size", _memory(empty.get("sizeLimit", "64Mi"))]
            else:
                size = f",size={_memory(empty['sizeLimit'])}" if "sizeLimit" in empty else ""
                argv += ["--tmpfs", f"{path}:rw,exec,mode=1777{size}"]
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            read_only = mount.get("readOnly") or claim.get("readOnly")
            argv += ["--volume", f"{(claims or {})[claim['claimName']]}:{path}{':ro' if read_only else ''}"]
        else:
            raise AssertionError(f"volume {volume} is not one this translation handles")

    for item in container.get("env", []):
        if "value" in item:
            argv += ["--env", f"{item['name']}={item['value']}"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            value = {"metadata.name": pod_name, "metadata.namespace": namespace, "status.podIP": "127.0.0.1"}[path]
            argv += ["--env", f"{item['name']}={value}"]

    ports: dict[str, int] = {}
    if host_network:
        argv += ["--network", "host"]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    else:
        for port in container.get("ports", []):
            host_port = free_port()
            argv += ["--publish", f"127.0.0.1:{host_port}:{port['containerPort']}/{port.get('protocol', 'TCP').lower()}"]
            ports[port["name"]] = host_port
    for host, ip in (hosts or {}).items():
        argv += ["--add-host", f"{host}:{ip}"]

    # command replaces the image's ENTRYPOINT, args its CMD (as Kubernetes does).
    command, args = container.get("command"), container.get("args")
    if command is not None:
        argv += ["--entrypoint", json.dumps(command)]
    argv.append(container["image"])
    if args is not None:
        argv += list(args)
    podman(*argv)
    return PodContainer(name=name, grace_seconds=pod_spec.get("terminationGracePeriodSeconds", 30), ports=ports)


def podman_available() -> bool:
    return shutil.which("podman") is not None
