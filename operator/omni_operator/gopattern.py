"""Kubernetes' regular expressions, evaluated as the API server evaluates them: with Go's
regexp, whose syntax and semantics are RE2's.

Python's ``re`` reads the same patterns differently, in ways a user's value reaches:

* ``$`` also matches before a final newline, so ``"8\\n"`` (what kubectl sends for a YAML
  block scalar, ``key: |``) passes ``^[0-9]+$``; in Go ``$`` is the end of the text;
* ``\\d``, ``\\w`` and ``\\s`` are Unicode classes (``\\d`` takes Arabic-Indic digits, ``\\S``
  refuses a no-break space); Go's are ASCII (``\\s`` is ``[\\t\\n\\f\\r ]``);
* look-arounds and back-references, which Go refuses, are accepted.

So every pattern the operator evaluates for Kubernetes goes through :func:`matches` here: the
CRD's ``pattern`` keywords (:data:`SchemaValidator`, the JSON Schema validator of the CRD,
``crd-check`` and the Kubernetes schemas), CEL's ``matches()`` (``validation.py``), and
apimachinery's own expressions (names, label keys and values, qualified names:
``objectmeta.py``; the operator's command line: ``main.py``). It runs RE2 itself (google-re2,
which cel-python depends on). A test keeps Python's ``re`` away from anchored patterns in the
operator (tests/operator/test_go_semantics.py).
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import jsonschema
import re2

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a pattern Go refuses is reported to the caller, not on stderr


class PatternError(ValueError):
    """A pattern Go's regexp does not compile."""


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        raise PatternError(f"invalid regular expression {pattern!r}: "
                           f"{exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc}") from None


def compile(pattern: str) -> Any:  # noqa: A001 - the name regexp.Compile has
    """The compiled pattern (cached); PatternError when Go's regexp would refuse it."""
    return _compiled(pattern)


def matches(pattern: str, text: str) -> bool:
    """Go's ``regexp.MatchString(pattern, text)``: whether the text holds a match (a pattern
    anchors itself with ``^`` and ``$``). PatternError for a pattern Go refuses."""
    regexp = _compiled(pattern)
    try:
        return regexp.search(text) is not None
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800" in JSON): Go's JSON decoder makes it U+FFFD.
        return regexp.search(text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    """JSON Schema's ``pattern`` keyword, as the API server checks a CRD's ``pattern``."""
    if validator.is_type(instance, "string") and not matches(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


#: Draft 2020-12 with ``pattern`` evaluated as Go evaluates it: the validator of every schema
#: the operator checks Kubernetes objects against.
SchemaValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})
