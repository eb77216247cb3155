#!/usr/bin/env python3
"""Generate omni_contract/vllm_args.json, the table of the vLLM server's arguments, from the
installed vLLM's own parser.

    python tools/generate_vllm_args.py           # (re)write the table
    python tools/generate_vllm_args.py --check   # exit 1 if it differs from the installed vLLM

The table is what ``omni_contract.vllm_args`` checks a stage's ``engineArgs`` against (the
operator, ``omni-pipeline validate`` and ``omni-stage``; none of them imports vLLM). It is read
from the parser ``omni-stage`` starts vLLM with, ``python -m vllm.entrypoints.openai.api_server``:
``make_arg_parser`` on vLLM's ``FlexibleArgumentParser``. Per argument: its option strings
(long, short, the ``--no-`` form of a boolean), whether it takes a value, the value's type as
vLLM converts it (``int``, ``float``, ``human-int`` for ``1k``/``1K``, JSON, a config object,
...), whether ``""``/``None`` mean None, its choices and how a value is normalised before
them, and its default. Then the cross-argument rules of ``validate_parsed_serve_args`` (which
the server runs right after parsing): each ``if`` of the forms ``args.A and not args.B``
(A needs B), ``getattr(args, A) and getattr(args, B)`` (A excludes B) and
``getattr(args, A, d) < N`` (A at least N) is read from its source and then confirmed by
running vLLM's own check; its other checks are listed, not modelled. Then the bounds vLLM's
config classes declare on their fields (``Field(gt=0, le=1)``), which vLLM enforces when it
builds the engine's config at start-up, each confirmed on the field's validator.

A type this script does not know stops it: a newer vLLM's new kind of argument is looked at,
never guessed. tests/operator/test_vllm_args.py regenerates the table and fails when it
drifts from the installed vLLM, and checks the contract's verdicts against vLLM's own parser.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "omni_contract" / "vllm_args.json"
SOURCE = "vllm.entrypoints.launchers.cli_args.make_arg_parser"


def server_parser() -> argparse.ArgumentParser:
    """The parser of vLLM's OpenAI server, as its entry point builds it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


def _closure(fn: Callable[..., Any], name: str) -> Any:
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if var == name:
            return cell.cell_contents
    raise KeyError(name)


def _value_type(fn: Any) -> tuple[str, bool]:
    """(the type's name in the table, whether "" and "None" mean None) of an action's type."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.utils import argparse_utils

    if fn is None or fn is str:
        return "str", False
    if fn is int:
        return "int", False
    if fn is float:
        return "float", False
    if fn is json.loads:
        return "json", False
    if fn is argparse_utils.human_readable_int:
        return "human-int", False
    if fn is argparse_utils.human_readable_int_or_auto:
        return "human-int-or-auto", False
    if fn is arg_utils.union_dict_and_str:
        return "json-object-or-str", False
    qualname = getattr(fn, "__qualname__", "")
    if qualname == "optional_type.<locals>._optional_type":
        return _value_type(_closure(fn, "return_type"))[0], True
    if qualname == "parse_type.<locals>._parse_type":
        return _value_type(_closure(fn, "return_type"))
    if qualname == "_compute_kwargs.<locals>.parse_dataclass":
        return "config", False
    if qualname.endswith("<lambda>"):
        # vLLM's ad-hoc converters: one that folds case and '-' to '_' before its choices
        # (--moe-backend), or one that takes any text (--device-ids).
        if fn("Ab-Cd_e") == "ab_cd_e":
            return "str-lower-underscore", False
        if all(_never_raises(fn, probe) for probe in ("", "x", "1,2", "a b", "{}", "-1")):
            return "str", False
    raise SystemExit(f"generate_vllm_args.py: unknown argument type {fn!r} ({qualname}): teach this script "
                     "what vLLM accepts for it")


def _never_raises(fn: Callable[[str], Any], probe: str) -> bool:
    try:
        fn(probe)
    except Exception:  # noqa: BLE001 - any failure means the type checks something
        return False
    return True


def _json_default(value: Any) -> Any:
    """A default as JSON (a config object's or other non-JSON default: null)."""
    if value is argparse.SUPPRESS:
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value


def _config_file_suffixes(parser: argparse.ArgumentParser) -> list[str] | None:
    """The suffixes FlexibleArgumentParser takes for ``--config FILE``, which it reads before
    parsing (``_pull_args_from_config``); None when this parser reads no config file."""
    load = getattr(type(parser), "load_config_file", None)
    if load is None or "--config" not in inspect.getsource(type(parser).parse_args):
        return None
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(load)))):
        if (isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.NotIn)
                and isinstance(node.comparators[0], ast.Tuple)):
            return [f".{e.value}" for e in node.comparators[0].elts]
    raise SystemExit("generate_vllm_args.py: cannot tell which files FlexibleArgumentParser.load_config_file reads")


def _argument(action: argparse.Action, deprecated: bool) -> dict[str, Any]:
    kind = type(action).__name__
    long = [o[2:] for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
    negations = [o[2:] for o in action.option_strings if o.startswith("--no-")]
    short = [o[1:] for o in action.option_strings if not o.startswith("--")]
    entry: dict[str, Any] = {"flags": long, "dest": action.dest}
    if short:
        entry["short"] = short
    if negations and kind == "BooleanOptionalAction":
        entry["negations"] = negations
    elif negations:  # a flag vLLM spells --no-X itself
        entry["flags"] += negations
    if kind == "_HelpAction":
        entry["takes"] = "exits"
        return entry
    if action.nargs == 0:
        entry["takes"] = "none"
        entry["default"] = _json_default(action.default)
        return entry
    entry["takes"] = "optional" if action.nargs == "?" else "value"
    value_type, none_ok = _value_type(action.type)
    entry["type"] = value_type
    if none_ok:
        entry["none"] = True
    if action.nargs not in (None, "?"):
        entry["nargs"] = action.nargs
    if action.choices is not None:
        entry["choices"] = [c for c in action.choices]
    if value_type == "config":
        fields = _config_fields(action)
        if fields is not None:
            entry["fields"] = fields
    if kind not in ("_StoreAction",):
        entry["action"] = {"_AppendAction": "append"}.get(kind, kind)
    if deprecated:
        entry["deprecated"] = True
    entry["default"] = _json_default(action.default)
    return entry


def _config_fields(action: argparse.Action) -> list[str] | None:
    """The fields of a config argument's class (vLLM's parse_dataclass validates the JSON into
    it), when the class refuses any other key (confirmed on vLLM's own converter); None when
    it takes others."""
    import dataclasses

    converter = action.type
    while getattr(converter, "__qualname__", "") in ("optional_type.<locals>._optional_type",
                                                     "parse_type.<locals>._parse_type"):
        converter = _closure(converter, "return_type")
    cls = (converter.__defaults__ or (None,))[0]
    if cls is None or not dataclasses.is_dataclass(cls):
        raise SystemExit(f"generate_vllm_args.py: --{action.dest}'s config converter names no dataclass: "
                         "teach this script where its fields are")
    fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    try:
        converter('{"omni_no_such_field": 1}')
    except argparse.ArgumentTypeError:
        return fields
    return None


#: Flags whose value vLLM looks up in a registry when it builds the engine (not argparse
#: choices): dest -> (module, the registry, how vLLM folds a value's case before the lookup
#: (ModelConfig's quantization validator lower-cases, AttentionConfig's upper-cases), whether
#: the registry is closed). A plugin in the image may register more in an open one.
_REGISTRIES = {
    "quantization": ("vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS", "lower", False),
    "load_format": ("vllm.model_executor.model_loader", "_LOAD_FORMAT_TO_MODEL_LOADER", None, False),
    # (--tool-parser-plugin and --reasoning-parser-plugin register more in the server itself.)
    "tool_call_parser": ("vllm.tool_parsers", "ToolParserManager.list_registered", None, False),
    "reasoning_parser": ("vllm.reasoning", "ReasoningParserManager.list_registered", None, False),
    # An enum: its members, and "auto" (no backend chosen).
    "attention_backend": ("vllm.v1.attention.backends.registry", "AttentionBackendEnum.__members__", "upper", True),
}
#: A closed registry's values besides its members, and the config class that confirms them.
_CLOSED_EXTRA = {"attention_backend": (["AUTO"], "vllm.config.attention.AttentionConfig", "backend")}


def _known_values(dest: str) -> dict[str, Any] | None:
    """The values vLLM's registry for ``dest`` holds, how a value's case is folded before the
    lookup, and whether the registry is closed (None: no registry). A closed one is confirmed
    on its config class: a value outside it refused, each inside taken."""
    if dest not in _REGISTRIES:
        return None
    import importlib

    module, name, case, closed = _REGISTRIES[dest]
    registry: Any = importlib.import_module(module)
    for part in name.split("."):
        registry = getattr(registry, part)
    values = sorted(registry() if callable(registry) else registry)
    entry: dict[str, Any] = {"values": values}
    if case:
        entry["case"] = case
    if closed:
        extra, owner, field = _CLOSED_EXTRA[dest]
        entry["values"] = values = sorted(values + extra)
        owner_module, _, owner_name = owner.rpartition(".")
        cls = getattr(importlib.import_module(owner_module), owner_name)

        def takes(value: str) -> bool:
            try:
                cls(**{field: value})
            except Exception:  # noqa: BLE001 - any refusal is the registry's
                return False
            return True

        if takes("omni_no_such_value") or not all(takes(v) and takes(v.lower()) for v in values):
            raise SystemExit(f"generate_vllm_args.py: --{dest}'s registry does not hold on {owner}")
        entry["closed"] = True
    return entry


def _takes_objects_only(dest: str) -> bool:
    """Whether the engine argument ``dest`` (a JSON flag: its parser takes any JSON) is a map
    to vLLM, which refuses any other JSON value when it builds the engine: its EngineArgs
    field's annotation, confirmed (a list refused, a map taken)."""
    import dataclasses

    from pydantic import TypeAdapter, ValidationError
    from vllm.engine.arg_utils import EngineArgs

    field = {f.name: f for f in dataclasses.fields(EngineArgs)}.get(dest)
    if field is None or isinstance(field.type, str):
        return False
    try:
        adapter = TypeAdapter(field.type)
        adapter.validate_python({})
    except Exception:  # noqa: BLE001 - an annotation pydantic cannot take, or not a map
        return False
    for other in ([1], "x", 1):
        try:
            adapter.validate_python(other)
            return False
        except ValidationError:
            continue
    return True


# -- the cross-argument rules of validate_parsed_serve_args ------------------------------------

def _arg_name(node: ast.AST) -> str | None:
    """``args.X`` or ``getattr(args, "X", default)``: X."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
        return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
            and isinstance(node.args[1], ast.Constant)):
        return node.args[1].value
    return None


def _raised(body: list[ast.stmt]) -> str | None:
    """The message of ``raise X("message")``, the body of a check."""
    if len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call) and body[0].exc.args:
        message = body[0].exc.args[0]
        if isinstance(message, ast.Constant) and isinstance(message.value, str):
            return message.value
        if isinstance(message, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in message.values):
            return "".join(v.value for v in message.values)
    return None


def _rule(test: ast.expr, message: str) -> dict[str, Any] | None:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2:
        first, second = test.values
        a = _arg_name(first)
        if a and isinstance(second, ast.UnaryOp) and isinstance(second.op, ast.Not) and _arg_name(second.operand):
            return {"rule": "requires", "dest": a, "other": _arg_name(second.operand), "message": message}
        if a and _arg_name(second):
            return {"rule": "excludes", "dest": a, "other": _arg_name(second), "message": message}
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Lt)
            and _arg_name(test.left) and isinstance(test.comparators[0], ast.Constant)):
        return {"rule": "minimum", "dest": _arg_name(test.left), "minimum": test.comparators[0].value,
                "message": message}
    return None


def serve_rules(parser: argparse.ArgumentParser) -> tuple[list[dict[str, Any]], list[str]]:
    """(the rules modelled, each confirmed by vLLM's own check; the checks not modelled)."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    function = ast.parse(textwrap.dedent(inspect.getsource(validate_parsed_serve_args))).body[0]
    module = sys.modules[validate_parsed_serve_args.__module__]
    rules, others = [], []
    for node in function.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        message = _raised(node.body) if isinstance(node, ast.If) else None
        rule = _rule(node.test, message) if message is not None else None
        if rule is None:
            if not (isinstance(node, ast.If) and isinstance(node.body[0], ast.Return)):
                others.append({"check": " ".join(ast.unparse(node).split())[:200],
                               "reads": sorted(_reads(node, module))})
            continue
        _confirm(parser, validate_parsed_serve_args, rule)
        rules.append(rule)
    return rules, others


def _reads(node: ast.AST, module: Any, depth: int = 1) -> set[str]:
    """The arguments a check reads: ``args.X`` and ``getattr(args, "X")`` in it, and in the
    functions it hands ``args`` to (one level down)."""
    found = {name for n in ast.walk(node) for name in [_arg_name(n)] if name}
    if depth <= 0:
        return found
    imported = {alias.asname or alias.name: (n.module, alias.name) for n in ast.walk(node)
                if isinstance(n, ast.ImportFrom) for alias in n.names}
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        if not any(isinstance(a, ast.Name) and a.id == "args" for a in call.args):
            continue
        name = call.func.id
        if name in imported:
            import importlib

            function = getattr(importlib.import_module(imported[name][0]), imported[name][1], None)
        else:
            function = getattr(module, name, None)
        if function is not None:
            found |= _reads(ast.parse(textwrap.dedent(inspect.getsource(function))), module, depth - 1)
    return found


# -- the bounds of vLLM's config fields ----------------------------------------------------------

_BOUNDS = ("gt", "ge", "lt", "le")


def range_rules(parser: argparse.ArgumentParser, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """The bounds vLLM's config classes declare on the fields its flags set (pydantic's
    ``Field(gt=, ge=, lt=, le=)``): vLLM refuses a value outside them when it builds the
    engine's config, at the stage's start, after its parser took it. A flag's config class is
    its argument group's (vLLM's ``add_cli_args`` makes one group per class, titled with its
    name). Each bound is confirmed on the field's own validator."""
    import annotated_types
    import vllm.config

    kinds = {entry["dest"]: entry.get("type") for entry in arguments.values()}
    rules = []
    for group in parser._action_groups:
        owner = getattr(vllm.config, group.title or "", None)
        fields = getattr(owner, "__pydantic_fields__", None) or {}
        for action in group._group_actions:
            info = fields.get(action.dest)
            if not action.option_strings or info is None or kinds.get(action.dest) not in _NUMERIC:
                continue
            bounds = {name: getattr(m, name) for m in info.metadata for name in _BOUNDS
                      if isinstance(m, getattr(annotated_types, name.capitalize()))}
            if bounds:
                rule = {"rule": "range", "dest": action.dest, "owner": f"{group.title}.{action.dest}", **bounds}
                _confirm_range(info, rule, kinds[action.dest])
                rules.append(rule)
    return sorted(rules, key=lambda r: r["dest"])


#: The table's value types whose values a range bounds.
_NUMERIC = ("int", "float", "human-int", "human-int-or-auto")


def _confirm_range(info: Any, rule: dict[str, Any], kind: str) -> None:
    """Each bound holds on the field's validator: the value on the wrong side of it is refused,
    the nearest on the right side taken."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(Annotated[float if kind == "float" else int, *info.metadata])

    def takes(value: float) -> bool:
        try:
            adapter.validate_python(value)
        except ValidationError:
            return False
        return True

    _confirm_bounds({k: v for k, v in rule.items() if k in _BOUNDS}, 0.01 if kind == "float" else 1, takes,
                    rule["owner"])


def _confirm_bounds(bounds: dict[str, Any], step: float, takes: Callable[[Any], bool], what: str) -> None:
    """Each bound holds where ``takes`` says what vLLM takes: the value on its wrong side is
    refused, the nearest (by ``step``) on its right side taken; ``finite``: NaN is refused."""
    for key, b in bounds.items():
        refused, taken = ((float("nan"), None) if key == "finite" else
                          {"gt": (b, b + step), "ge": (b - step, b), "lt": (b, b - step), "le": (b + step, b)}[key])
        if takes(refused) or (taken is not None and not takes(taken)):
            raise SystemExit(f"generate_vllm_args.py: the bound {key} {b} of {what} does not hold")


# -- the model config's own validator ---------------------------------------------------------

def validator_rules(arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """The lower bounds ``ModelConfig.validate_model_config_after`` puts on the fields its flags
    set (``if not isinstance(self.F, int) or self.F < N: raise``), which vLLM checks when it
    builds the engine's config, after the field's own range (``max-model-len: 0`` passes
    ``ge=-1`` and is refused there). A value below N that ``__post_init__`` resolves first
    (``max-model-len: -1``, auto: fitted to the memory) is taken (``except``). Each bound is
    read from the source and confirmed on the validator itself."""
    from types import SimpleNamespace

    import vllm.config.model as model

    function = ast.parse(textwrap.dedent(inspect.getsource(
        model.ModelConfig.validate_model_config_after))).body[0]
    flags = {entry["dest"] for entry in arguments.values()}
    rules = []
    for node in ast.walk(function):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.BoolOp)
                and isinstance(node.test.op, ast.Or) and len(node.test.values) == 2):
            continue
        first, second = node.test.values
        if not (isinstance(second, ast.Compare) and len(second.ops) == 1 and isinstance(second.ops[0], ast.Lt)
                and isinstance(second.left, ast.Attribute) and isinstance(second.left.value, ast.Name)
                and second.left.value.id == "self" and isinstance(second.comparators[0], ast.Constant)
                and isinstance(first, ast.UnaryOp) and isinstance(first.op, ast.Not)):
            continue
        dest, bound = second.left.attr, second.comparators[0].value
        if dest not in flags:
            continue
        rule = {"rule": "range", "dest": dest, "owner": "ModelConfig.validate_model_config_after", "ge": bound}
        if dest == "max_model_len" and "max_model_len == -1" in inspect.getsource(model._get_and_verify_max_len):
            rule["except"] = [-1]  # auto: resolved to a length before the validator runs

        def takes(value: Any, dest: str = dest) -> bool:
            config = SimpleNamespace(tokenizer="t", max_model_len=1, enable_prompt_embeds=False,
                                     is_encoder_decoder=False)
            setattr(config, dest, value)
            try:
                model.ModelConfig.validate_model_config_after(config)
            except ValueError:
                return False
            return True

        _confirm_bounds({"ge": bound}, 1, takes, rule["owner"])
        rules.append(rule)
    if "max_model_len" not in {r["dest"] for r in rules}:
        raise SystemExit("generate_vllm_args.py: ModelConfig.validate_model_config_after no longer bounds "
                         "max_model_len as read here: look at it again")
    return rules


# -- the scheduler's own pair rules --------------------------------------------------------------

def pair_rules() -> list[dict[str, Any]]:
    """The checks of ``SchedulerConfig.verify_max_model_len`` between two of its flags, which
    vLLM runs when it builds the engine's config: each ``if`` of the forms ``self.A < self.B``
    and ``self.A < max_model_len and not self.C`` (A at least B, unless C), read from its source
    and confirmed on SchedulerConfig itself. The table applies one only where engineArgs sets
    every flag it names (vLLM's defaults depend on the platform and the model)."""
    from vllm.config import SchedulerConfig

    function = ast.parse(textwrap.dedent(inspect.getsource(SchedulerConfig.verify_max_model_len))).body[0]

    def field(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        if isinstance(node, ast.Name) and node.id == "max_model_len":
            return "max_model_len"
        return None

    rules = []
    for node in function.body:
        if not isinstance(node, ast.If):
            continue
        test, unless = node.test, None
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2:
            second = test.values[1]
            if isinstance(second, ast.UnaryOp) and isinstance(second.op, ast.Not) and field(second.operand):
                test, unless = test.values[0], field(second.operand)
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Lt)
                and field(test.left) and field(test.comparators[0])):
            rule = {"rule": "at_least", "dest": field(test.left), "other": field(test.comparators[0]),
                    "owner": "SchedulerConfig.verify_max_model_len"}
            if unless:
                rule["unless"] = unless
            _confirm_pair(SchedulerConfig, rule)
            rules.append(rule)
    return rules


def _confirm_pair(cls: Any, rule: dict[str, Any]) -> None:
    """The rule holds on ``cls``: A one below B refused, A equal to B taken (C off)."""
    def takes(a: int, b: int) -> bool:
        values = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 4096, "is_encoder_decoder": False}
        values.update({rule["dest"]: a, rule["other"]: b})
        if "unless" in rule:
            values[rule["unless"]] = False
        try:
            cls(**values)
        except Exception:  # noqa: BLE001 - any refusal is the rule refusing
            return False
        return True

    if takes(255, 256) or not takes(256, 256):
        raise SystemExit(f"generate_vllm_args.py: the rule {rule} does not hold on {cls.__name__}")


# -- SamplingParams: a stage input's sampling parameters --------------------------------------

#: JSON kinds of the Python types a SamplingParams field is annotated with (others: unchecked).
_JSON_KINDS = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object",
               type(None): "null"}


def _json_kinds(annotation: Any) -> list[str] | None:
    """The JSON kinds a field of this annotation takes; None when it is not plain JSON (an
    enum, a struct of vLLM's, an array type): such a field is left to vLLM."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [_json_kinds(a) for a in typing.get_args(annotation)]
        return None if None in kinds else sorted({k for ks in kinds for k in ks})
    base = origin or annotation
    return [_JSON_KINDS[base]] if base in _JSON_KINDS else None


def _item_kinds(annotation: Any) -> list[str] | None:
    """The JSON kinds of the items of a list field (``list[int] | None``: integer); None when
    the annotation holds no list of plain JSON items (or lists of two item types)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        found = [k for a in typing.get_args(annotation) for k in [_item_kinds(a)] if k is not None]
        return found[0] if len(found) == 1 else None
    if origin is list:
        args = typing.get_args(annotation)
        return _json_kinds(args[0]) if len(args) == 1 else None
    return None


def sampling_params() -> dict[str, Any]:
    """What ``vllm.SamplingParams(**fields)`` takes: its public fields with the JSON kinds
    their annotations allow (and a list field's items' kinds), and the bounds ``_verify_args`` checks of the forms ``not A <=
    self.X <= B``, ``self.X < N`` (with ``self.X is not None and`` before it) and ``not
    math.isfinite(self.X)``, each confirmed by constructing SamplingParams on either side of
    it; its other checks, and the validators ``__post_init__`` calls, are listed, not
    modelled."""
    import msgspec
    from vllm import SamplingParams

    public = [f for f in msgspec.structs.fields(SamplingParams) if not f.name.startswith("_")]
    fields = {f.name: _json_kinds(f.type) for f in public}
    items = {f.name: kinds for f in public for kinds in [_item_kinds(f.type)] if kinds is not None}
    function = ast.parse(textwrap.dedent(inspect.getsource(SamplingParams._verify_args))).body[0]
    bounds: dict[str, dict[str, Any]] = {}
    others = []
    for node in function.body:
        found = _sampling_bound(node.test) if isinstance(node, ast.If) else None
        if found is None:
            others.append(" ".join(ast.unparse(node.test if isinstance(node, ast.If) else node).split())[:160])
            continue
        name, bound = found
        bounds.setdefault(name, {}).update(bound)
    # What __post_init__ hands to a validator of its own (thinking_token_budget's): listed.
    post_init = ast.parse(textwrap.dedent(inspect.getsource(SamplingParams.__post_init__)))
    for call in (n for n in ast.walk(post_init) if isinstance(n, ast.Call)):
        name = ast.unparse(call.func)
        if ("validate" in name or "verify" in name) and any(_self_field(a) for a in call.args):
            others.append(" ".join(ast.unparse(call).split())[:160])
    for name, bound in bounds.items():
        _confirm_sampling_bound(SamplingParams, name, bound, fields.get(name))
    return {"fields": dict(sorted(fields.items())), "items": dict(sorted(items.items())),
            "bounds": [{"field": name, **bound} for name, bound in sorted(bounds.items())],
            "not_modelled": others}


def _self_field(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _number(node: ast.AST) -> float | None:
    """A numeric literal (``-2.0`` included), else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_FLIP = {ast.Lt: "ge", ast.LtE: "gt", ast.Gt: "le", ast.GtE: "lt"}  # refused when X op N: the bound kept
_KEEP = {ast.Lt: "lt", ast.LtE: "le"}  # in `not A op X op B`: the bound as written


def _sampling_bound(test: ast.expr) -> tuple[str, dict[str, Any]] | None:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2:
        first, second = test.values
        if (isinstance(first, ast.Compare) and isinstance(first.ops[0], ast.IsNot)
                and isinstance(first.comparators[0], ast.Constant) and first.comparators[0].value is None):
            inner = _sampling_bound(second)
            if inner is not None and inner[0] == _self_field(first.left):
                return inner
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        operand = test.operand
        if (isinstance(operand, ast.Call) and ast.unparse(operand.func) == "math.isfinite"
                and len(operand.args) == 1 and _self_field(operand.args[0])):
            return _self_field(operand.args[0]), {"finite": True}
        if (isinstance(operand, ast.Compare) and len(operand.ops) == 2 and _self_field(operand.comparators[0])
                and _number(operand.left) is not None and _number(operand.comparators[1]) is not None
                and type(operand.ops[0]) in _KEEP and type(operand.ops[1]) in _KEEP):
            low = {"lt": "gt", "le": "ge"}[_KEEP[type(operand.ops[0])]]
            return _self_field(operand.comparators[0]), {low: _number(operand.left),
                                                        _KEEP[type(operand.ops[1])]: _number(operand.comparators[1])}
        return None
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and _self_field(test.left)
            and type(test.ops[0]) in _FLIP and _number(test.comparators[0]) is not None):
        return _self_field(test.left), {_FLIP[type(test.ops[0])]: _number(test.comparators[0])}
    return None


def _confirm_sampling_bound(params: Any, name: str, bound: dict[str, Any], kinds: list[str] | None) -> None:
    """Each bound holds in vLLM: a value on its wrong side is refused, the nearest on its
    right side taken (whole numbers for an integer field)."""
    def takes(value: Any) -> bool:
        try:
            params(**{name: value})
        except Exception:  # noqa: BLE001 - vLLM raises its validation error (a ValueError)
            return False
        return True

    _confirm_bounds(bound, 1 if kinds and "number" not in kinds and "integer" in kinds else 0.01, takes,
                    f"SamplingParams.{name}")


def _flag_of(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest and a.option_strings)


def _argv(action: argparse.Action, value: Any) -> list[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag] if value else []
    if action.choices:
        return [flag, str(next(c for c in action.choices if c is not None))]
    return [flag, str(value)]


def _confirm(parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], None], rule: dict) -> None:
    """The rule holds in vLLM: what it refuses, vLLM's check refuses with its message; what it
    takes, the check does not refuse with that message."""
    a, other = _flag_of(parser, rule["dest"]), None
    if rule["rule"] == "minimum":
        refused = _argv(a, rule["minimum"] - 1)
        taken = _argv(a, rule["minimum"])
    else:
        other = _flag_of(parser, rule["other"])
        refused = _argv(a, 1) + (_argv(other, 1) if rule["rule"] == "excludes" else [])
        taken = _argv(a, 1) + ([] if rule["rule"] == "excludes" else _argv(other, "x"))

    def message(argv: list[str]) -> str | None:
        try:
            check(parser.parse_args(argv))
        except Exception as exc:  # noqa: BLE001 - vLLM's checks raise TypeError or ValueError
            return str(exc)
        return None

    if message(refused) != rule["message"] or message(taken) == rule["message"]:
        raise SystemExit(f"generate_vllm_args.py: the rule {rule} does not hold in vLLM's validate_parsed_serve_args")


def build() -> dict[str, Any]:
    import vllm

    parser = server_parser()
    deprecated = getattr(parser, "_deprecated", set())
    arguments = {}
    for action in parser._actions:
        if not action.option_strings:
            continue  # the positional model tag: the stage passes --model
        entry = _argument(action, action in deprecated)
        arguments[entry["flags"][0] if entry["flags"] else entry["short"][0]] = entry
    suffixes = _config_file_suffixes(parser)
    if suffixes is not None and "config" in arguments:
        # Read by the parser itself, before parsing: a YAML file of more flags.
        arguments["config"].update(type="config-file", suffixes=suffixes)
    for name, entry in arguments.items():
        known = _known_values(entry["dest"])
        if known is not None:
            entry["known"] = known
        if entry.get("type") in ("json", "json-object-or-str") and _takes_objects_only(entry["dest"]):
            entry["object"] = True
    rules, others = serve_rules(parser)
    for rule in rules:
        for dest in (rule["dest"], rule.get("other")):
            if dest is not None:
                rule.setdefault("defaults", {})[dest] = _json_default(_flag_of(parser, dest).default)
    rules += range_rules(parser, arguments)
    rules += validator_rules(arguments)
    rules += pair_rules()
    return {
        "vllm_version": vllm.__version__,
        "source": f"{SOURCE} on vllm.utils.argparse_utils.FlexibleArgumentParser",
        "generated_by": "tools/generate_vllm_args.py",
        "arguments": dict(sorted(arguments.items())),
        "rules": rules,
        "not_modelled": others,
        "sampling_params": sampling_params(),
    }


def render(table: dict[str, Any]) -> str:
    """JSON with one argument (and one rule) a line, so that a new vLLM's changes read as a
    short diff."""
    def one(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))

    lines = ["{"]
    for key, value in table.items():
        if isinstance(value, dict) and value:
            lines.append(f"  {one(key)}: {{")
            lines += [f"    {one(k)}: {one(v)}," for k, v in value.items()]
            lines[-1] = lines[-1].rstrip(",")
            lines.append("  },")
        elif isinstance(value, list) and value:
            lines.append(f"  {one(key)}: [")
            lines += [f"    {one(v)}," for v in value]
            lines[-1] = lines[-1].rstrip(",")
            lines.append("  ],")
        else:
            lines.append(f"  {one(key)}: {one(value)},")
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join(lines) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table differs from the installed vLLM")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    text = render(build())
    if args.check:
        if not TABLE.is_file() or TABLE.read_text(encoding="utf-8") != text:
            print(f"{TABLE.relative_to(ROOT)} is stale: run python tools/generate_vllm_args.py", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
