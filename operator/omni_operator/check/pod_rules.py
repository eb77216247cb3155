"""What the API server's pod validation adds, for the fields a stage passes through to its
pod, beyond their types (which `kube_schema` checks against Kubernetes' own schemas) and
beyond what the CRD's schema and CEL rules state.

Ported from k8s.io/kubernetes/pkg/apis/core/validation (ValidateResourceRequirements,
validateContainerResourceDivisor) and its helpers, for the minimum server version:
- extended (domain-prefixed) resources: whole units, and they cannot be overcommitted: a
  request needs a limit, and equals it;
- hugepages-<size>: the size a page size, the amount a multiple of it, not overcommitted
  either, and only alongside cpu or memory;
- a resourceFieldRef's divisor: for cpu 1m or 1, for memory, ephemeral storage and hugepages
  a power of 1000 or 1024, as the server writes it back.
The rendered Deployment's container also carries the GPU limit the operator adds
(`render._resources`); these rules hold for it as for what the user wrote.
"""
from __future__ import annotations

from decimal import Decimal
from typing import Any

from omni_operator.pipeline.errors import Problem
from omni_operator.pipeline.model import Stage
from omni_operator.pipeline.quantities import canonical_quantity, parse_quantity

HUGEPAGES = "hugepages-"
_CPU_DIVISORS = {"1m", "1"}
_BYTE_DIVISORS = {"1", "1k", "1M", "1G", "1T", "1P", "1E", "1Ki", "1Mi", "1Gi", "1Ti", "1Pi", "1Ei"}


def stage_problems(where: str, stage: Stage) -> list[Problem]:
    return _resource_problems(f"{where}.resources", stage.resources) + _env_problems(f"{where}.env", stage.env)


def _key(where: str, name: str) -> str:
    return f"{where}[{name!r}]" if not name.replace("-", "").isalnum() else f"{where}.{name}"


def _overcommit_allowed(name: str) -> bool:
    """cpu, memory, ephemeral-storage (native, not hugepages) may be requested below their limit."""
    native = "/" not in name or "kubernetes.io/" in name
    return native and not name.startswith(HUGEPAGES)


def _page_size(name: str) -> Decimal | None:
    try:
        size = parse_quantity(name[len(HUGEPAGES):])
    except ValueError:
        return None
    return size if size > 0 and size == size.to_integral_value() else None


def _resource_problems(where: str, resources: dict[str, dict[str, Any]]) -> list[Problem]:
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    problems: list[Problem] = []
    for section, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            field = _key(f"{where}.{section}", name)
            try:
                amount = parse_quantity(value)
            except ValueError:
                continue  # the CRD's rules report it
            if "/" in name and not _overcommit_allowed(name) and amount != amount.to_integral_value():
                problems.append(Problem(field, f"an extended resource is counted in whole units (got {value!r})"))
            if name.startswith(HUGEPAGES):
                size = _page_size(name)
                if size is None:
                    problems.append(Problem(field, f"{name[len(HUGEPAGES):]!r} is not a page size: name huge pages "
                                                   "hugepages-<size>, e.g. hugepages-2Mi or hugepages-1Gi"))
                elif amount.to_integral_value(rounding="ROUND_CEILING") % size != 0:
                    problems.append(Problem(field, f"{value!r} is not a whole number of {name[len(HUGEPAGES):]} pages"))
    for name, value in requests.items():
        if _overcommit_allowed(name):
            continue
        field = _key(f"{where}.requests", name)
        what = "huge pages" if name.startswith(HUGEPAGES) else "an extended resource"
        if name not in limits:
            problems.append(Problem(field, f"{what} cannot be overcommitted: set limits[{name!r}] too, equal to "
                                           "the request (or set only the limit)"))
            continue
        try:
            same = parse_quantity(value) == parse_quantity(limits[name])
        except ValueError:
            continue
        if not same:
            problems.append(Problem(field, f"{what} cannot be overcommitted: its request must equal its limit "
                                           f"({limits[name]!r})"))
    uses_hugepages = any(n.startswith(HUGEPAGES) for n in [*requests, *limits])
    if uses_hugepages and not {"cpu", "memory"} & {*requests, *limits}:
        problems.append(Problem(where, "huge pages need a cpu or memory request or limit alongside them; add one"))
    return problems


def _env_problems(where: str, env: tuple[dict[str, Any], ...]) -> list[Problem]:
    problems = []
    first: dict[Any, int] = {}
    for i, item in enumerate(env):
        name = item.get("name")
        if name in first:
            problems.append(Problem(f"{where}[{i}].name", f"{name} is set twice (also {where}[{first[name]}]): "
                                                          "the container would get the last one only; keep one"))
        first.setdefault(name, i)
        ref = (item.get("valueFrom") or {}).get("resourceFieldRef")
        if not ref or ref.get("divisor") in (None, ""):
            continue
        resource = ref.get("resource") or ""
        kind = resource.partition(".")[2]
        allowed = _CPU_DIVISORS if kind == "cpu" else (
            _BYTE_DIVISORS if kind in ("memory", "ephemeral-storage") or kind.startswith(HUGEPAGES) else None)
        if allowed is None:
            continue
        try:
            divisor = canonical_quantity(ref["divisor"])
        except ValueError:
            continue  # the CRD's rules report it
        if divisor not in allowed:
            choices = ", ".join(sorted(allowed, key=lambda d: (len(d), d)))
            problems.append(Problem(f"{where}[{i}].valueFrom.resourceFieldRef.divisor",
                                    f"{ref['divisor']!r} (the API server reads it as {divisor}) is not a divisor of "
                                    f"{resource}; use one of {choices}"))
    return problems
