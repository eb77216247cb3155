"""Reading OmniPipeline files the way `kubectl apply -f` reads them, without ever raising
anything but `DocumentError`.

kubectl turns YAML into JSON before the API server sees it: sigs.k8s.io/yaml over go-yaml v2,
whose scalar rules are neither PyYAML's YAML 1.1 nor YAML 1.2. PyYAML parses the syntax here
(the same libyaml grammar); every scalar is then resolved by go-yaml v2's own rules (its
`resolve.go`) and converted as sigs.k8s.io/yaml converts it, so a document becomes the JSON
value the API server would get:

- booleans: `true`/`false`, `yes`/`no`, `on`/`off` in three casings, and the one-letter `y`,
  `Y`, `n`, `N`; null: `~`, `null` (three casings) and nothing;
- integers: Go's syntax (`0x1F`, `0o17`, `0b101`, a leading `0` for octal, `_` anywhere
  ignored); a float in Go's syntax (`1e3`, `1.`, `.5`); a number the JSON encoder writes
  without a fraction (`1e3`, `2.0`) is an integer to the API server; one beyond 64 bits a
  floating-point number; sexagesimal (`1:30`) and anything else are strings;
- a timestamp-looking scalar (`revision: 2024-01-01`) stays a string: go-yaml only makes a
  time of it when decoding into a time field, never into JSON;
- map keys that are numbers or booleans become strings as sigs.k8s.io/yaml writes them; a
  null key is refused, as kubectl refuses it; `<<` merges maps in order, as go-yaml does;
- what JSON cannot hold (binary `!!binary`, NaN, infinities, sets) is refused, naming where;
- a file that is not UTF-8 text, is over the API server's 3 MiB request limit, nests deeper
  than any OmniPipeline could, or expands (through YAML aliases) into more values than a
  request could carry, is refused before anything looks at it.
"""
from __future__ import annotations

import math
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .schema_errors import key_path

MAX_FILE_BYTES = 3 * 1024 * 1024  # kube-apiserver refuses request bodies over 3 MiB
MAX_DEPTH = 64  # an OmniPipeline nests about 8 deep; engineArgs leave room for more
MAX_VALUES = 200_000  # values after alias expansion ("billion laughs" stop here)

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
_TIMESTAMP, _MERGE, _BINARY, _MAP, _SEQ = (_TAG + t for t in ("timestamp", "merge", "binary", "map", "seq"))
#: The tag this loader gives a plain (unquoted) scalar: resolved later by go-yaml's rules.
_PLAIN = "!go-yaml-plain"
_INT64 = 2**63
_UINT64 = 2**64


class DocumentError(ValueError):
    """A document (or file) that cannot be turned into the JSON the API server would get."""


class _Loader(yaml.SafeLoader):
    """PyYAML's reader, scanner, parser and composer; no resolver of its own: a plain scalar
    is tagged for go-yaml's rules (`_resolve_plain`), anything quoted is a string."""

    def resolve(self, kind: type, value: Any, implicit: Any) -> str:
        if kind is ScalarNode:
            return _PLAIN if implicit[0] else _STR
        return _SEQ if kind is SequenceNode else _MAP


# -- go-yaml v2's resolve.go -----------------------------------------------------------------

_BOOLS = {**{s: True for s in ("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON")},
          **{s: False for s in ("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF")}}
_NULLS = {"", "~", "null", "Null", "NULL"}
_SPECIAL_FLOATS = {**{s: math.nan for s in (".nan", ".NaN", ".NAN")},
                   **{s: math.inf for s in (".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF")},
                   **{s: -math.inf for s in ("-.inf", "-.Inf", "-.INF")}}
# Matched whole (fullmatch: Python's `$` would also match before a final newline).
_YAML_STYLE_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
# Go's strconv.ParseInt(s, 0, 64) syntax once go-yaml removed the underscores: a sign, then
# a base prefix (0x, 0o, 0b, or a bare leading 0 for octal) or decimal digits.
_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO]?[0-7]+|0[bB][01]+|0|[1-9][0-9]*)")
_GO_DECIMAL_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _go_int(text: str) -> int | None:
    match = _GO_INT.fullmatch(text)
    if not match:
        return None
    sign, digits = match.groups()
    lower = digits.lower()
    if lower.startswith("0x"):
        value = int(lower[2:], 16)
    elif lower.startswith("0b"):
        value = int(lower[2:], 2)
    elif lower.startswith("0o"):
        value = int(lower[2:], 8)
    elif len(lower) > 1 and lower.startswith("0"):
        value = int(lower[1:], 8)
    else:
        value = int(lower)
    return -value if sign == "-" else value


def _go_float(text: str) -> float | None:
    """strconv.ParseFloat(text, 64) for go-yaml's decimal forms; None on a syntax error or
    an overflow (which Go reports as an error)."""
    if not _GO_DECIMAL_FLOAT.fullmatch(text):
        return None
    value = float(text)
    return None if math.isinf(value) else value


def _resolve_plain(text: str) -> Any:
    """The value go-yaml v2 gives a plain scalar (its `resolve` with no tag)."""
    hint = text[:1]
    if text in _BOOLS:
        return _BOOLS[text]
    if text in _NULLS:
        return None
    if text in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[text]
    if hint == ".":
        value = _go_float(text)
        return text if value is None else value
    if hint and (hint in "+-" or hint.isdigit()):
        # A timestamp (2024-01-01) would resolve to one here, and go-yaml hands it to JSON
        # as the text it was: the same as the string below.
        plain = text.replace("_", "")
        number = _go_int(plain)
        if number is not None and -_INT64 <= number < _UINT64:
            return number
        if _YAML_STYLE_FLOAT.fullmatch(plain):
            value = _go_float(plain)
            if value is not None:
                return value
        if number is not None:  # beyond 64 bits and not a float: go-yaml keeps a big integer
            return number
    return text


def _resolve_tagged(tag: str, text: str, where: str) -> Any:
    """A scalar with an explicit core tag (!!int "3"), as go-yaml decodes it."""
    if tag == _STR:
        return text
    value = _resolve_plain(text)
    if tag == _TIMESTAMP:
        if re.match(r"^[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}", text):
            return text  # decoded into JSON as the text it was
        got = "!!str"
    elif tag == _NULL and value is None or tag == _BOOL and isinstance(value, bool):
        return value
    elif tag == _INT and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tag == _FLOAT and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    else:
        got = _tag_of(value)
    raise DocumentError(f"{where or 'the document'}: cannot decode {got} `{text}` as a !!{tag[len(_TAG):]}")


def _tag_of(value: Any) -> str:
    if value is None:
        return "!!null"
    if isinstance(value, bool):
        return "!!bool"
    if isinstance(value, int):
        return "!!int"
    if isinstance(value, float):
        return "!!float"
    return "!!str"


# -- sigs.k8s.io/yaml's conversion to JSON -----------------------------------------------------

def _json_number(value: int | float, where: str) -> int | float:
    """What the API server decodes the JSON that Go's encoder writes for a number: an integer
    when written without a fraction and within int64, else a float64."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            shown = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
            raise DocumentError(f"{where or 'the document'}: {shown} is not a JSON number; quote it or use a finite number")
        # Go writes an integral float64 below 1e21 without a fraction or exponent.
        if value.is_integer() and -_INT64 <= value < _INT64:
            return int(value)
        return value
    if -_INT64 <= value < _INT64:
        return value
    as_float = float(value) if abs(value) < 1e308 else math.inf
    if math.isinf(as_float):
        raise DocumentError(f"{where or 'the document'}: the number {str(value)[:20]}... is too large for the API server")
    return as_float


def _key_string(value: Any, where: str) -> str:
    """A map key as sigs.k8s.io/yaml turns it into a JSON field name."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and -_INT64 <= value < _INT64:
        return str(value)
    if isinstance(value, float):
        return _format_float32_g(value)
    shown = "null" if value is None else "a number beyond 64 bits"
    raise DocumentError(f"{where or 'the document'}: a {shown} map key cannot be sent to the API server; "
                        "quote the key")


def _format_float32_g(value: float) -> str:
    """Go's strconv.FormatFloat(value, 'g', -1, 32): the shortest decimal that reads back as
    the same float32, in %e form when its exponent is below -4 or at least 6."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    single = struct.unpack("f", struct.pack("f", value))[0] if abs(value) < 3.5e38 else value
    if math.isinf(single) or single == 0:
        return ".inf" if single > 0 else ("-.inf" if single < 0 else ("-0" if math.copysign(1, value) < 0 else "0"))
    for digits in range(1, 10):
        text = f"{single:.{digits - 1}e}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == single:
            break
    mantissa, exponent = text.split("e")
    exp = int(exponent)
    significant = mantissa.replace(".", "").replace("-", "").rstrip("0") or "0"
    sign = "-" if single < 0 else ""
    if exp < -4 or exp >= 6:  # Go's %g decision for the shortest form
        head = significant[0] + ("." + significant[1:] if len(significant) > 1 else "")
        return f"{sign}{head}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if exp < 0:
        return f"{sign}0.{'0' * (-exp - 1)}{significant}"
    if len(significant) <= exp + 1:
        return f"{sign}{significant}{'0' * (exp + 1 - len(significant))}"
    return f"{sign}{significant[:exp + 1]}.{significant[exp + 1:]}"


class _Builder:
    """Turns composed YAML nodes into the JSON value kubectl would send."""

    def __init__(self) -> None:
        self.budget = MAX_VALUES

    def value(self, node: Node, where: str, depth: int) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise DocumentError(f"expands into more than {MAX_VALUES} values (YAML aliases?); "
                                "no OmniPipeline is that large")
        if depth > MAX_DEPTH:
            raise DocumentError(f"{where or 'the document'}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, ScalarNode):
            return self.scalar(node, where)
        if isinstance(node, SequenceNode):
            self.collection_tag(node, _SEQ, where)
            return [self.value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        self.collection_tag(node, _MAP, where)
        out: dict[str, Any] = {}
        self.fill(out, node, where, depth)
        return out

    def scalar(self, node: ScalarNode, where: str) -> Any:
        value = self.resolved(node, where)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _json_number(value, where)
        return value

    @staticmethod
    def resolved(node: ScalarNode, where: str) -> Any:
        """The Go value go-yaml decodes a scalar into (before any JSON conversion)."""
        tag = node.tag
        if tag == _PLAIN:
            return _resolve_plain(node.value)
        if tag == _BINARY:
            raise DocumentError(f"{where or 'the document'}: binary (!!binary) values cannot be sent to the API "
                                "server; use a string")
        if tag.startswith(_TAG):
            return _resolve_tagged(tag, node.value, where)
        return node.value  # a local tag (!thing): go-yaml keeps the text

    @staticmethod
    def collection_tag(node: Node, default: str, where: str) -> None:
        if node.tag.startswith(_TAG) and node.tag != default:
            raise DocumentError(f"{where or 'the document'}: a !!{node.tag[len(_TAG):]} cannot be sent to the API "
                                "server; use a string, number, list or map")

    def fill(self, out: dict[str, Any], node: MappingNode, where: str, depth: int) -> None:
        """The pairs of a mapping in order, as go-yaml v2 decodes them: a later key replaces
        an earlier one, and `<<` merges its map (or maps, the first winning) at its place."""
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.tag == _PLAIN and key_node.value == "<<":
                self.merge(out, value_node, where, depth)
                continue
            if not isinstance(key_node, ScalarNode):
                kind = "list" if isinstance(key_node, SequenceNode) else "map"
                raise DocumentError(f"not valid YAML: {where or 'the document'}: a map key must be a string, "
                                    f"not a {kind}")
            name = _key_string(self.resolved(key_node, where), where)
            out[name] = self.value(value_node, key_path(where, name), depth + 1)

    def merge(self, out: dict[str, Any], node: Node, where: str, depth: int) -> None:
        sources = node.value if isinstance(node, SequenceNode) else [node]
        if not all(isinstance(source, MappingNode) for source in sources):
            raise DocumentError(f"{where or 'the document'}: << (a merge) needs a map or a list of maps")
        for source in reversed(sources):  # earlier maps take precedence
            self.fill(out, source, where, depth + 1)


@dataclass(frozen=True)
class Document:
    index: int  # 0-based position in its file, counting empty documents too
    value: Any  # JSON-like: dict, list, str, int, float, bool, None
    error: str | None = None  # why it could not be read (value is then None)

    @property
    def label(self) -> str:
        """How a report names this document: `document 2 (name)`."""
        name = self.value.get("metadata", {}).get("name") if isinstance(self.value, dict) and \
            isinstance(self.value.get("metadata"), dict) else None
        shown = f" ({' '.join(name.split())[:63]})" if isinstance(name, str) and name.strip() else ""
        return f"document {self.index + 1}{shown}"


#: The path that stands for the standard input (as ``kubectl apply -f -``).
STDIN = Path("-")


def read_text(path: Path) -> str:
    """A file's text (``-``: the standard input's), as the API server would take it."""
    try:
        if path == STDIN:
            data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)  # one byte more tells it is over
            size = len(data)
        else:
            size = path.stat().st_size
            data = path.read_bytes() if size <= MAX_FILE_BYTES else b""
        if size > MAX_FILE_BYTES:
            shown = f"over {MAX_FILE_BYTES}" if path == STDIN else str(size)
            raise DocumentError(f"is {shown} bytes, over the API server's 3 MiB request limit; split it")
    except IsADirectoryError:
        raise DocumentError("is a directory with no .yaml, .yml or .json file") from None
    except OSError as exc:
        raise DocumentError(f"cannot read it: {exc.strerror or exc}") from None
    if b"\x00" in data:
        raise DocumentError("is not a YAML file (it holds binary data)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def load_documents(text: str) -> list[Document]:
    """Every document of a YAML stream, each converted or with the reason it cannot be.

    A YAML syntax error ends the stream: the documents before it are kept, the rest of the
    file becomes one failed document (YAML cannot be resynchronised after an error)."""
    documents: list[Document] = []
    try:
        loader = _Loader(text)  # the reader refuses control characters at once
    except yaml.YAMLError as exc:
        return [Document(0, None, f"not valid YAML: {_one_line(exc)}")]
    try:
        index = 0
        while True:
            try:
                if not loader.check_node():
                    break
                node = loader.get_node()
            except yaml.YAMLError as exc:
                documents.append(Document(index, None, f"not valid YAML: {_one_line(exc)}"))
                break
            except RecursionError:
                documents.append(Document(index, None, f"nested deeper than {MAX_DEPTH} levels"))
                break
            try:
                documents.append(Document(index, to_json(node)))
            except DocumentError as exc:
                documents.append(Document(index, None, str(exc)))
            index += 1
    finally:
        loader.dispose()
    return documents


def to_json(node: Node | None) -> Any:
    """The JSON value kubectl would send for a composed YAML document; DocumentError naming
    the path."""
    if node is None:
        return None
    try:
        return _Builder().value(node, "", 0)
    except RecursionError:
        raise DocumentError(f"nested deeper than {MAX_DEPTH} levels") from None


def _one_line(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def iter_files(paths: list[Path]) -> Iterator[Path]:
    """The files named, a directory standing for its *.yaml, *.yml and *.json files (sorted)."""
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))
            yield from found if found else [path]
        else:
            yield path
