"""Reading OmniPipeline files the way `kubectl apply -f` reads them, without ever raising
anything but `DocumentError`.

kubectl turns YAML into JSON before the API server sees it (sigs.k8s.io/yaml over go-yaml
v2), so a document here becomes the JSON value the server would get:

- a timestamp-looking scalar (`revision: 2024-01-01`) stays a string: go-yaml only makes a
  time of it when decoding into a time field, never into JSON;
- map keys that YAML reads as numbers or booleans become strings, as sigs.k8s.io/yaml does;
- what JSON cannot hold (binary `!!binary`, NaN, infinities, sets) is refused, naming where;
- a file that is not UTF-8 text, is over the API server's 3 MiB request limit, nests deeper
  than any OmniPipeline could, or expands (through YAML aliases) into more values than a
  request could carry, is refused before anything looks at it.
"""
from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

MAX_FILE_BYTES = 3 * 1024 * 1024  # kube-apiserver refuses request bodies over 3 MiB
MAX_DEPTH = 64  # an OmniPipeline nests about 8 deep; engineArgs leave room for more
MAX_VALUES = 200_000  # values after alias expansion ("billion laughs" stop here)


class DocumentError(ValueError):
    """A document (or file) that cannot be turned into the JSON the API server would get."""


class _Loader(yaml.SafeLoader):
    """SafeLoader without the timestamp resolver: dates stay strings, as kubectl sends them."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


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


def read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DocumentError(f"is {size} bytes, over the API server's 3 MiB request limit; split it")
        data = path.read_bytes()
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
                raw = loader.construct_document(node)
            except yaml.YAMLError as exc:
                documents.append(Document(index, None, f"not valid YAML: {_one_line(exc)}"))
                break
            except RecursionError:
                documents.append(Document(index, None, f"nested deeper than {MAX_DEPTH} levels"))
                break
            try:
                documents.append(Document(index, to_json(raw)))
            except DocumentError as exc:
                documents.append(Document(index, None, str(exc)))
            index += 1
    finally:
        loader.dispose()
    return documents


def to_json(value: Any) -> Any:
    """The JSON value kubectl would send for a YAML value; DocumentError naming the path."""
    budget = [MAX_VALUES]
    return _convert(value, "", 0, budget)


def _convert(value: Any, path: str, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise DocumentError(f"expands into more than {MAX_VALUES} values (YAML aliases?); "
                            "no OmniPipeline is that large")
    if depth > MAX_DEPTH:
        raise DocumentError(f"{path or 'the document'}: nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise DocumentError(f"{path or 'the document'}: {value} is not a JSON number; quote it or use a finite number")
        return value
    if isinstance(value, (datetime.date, datetime.datetime)):  # only via an explicit !!timestamp tag
        return value.isoformat()
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(key, bool):
                name = "true" if key else "false"
            elif isinstance(key, (str, int, float)) or key is None:
                name = "null" if key is None else str(key)
            else:
                raise DocumentError(f"{path or 'the document'}: a key of type {type(key).__name__} "
                                    "cannot be a JSON field name; use a string")
            out[name] = _convert(item, _join(path, name), depth + 1, budget)
        return out
    if isinstance(value, list):
        return [_convert(item, f"{path}[{i}]", depth + 1, budget) for i, item in enumerate(value)]
    if isinstance(value, bytes):
        raise DocumentError(f"{path or 'the document'}: binary (!!binary) values cannot be sent to the API server; use a string")
    raise DocumentError(f"{path or 'the document'}: a {type(value).__name__} cannot be sent to the API server; use a string, number, list or map")


_SIMPLE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _join(path: str, key: str) -> str:
    if _SIMPLE_KEY.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]" if path else f"[{key!r}]"


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
