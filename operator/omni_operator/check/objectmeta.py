"""The pipeline's own metadata, checked as the API server checks any object's ObjectMeta.

Two parts, each from its source:
- the shape: Kubernetes' own ObjectMeta definition (types, no unknown field, as kubectl's
  strict field validation reports them), through `kube_schema`, plus the name kubectl apply
  needs;
- the rules apimachinery's `ValidateObjectMeta` adds (k8s.io/apimachinery/pkg/api/validation
  and pkg/util/validation): label keys and values, annotation keys and their total size,
  the namespace name, owner references and finalizer names.

No Python library carries apimachinery's rules, so they are ported here function for
function (IsQualifiedName, IsValidLabelValue, IsDNS1123Label/Subdomain), with upstream's
messages, each naming the field and, where there is one, the fix.
"""
from __future__ import annotations

from typing import Any, Iterable

from .gopattern import matches
from .kube_schema import OBJECT_META, check_value
from .schema_errors import key_path

# k8s.io/apimachinery/pkg/util/validation
QUALIFIED_NAME_MAX = 63
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
# Upstream's expressions, evaluated as Go evaluates them (gopattern: "$" is the end of the
# text, so "ml\n" is no label value).
_QUALIFIED_NAME = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# k8s.io/apimachinery/pkg/api/validation
TOTAL_ANNOTATION_SIZE_LIMIT = 256 * (1 << 10)
_ORPHAN, _FOREGROUND = "orphan", "foregroundDeletion"


def is_dns1123_label(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_LABEL_MAX:
        errors.append(f"must be no more than {DNS1123_LABEL_MAX} characters")
    if not matches(_DNS1123_LABEL, value):
        errors.append("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                      "and must start and end with an alphanumeric character (e.g. 'my-name', or '123-abc')")
    return errors


def is_dns1123_subdomain(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters")
    if not matches(_DNS1123_SUBDOMAIN, value):
        errors.append("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                      "'.', and must start and end with an alphanumeric character (e.g. 'example.com')")
    return errors


def is_qualified_name(value: str) -> list[str]:
    """A label key, annotation key (lower-cased) or finalizer: [prefix/]name."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errors: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors = ["prefix part must be non-empty"]
        else:
            errors = [f"prefix part {msg}" for msg in is_dns1123_subdomain(prefix)]
    else:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                "with an alphanumeric character, with an optional DNS subdomain prefix and '/' "
                "(e.g. 'example.com/MyName')"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errors.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if name and not matches(_QUALIFIED_NAME, name):
        errors.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                      "with an alphanumeric character (e.g. 'MyName', or 'my.name', or '123-abc')")
    return errors


def is_valid_label_value(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not matches(_LABEL_VALUE, value):
        errors.append("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
                      "'.', and must start and end with an alphanumeric character (e.g. 'MyValue', or 'my_value')")
    return errors


def metadata_shape_problems(meta: Any) -> list[tuple[str, str]]:
    """Types and unknown fields of `metadata`, by Kubernetes' ObjectMeta definition, and the
    name kubectl apply needs."""
    if not isinstance(meta, dict):
        return []  # the CRD's schema reports it (metadata must be an object)
    problems = check_value(OBJECT_META, meta, "metadata")
    if not problems and not meta.get("name"):
        problems.append(("metadata", "'name' is a required property: kubectl apply needs a name"))
    return problems


def metadata_problems(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """apimachinery's ValidateObjectMeta for a namespaced custom resource (its shape checked
    first by `metadata_shape_problems`). A null field is the field's zero value, as Go's JSON
    decoder makes it."""
    problems: list[tuple[str, str]] = []
    namespace = meta.get("namespace")
    if namespace:
        problems += [("metadata.namespace", f"{namespace!r}: {m}") for m in is_dns1123_label(namespace)]
    labels = meta.get("labels") or {}
    for key, value in labels.items():
        problems += _key_problems("metadata.labels", key, is_qualified_name(key), "a label key")
        for message in is_valid_label_value(value or ""):
            problems.append((key_path("metadata.labels", key), f"{_shown(value)}: {message}"))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        problems += _key_problems("metadata.annotations", key, is_qualified_name(key.lower()), "an annotation key")
    size = sum(len(k.encode()) + len((v or "").encode()) for k, v in annotations.items())
    if size > TOTAL_ANNOTATION_SIZE_LIMIT:
        problems.append(("metadata.annotations", f"are {size} bytes in total, keys and values: the API server takes "
                                                 f"at most {TOTAL_ANNOTATION_SIZE_LIMIT} (256 KiB); move large data "
                                                 "elsewhere (a ConfigMap)"))
    problems += _owner_reference_problems(meta.get("ownerReferences") or [])
    problems += _finalizer_problems(meta.get("finalizers") or [])
    return problems


def _key_problems(where: str, key: str, messages: Iterable[str], what: str) -> list[tuple[str, str]]:
    return [(key_path(where, key), f"{_shown(key)} is not valid as {what}: {m}") for m in messages]


def _owner_reference_problems(refs: list[Any]) -> list[tuple[str, str]]:
    problems = []
    controller = None
    for i, ref in enumerate(refs):
        where = f"metadata.ownerReferences[{i}]"
        ref = ref or {}
        api_version = ref.get("apiVersion") or ""
        parts = api_version.split("/")
        version = parts[-1] if len(parts) <= 2 else ""
        if not version:
            problems.append((f"{where}.apiVersion", f"{_shown(api_version)}: version must not be empty"))
        for name in ("kind", "name", "uid"):
            if not ref.get(name):
                problems.append((f"{where}.{name}", "must not be empty"))
        if api_version == "v1" and ref.get("kind") == "Event":
            problems.append((where, "/v1, Kind=Event is disallowed from being an owner"))
        if ref.get("controller"):
            this = f"{ref.get('kind') or ''}/{ref.get('name') or ''}"
            if controller is not None:
                problems.append(("metadata.ownerReferences", "Only one reference can have Controller set to true. "
                                                             f"Found \"true\" in references for {controller} and {this}"))
            else:
                controller = this
    return problems


def _finalizer_problems(finalizers: list[Any]) -> list[tuple[str, str]]:
    problems = []
    for i, name in enumerate(finalizers):
        for message in is_qualified_name(name or ""):
            problems.append((f"metadata.finalizers[{i}]", f"{_shown(name or '')}: {message}; a finalizer is a "
                                                          "qualified name such as example.com/cleanup"))
    if _ORPHAN in finalizers and _FOREGROUND in finalizers:
        problems.append(("metadata.finalizers", f"finalizer {_ORPHAN} and {_FOREGROUND} cannot be both set"))
    return problems


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:80] + "...'"
