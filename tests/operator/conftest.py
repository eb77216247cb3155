"""Fixtures for the operator tests: the API emulator, clients on it, the running operator."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from k8s_emulator import EmulatorThread
from omni_operator.controller.kube import Kube
from omni_operator.controller.reconcile import Reconciler
from omnip_support import NAMESPACE, RunningOperator, make_kube


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread() as emu:
        yield emu


@pytest.fixture
def kube(emulator: EmulatorThread) -> Iterator[Kube]:
    """The test's own client (a user with kubectl, or the cluster's controllers)."""
    client = make_kube(emulator.url)
    client.request("create", "Namespace", "POST", "/api/v1/namespaces",
                   body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    yield client
    client.close()


@pytest.fixture
def reconciler(emulator: EmulatorThread) -> Iterator[Reconciler]:
    """A reconciler with a client of its own on the emulator (the operator's identity)."""
    client = make_kube(emulator.url)
    reconciler = Reconciler(client)
    yield reconciler
    reconciler.close()
    client.close()


@pytest.fixture
def start_operator(emulator: EmulatorThread, kube: Kube) -> Iterator[Callable[..., RunningOperator]]:
    started: list[RunningOperator] = []

    def start(**kwargs: Any) -> RunningOperator:
        op = RunningOperator(emulator.url, kwargs.pop("namespaces", [NAMESPACE]), **kwargs).start()
        started.append(op)
        return op

    yield start
    for op in started:
        if not op.stop_flag.is_set():
            op.stop()
