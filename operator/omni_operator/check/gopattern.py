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
``objectmeta.py``; the operator's command line: ``controller/main.py``). It runs RE2 itself (google-re2,
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
_OPTIONS.never_capture = True  # whether it matches is all that is asked
#: The RE2 call under the wrapper's search() (which also maps every offset back to the str):
#: about five times faster, and admission evaluates hundreds of patterns per pipeline.
_UNANCHORED = getattr(getattr(re2, "_Anchor", None), "UNANCHORED", None)
_NO_MATCH = (-1, -1)
#: Texts up to this long are remembered with their verdict: a child's labels and names repeat.
_CACHED_TEXT = 256


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
    if len(text) <= _CACHED_TEXT:
        return _remembered(pattern, text)
    return _matches(pattern, text)


@functools.lru_cache(maxsize=16384)
def _remembered(pattern: str, text: str) -> bool:
    return _matches(pattern, text)


def _matches(pattern: str, text: str) -> bool:
    regexp = _compiled(pattern)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate ("\ud800" in JSON): Go's JSON decoder makes it U+FFFD.
        data = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").encode("utf-8")
    inner = getattr(regexp, "_regexp", None)
    if inner is None or _UNANCHORED is None:  # another version of the wrapper
        return regexp.search(data) is not None
    return inner.Match(_UNANCHORED, data, 0, len(data))[0] != _NO_MATCH


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    """JSON Schema's ``pattern`` keyword, as the API server checks a CRD's ``pattern``."""
    if validator.is_type(instance, "string") and not matches(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


#: Draft 2020-12 with ``pattern`` evaluated as Go evaluates it: the validator of every schema
#: the operator checks Kubernetes objects against.
SchemaValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _pattern})
