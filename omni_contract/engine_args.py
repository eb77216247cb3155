"""``engineArgs``: the vLLM engine arguments of a stage, passed to vLLM as flags.

One spelling rule (:func:`flag_name`): a key in kebab, snake or camel case, with or without
leading dashes, is the flag ``--kebab-case`` (``max-model-len``, ``max_model_len``,
``maxModelLen`` and ``--max-model-len`` are all ``--max-model-len``); in a key with a '.'
(vLLM's ``--json-arg.field value``) only the part before the first '.' is the flag's name,
the field after it is kept as written. The stage owns a few flags (:data:`RESERVED`): a user
value would break the stage contract. A credential's flag (:data:`SECRET_FLAGS`) is refused:
its value would sit in a ConfigMap. ``additional-config`` is merged with the stage's own
(whose ``omni_kv_config`` key the stage owns), and a ``kv-transfer-config`` (a mapping, or its
JSON text as vLLM's flag takes it) is composed with the omni KV connector when the stage sends
KV (:mod:`omni_contract.kv_transfer`); neither may be given field by field with '.' keys (they
would replace the stage's own value).

Then what vLLM's own parser would refuse (:mod:`omni_contract.vllm_args`, a table generated
from the pinned vLLM's parser): an unknown flag, a value outside a flag's choices or of the
wrong form, a flag that needs another. The table is one vLLM version's: the stage checks
against the vLLM it runs (its installed version), the operator against the version a stage's
image names; another version gets the spelling rules above only, with a warning
(:func:`engine_args_report`).

:func:`engine_args_problems` is the whole check: ``omni-stage`` refuses a stage config with
any of them (exit 2, naming ``engineArgs.KEY``), the operator and ``omni-pipeline validate``
refuse the OmniPipeline that would render it (naming ``spec.stages[i].engineArgs.KEY``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_contract import vllm_args
#: How one entry becomes vLLM's command-line words (omni-stage's conversion).
from omni_contract.vllm_args import argv_of
from omni_contract.kv_transfer import ConnectorConfigError, role_problem, user_connectors
from omni_contract.ports import HTTP_PORT

#: Flags the stage sets itself, and why a user value cannot be taken.
RESERVED: dict[str, str] = {
    "model": "the model comes from spec.model (model.path, else model.name, in the stage config)",
    "served-model-name": "the served name is spec.model.name (model.name in the stage config)",
    "host": "the stage chooses the address it listens on (omni-stage --host)",
    "port": f"the stage's HTTP port is fixed at {HTTP_PORT} by the stage contract (ports.http in the stage config)",
    "scheduler-cls": "the stage runs the omni AR scheduler itself",
    "shutdown-timeout": "the stage sets it from its drain grace period (kvTransfer.timeoutSeconds)",
    # Set last by the user, these would silently replace the stage's own value.
    "download-dir": "the stage downloads the model into its model cache (spec.model.cache.mountPath, "
                    "model.cacheDir in the stage config); set that instead",
    "otlp-traces-endpoint": "the stage exports its traces to spec.observability.tracing.otlpEndpoint "
                            "(observability.tracing.otlpEndpoint in the stage config); set that instead",
}
#: Flags whose values are credentials: engineArgs are written into the stage's ConfigMap
#: (readable by whoever may read ConfigMaps, shown by kubectl describe), so a secret goes to a
#: stage only from a Secret.
SECRET_FLAGS: dict[str, str] = {
    "hf-token": "a token in engineArgs would sit in plain text in the stage's ConfigMap; give it as "
                "spec.model.hubTokenSecretRef (a Secret: the stages get HF_TOKEN from it)",
    "api-key": "a key in engineArgs would sit in plain text in the stage's ConfigMap; give a stage a "
               "secret only from a Secret (stages[].env with valueFrom.secretKeyRef, e.g. VLLM_API_KEY)",
}
ADDITIONAL_CONFIG = "additional-config"
KV_TRANSFER_CONFIG = "kv-transfer-config"
#: Every flag the stage sets (why a user value, or a '.' field of it, cannot be taken as such).
_OWNED: dict[str, str] = {
    **RESERVED,
    ADDITIONAL_CONFIG: "the stage merges engineArgs.additional-config, a mapping, with its own",
    KV_TRANSFER_CONFIG: "the stage composes engineArgs.kv-transfer-config, a mapping, with its own KV connector",
}
#: The key of ``additional-config`` the stage fills from kvTransfer and the pipeline graph.
OMNI_KV_CONFIG = "omni_kv_config"
#: What an engine argument's name may be: letters, digits, '-', '_' and '.' (vLLM's
#: --json-arg.key form), optionally after the dashes of the command line. Anything else
#: could never be a vLLM flag. Matched whole (fullmatch: ``$`` would also match before a
#: final newline, and "max-model-len\n" is no flag).
_KEY = re.compile(r"-{0,2}[A-Za-z0-9][A-Za-z0-9_.-]*")
#: Word boundaries inside a camel-case key: aB, and the last capital of a run before a word
#: (LoRAConfig -> Lo-RA-Config).
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def flag_name(key: str) -> str:
    """The vLLM flag (without its dashes) an ``engineArgs`` key stands for: camel case split
    into words (``maxModelLen``, ``enableLoRA``), snake case and any casing (``PORT``) folded
    to vLLM's kebab case. In ``json-arg.field`` only the flag's name is folded: the field is a
    JSON key, kept as written (vLLM's parser does the same)."""
    head, dot, field = key.lstrip("-").partition(".")
    return _CAMEL.sub("-", head).replace("_", "-").lower() + dot + field


@dataclass(frozen=True)
class EngineArgProblem:
    key: str  # the path under engineArgs: "port", "additional-config.omni_kv_config"
    message: str  # what is wrong and the fix, read after the key: "engineArgs.KEY: MESSAGE"

    @property
    def path(self) -> str:
        """The key as its field path goes on after ``engineArgs``: ``.KEY``; quoted,
        ``["KEY"]``, when it holds a newline or another unprintable character (a key that is no
        flag name may hold anything), so the path stays one printable line; nothing for the
        whole map."""
        if not self.key:
            return ""
        return f".{self.key}" if self.key.isprintable() else f"[{json.dumps(self.key)}]"

    def __str__(self) -> str:
        return f"engineArgs{self.path}: {self.message}"


class EngineArgsError(ValueError):
    """The first of a stage's engineArgs problems."""

    def __init__(self, problem: EngineArgProblem):
        self.problem = problem
        super().__init__(str(problem))


def engine_arg_value(engine_args: Mapping[str, Any], dest: str) -> Any | None:
    """The value vLLM would hold for the argument ``dest`` (``max_model_len``) from
    ``engineArgs`` in any spelling of its flag (``max-model-len``, ``maxModelLen``; ``32k``
    converted as vLLM's argument type converts it), or None where it is not set, is ``null``
    or ``true``/``false``, or is not a value vLLM takes (engine_args_problems reports that)."""
    argument = vllm_args.table().by_dest(dest)
    if argument is None:
        return None
    names = {flag.lstrip("-") for flag in argument.flags}
    for key, value in engine_args.items():
        if flag_name(str(key)) not in names or value is None or isinstance(value, bool):
            continue
        try:
            return vllm_args.convert(argument, str(value))
        except ValueError:
            return None
    return None


def engine_args_problems(engine_args: Any, *, sends_kv: bool,
                         vllm_version: str | None = None) -> list[EngineArgProblem]:
    """Every way these engineArgs break the stage contract (empty: none). ``sends_kv``: the
    stage sends KV (``kvTransfer.send``), so a user's KV connector is composed with ours.
    ``vllm_version``: the vLLM the stage runs (None: the one installed here, else the
    table's)."""
    return engine_args_report(engine_args, sends_kv=sends_kv, vllm_version=vllm_version)[0]


def engine_args_report(engine_args: Any, *, sends_kv: bool, vllm_version: str | None = None
                       ) -> tuple[list[EngineArgProblem], list[EngineArgProblem]]:
    """(problems, warnings): the problems of :func:`engine_args_problems`, and what the stage
    would run with but the user should know: an abbreviated flag, ``false`` on a flag whose
    default is not off, a vLLM version the argument table does not describe (then only the
    spelling rules are checked)."""
    if not isinstance(engine_args, Mapping):
        return [EngineArgProblem("", "must be a map of vLLM engine argument names to values")], []
    problems: list[EngineArgProblem] = []
    flags: list[tuple[str, str, Any]] = []
    seen: dict[str, str] = {}
    version = _vllm_version(vllm_version)
    for key, value in engine_args.items():
        key = str(key)
        if not _KEY.fullmatch(key):
            problems.append(EngineArgProblem(key, "is not a vLLM flag name: use letters, digits, '-', '_' and '.', "
                                                  "as on the command line without the dashes (e.g. max-model-len)"))
            continue
        flag = flag_name(key)
        if flag in seen:
            problems.append(EngineArgProblem(key, f"is the flag --{flag} again (as engineArgs.{seen[flag]}); "
                                                  "keep one of them"))
            continue
        seen[flag] = key
        head = flag.partition(".")[0]
        if head != flag and head in _OWNED:
            problems.append(EngineArgProblem(key, f"sets a field of --{head} with '.', which would replace the "
                                                  f"whole --{head} ({_OWNED[head]}); "
                                                  + (f"write it inside {head} (a mapping)" if head not in RESERVED
                                                     else "remove it")))
        elif flag in RESERVED:
            problems.append(EngineArgProblem(key, f"cannot be set: {RESERVED[flag]}; remove it"))
        elif flag in SECRET_FLAGS:
            problems.append(EngineArgProblem(key, f"cannot be set: {SECRET_FLAGS[flag]}"))
        elif flag == ADDITIONAL_CONFIG:
            problems += _additional_config(key, value)
        elif flag == KV_TRANSFER_CONFIG:
            problems += _kv_transfer_config(key, value, sends_kv, vllm_args.applies(version))
        else:
            flags.append((key, flag, value))
    if not flags:
        return problems, []
    if not vllm_args.applies(version):
        table = vllm_args.table().version
        runs = "a vLLM whose version its image does not tell" if version == "unknown" else f"vLLM {version}"
        return problems, [EngineArgProblem("", f"the stage runs {runs}, and the contract's argument table is vLLM "
                                               f"{table}'s: only the spelling rules are checked (flag names, the "
                                               "flags the stage owns), not the flags and values vLLM takes")]
    found, warned = vllm_args.check(flags, _OWNED)
    problems += [EngineArgProblem(f.key, f.message) for f in found]
    return problems, [EngineArgProblem(f.key, f.message) for f in warned]


def engine_args_warnings(engine_args: Any, *, sends_kv: bool, vllm_version: str | None = None
                         ) -> list[EngineArgProblem]:
    """The warnings of :func:`engine_args_report`."""
    return engine_args_report(engine_args, sends_kv=sends_kv, vllm_version=vllm_version)[1]


def _vllm_version(version: str | None) -> str:
    """The vLLM version to check against: the one given, else the one installed here
    (omni-stage runs it: told once in the log when the table is another version's), else the
    table's."""
    if version is not None:
        return version
    installed = vllm_args.installed_vllm_version()
    if installed is None:
        return vllm_args.table().version
    if not vllm_args.applies(installed):
        vllm_args.warn_once(installed)
    return installed


def check_engine_args(engine_args: Any, *, sends_kv: bool) -> None:
    """EngineArgsError for the first problem of :func:`engine_args_problems`."""
    problems = engine_args_problems(engine_args, sends_kv=sends_kv)
    if problems:
        raise EngineArgsError(problems[0])


def user_kv_transfer_config(engine_args: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The user's own KV connector config in ``engineArgs`` as (key, mapping), if any: a
    mapping, or its JSON text as vLLM's flag takes it; EngineArgsError if it is neither."""
    for key, value in engine_args.items():
        if flag_name(str(key)) != KV_TRANSFER_CONFIG or value is None:
            continue
        config, problem = _parsed_kv_transfer_config(str(key), value)
        if problem is not None:
            raise EngineArgsError(problem)
        return str(key), config
    return None


def _additional_config(key: str, value: Any) -> list[EngineArgProblem]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [EngineArgProblem(key, f"must be a mapping (vLLM's additional config), not {_kind(value)}")]
    if OMNI_KV_CONFIG in value:
        return [EngineArgProblem(f"{key}.{OMNI_KV_CONFIG}", "is set by the stage from kvTransfer and the pipeline "
                                                           "graph; remove it")]
    return []


def _parsed_kv_transfer_config(key: str, value: Any) -> tuple[dict[str, Any], EngineArgProblem | None]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            return {}, EngineArgProblem(key, f"is not valid JSON ({exc}); write a mapping, e.g. "
                                             '{kv_connector: ExampleConnector, kv_role: kv_both}')
    if not isinstance(value, Mapping):
        return {}, EngineArgProblem(key, f"must be a mapping (a vLLM KVTransferConfig), not {_kind(value)}")
    return dict(value), None


def _kv_transfer_config(key: str, value: Any, sends_kv: bool, table_applies: bool) -> list[EngineArgProblem]:
    if value is None:
        return []
    config, problem = _parsed_kv_transfer_config(key, value)
    if problem is not None:
        return [problem]
    if sends_kv:  # composed with the omni KV connector; passed on as it is otherwise
        try:
            _, _, connectors = user_connectors(config)
        except ConnectorConfigError as exc:
            return [EngineArgProblem(key, str(exc))]
    else:
        connectors = [config]
        role = role_problem(config)
        if role is not None:
            return [EngineArgProblem(key, f"{role} (vLLM's KVTransferConfig)")]
    # Each connector's config becomes a vLLM KVTransferConfig, which takes its own fields only.
    for connector in [config, *connectors] if table_applies else []:
        unknown = vllm_args.config_field_problem(KV_TRANSFER_CONFIG, list(connector))
        if unknown:
            return [EngineArgProblem(key, unknown)]
    return []


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else type(value).__name__
