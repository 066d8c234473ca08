"""``vllm serve MODEL --omni`` / ``vllm-omni serve MODEL``: vLLM's serve flags plus the omni group.

Every flag is parsed and every knob resolved before the model loads, so a bad
flag fails in a second with a message naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing

from pydantic import ValidationError

from vllm_omni.config import StageDeployConfig, resolve_stage_configs
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.profiler import profiler_config
from vllm_omni.config.serving import ServingConfig
from vllm_omni.config.stage import KNOBS
from vllm_omni.config.vllm_device import set_device_hint
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

# vLLM serve flags that mean something for a diffusion server, by argparse dest.
# Any other vLLM flag given explicitly is refused rather than silently ignored.
_USED_VLLM_FLAGS = frozenset(
    {
        "model_tag",
        "model",
        "host",
        "port",
        "api_key",
        "served_model_name",
        "max_num_seqs",
        "scheduling_policy",
        "dtype",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        "allow_credentials",
        "uvicorn_log_level",
        "disable_uvicorn_access_log",
        "ssl_keyfile",
        "ssl_certfile",
        "root_path",
        "distributed_executor_backend",
        *("revision", "download_dir", "hf_token"),
        *("enable_lora", "lora_modules", "max_loras", "max_lora_rank"),
        "quantization",
        "load_format",
        "tensor_parallel_size",
        "profiler_config",
        "otlp_traces_endpoint",
        "trust_remote_code",
        *("allowed_media_domains", "allowed_local_media_path"),
    }
)
# vLLM serve flags that upstream vllm-omni's docs pass and that change nothing for a diffusion server (no KV cache,
# no CUDA graphs, no LLM engine): accepted with a log line saying so, never a start-up error.
_NO_EFFECT_VLLM_FLAGS = frozenset(
    {
        "enforce_eager",
        "gpu_memory_utilization",
        "max_model_len",
        "disable_log_stats",
        "enable_log_requests",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "max_num_batched_tokens",
        "block_size",
    }
)
# ServingConfig fields that only the omni group sets (the others come from vLLM's own flags).
_OMNI_SERVING_FLAGS = (
    "max_waiting_requests",
    "max_request_body_bytes",
    "max_image_pixels",
    "max_input_image_bytes",
    "max_input_image_pixels",
    "max_inference_steps",
    "max_prompt_length",
    "max_video_frames",
    "image_url_ttl_s",
    "image_store_max_bytes",
    "video_ttl_s",
    "video_store_max_bytes",
    "shutdown_timeout_s",
    "disable_playground",
    "strict_fields",
)
_OMNI_STAGE_FLAGS = tuple(name for name, knob in KNOBS.items() if knob.flag == "omni")
_VLLM_DTYPES = {"half": "float16", "float": "float32"}


def _knob_description(name: str) -> str:
    """The docstring of `ServingConfig`'s field ``name``."""
    description = ServingConfig.model_fields[name].description
    assert description is not None, "every field has a docstring"
    return description


def _knob_help(description: str | None) -> str:
    """A stage knob's ``--help``: the first sentence of its docstring (the whole of it is in docs/configuration.md),
    links as plain text."""
    assert description is not None, "every knob has a docstring"
    first = re.split(r"(?<=\.)\s+(?=[A-Z])", " ".join(description.split()), maxsplit=1)[0]
    return re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", first).replace("``", "") + " Per stage; see docs/configuration.md."


def _stage_overrides(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            'must be a JSON object of stage id to knobs, e.g. \'{"0": {"max_num_seqs": 8}}\''
        )
    return value


def _quality_steps(text: str) -> dict:
    """``--quality-steps``: ``LEVEL=STEPS`` pairs separated by commas, or a JSON object (`ServingConfig` checks the
    levels and step counts)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
        if isinstance(value, dict):
            return value
    else:
        pairs = [item.partition("=") for item in text.split(",")]
        if all(sep for _, sep, _ in pairs):
            return {level.strip(): steps.strip() for level, _, steps in pairs}
    raise argparse.ArgumentTypeError(
        "give LEVEL=STEPS pairs such as low=4,medium=14,high=28, or JSON such as '{\"high\": 40}'"
    )


def make_serve_parser(prog: str):
    """vLLM's own serve parser (FlexibleArgumentParser + its serve arguments) with an 'Omni' group added."""
    set_device_hint()
    from vllm.entrypoints.common.cli_args import make_arg_parser

    parser = make_arg_parser(
        _omni_serve_parser_class()(
            prog=prog,
            description="Serve a diffusion model (a diffusers folder, a Hugging Face repo id or a single-file "
            "checkpoint) with OpenAI's Images and Videos APIs.",
        )
    )
    omni = parser.add_argument_group(
        "Omni",
        "Diffusion serving (vllm-omni). Of vLLM's flags above, these are used: "
        + ", ".join("--" + f.replace("_", "-") for f in sorted(_USED_VLLM_FLAGS - {"model_tag"}))
        + "; "
        + ", ".join("--" + f.replace("_", "-") for f in sorted(_NO_EFFECT_VLLM_FLAGS))
        + " are accepted with no effect; any other vLLM flag is refused.",
    )
    omni.add_argument(
        "--omni", action="store_true", help="Hand the command to vllm-omni (for `vllm serve ... --omni`)."
    )
    omni.add_argument("--deploy-config", metavar="PATH", help="Deploy YAML with per-stage knobs.")
    omni.add_argument(
        "--model-config",
        metavar="FOLDER_OR_REPO_ID",
        help="For a single-file checkpoint MODEL: the diffusers folder or Hugging Face repo id that supplies its "
        "configs and the components the file lacks (default: the repo diffusers infers from the file).",
    )
    omni.add_argument(
        "--codec-model",
        metavar="FOLDER_OR_REPO_ID",
        help="Serve MODEL as the talker of a speech model (an llm stage in mode tts on vLLM's engine) whose codes "
        "this codec decodes (a codec stage): /v1/audio/speech. Instead of --deploy-config (docs/speech.md).",
    )
    _add_stage_knob_flags(omni)
    omni.add_argument(
        "--stage-overrides",
        type=_stage_overrides,
        metavar="JSON",
        help='Per-stage knobs that beat every other layer, e.g. \'{"0": {"max_num_seqs": 8}}\'.',
    )
    _add_serving_flags(omni)
    return parser


def _omni_serve_parser_class() -> type[argparse.ArgumentParser]:
    """vLLM's FlexibleArgumentParser with the Omni group's flags in its ``--help``; made on use, because vLLM's
    parser module is imported only once a server is wanted (seconds of imports)."""
    set_device_hint()  # before every import of vLLM (a hint already set stays)
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OmniServeParser(FlexibleArgumentParser):
        def format_help(self) -> str:
            """vLLM's help lists its groups by name; the Omni group's flags are listed in full below them."""
            text = super().format_help()
            if self._search_keyword is not None:
                return text
            formatter = self._get_formatter()
            for group in self._action_groups:
                if group.title == "Omni":
                    formatter.start_section(group.title)
                    formatter.add_text(group.description)
                    formatter.add_arguments(group._group_actions)
                    formatter.end_section()
            return text + "\n" + formatter.format_help()

    return OmniServeParser


def _add_stage_knob_flags(omni: typing.Any) -> None:
    """A flag for every stage knob declared with an omni flag (`Knob.flag`), typed from its field, so that a knob
    added to `StageDeployConfig` is a flag without more code here."""
    for name in _OMNI_STAGE_FLAGS:
        info = StageDeployConfig.model_fields[name]
        kind = info.annotation
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: the flag gives an X
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        if kind is bool:  # --x / --no-x; unset (None) unless given, so the YAML's value stands
            omni.add_argument(
                "--" + name.replace("_", "-"),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_knob_help(info.description),
            )
            continue
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        if typing.get_origin(kind) in (tuple, dict):  # a comma-separated list or JSON, parsed by the config
            kind = str
        omni.add_argument(
            "--" + name.replace("_", "-"),
            type=None if choices else kind,
            choices=choices,
            help=_knob_help(info.description),
            metavar=None if choices else KNOBS[name].metavar or "N",
        )


def _add_serving_flags(omni: typing.Any) -> None:
    """The flags of the `ServingConfig` fields that only the Omni group sets (`_OMNI_SERVING_FLAGS`, then
    ``--quality-steps``), their help the fields' docstrings."""
    for name in _OMNI_SERVING_FLAGS:
        info = ServingConfig.model_fields[name]
        if info.annotation is bool:  # a switch (argparse's type=bool would read "False" as true)
            omni.add_argument("--" + name.replace("_", "-"), action="store_true", help=info.description)
            continue
        omni.add_argument(
            "--" + name.replace("_", "-"),
            type=info.annotation,
            default=info.default,
            help=info.description,
            metavar="N" if info.annotation is int else "SECONDS",
        )
    omni.add_argument(
        "--quality-steps",
        type=_quality_steps,
        default={},
        metavar="LEVEL=STEPS,...",
        help=_knob_description("quality_steps")
        + " Levels: low, medium, high; e.g. low=4,medium=14,high=28 or '{\"high\": 40}'.",
    )


def parse_serve_args(parser, argv: list[str]) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv``; also return the dests the user gave explicitly (a default is not a choice)."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parser.parse_args(argv, namespace=namespace)
    explicit = {dest for dest, value in vars(namespace).items() if value is not unset}
    for action in parser._actions:
        if getattr(namespace, action.dest, None) is unset:
            setattr(namespace, action.dest, action.default)
    return namespace, explicit


def build_serve_config(parser: argparse.ArgumentParser, args: argparse.Namespace, explicit: set[str]):
    """Check the flags and resolve the stage configs; ``parser.error`` (exit 2) names the flag on any problem."""
    _check_vllm_flags(parser, explicit)
    model, source = _model_source(parser, args, explicit)
    try:
        stage_configs = resolve_stage_configs(
            args.deploy_config,
            global_knobs={k: v for k, v in _stage_knobs(args, explicit).items() if v is not None},
            global_source="cli",
            stage_overrides=args.stage_overrides,
            model=source,
            codec_model=args.codec_model,
        )
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    serving = _serving_config(parser, args, model)
    for stage in stage_configs:
        if serving.max_waiting_requests < stage.max_num_seqs:
            parser.error(
                f"--max-waiting-requests {serving.max_waiting_requests} is below max_num_seqs={stage.max_num_seqs} "
                f"of stage {stage.stage_id}: full batches could never form"
            )
    return source, stage_configs, serving


def _check_vllm_flags(parser: argparse.ArgumentParser, explicit: set[str]) -> None:
    """Refuse a vLLM flag that a diffusion server does not use, so that none is silently ignored; log those that
    upstream's docs pass and that change nothing here (`_NO_EFFECT_VLLM_FLAGS`)."""
    omni_dests = {a.dest for group in parser._action_groups if group.title == "Omni" for a in group._group_actions}
    unused_dests = explicit - _USED_VLLM_FLAGS - omni_dests
    unused = sorted(a.option_strings[0] for a in parser._actions if a.dest in unused_dests - _NO_EFFECT_VLLM_FLAGS)
    if unused:
        parser.error(
            f"{', '.join(unused)}: vLLM flag(s) that a diffusion server does not use; remove them (accepted with no "
            f"effect: {', '.join(_no_effect_flags(parser))})"
        )
    no_effect = sorted(a.option_strings[0] for a in parser._actions if a.dest in unused_dests & _NO_EFFECT_VLLM_FLAGS)
    if no_effect:
        logger.info("%s: vLLM flag(s) that have no effect on a diffusion server; ignored", ", ".join(no_effect))


def _model_source(
    parser: argparse.ArgumentParser, args: argparse.Namespace, explicit: set[str]
) -> tuple[str, ModelSource]:
    """The model as given (``vllm serve MODEL``, or vLLM's ``--model``) and its `ModelSource` with vLLM's
    ``--revision``, ``--download-dir`` and ``--hf-token``, checked before anything loads."""
    model = args.model_tag or (args.model if "model" in explicit else None)
    if not model:
        parser.error(
            "give the model (a diffusers folder, a Hugging Face repo id or a checkpoint file): vllm serve MODEL"
        )
    try:
        source = ModelSource(
            model,
            revision=args.revision,
            download_dir=args.download_dir,
            hf_token=args.hf_token,
            model_config=args.model_config,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return model, source


def _stage_knobs(args: argparse.Namespace, explicit: set[str]) -> dict:
    """The stage knobs the flags give, for the resolver (source ``cli``): the Omni group's, and those of vLLM's
    flags that mean a knob here, taken only when given (vLLM's defaults are not ours)."""
    given = {name: getattr(args, name) for name in ("max_num_seqs", "distributed_executor_backend", *_OMNI_STAGE_FLAGS)}
    if "dtype" in explicit:
        given["dtype"] = _VLLM_DTYPES.get(args.dtype, args.dtype)
    for name in ("quantization", "load_format"):  # vLLM's flags take its values; the resolver checks ours
        if name in explicit:
            given[name] = getattr(args, name)
    # vLLM's flags that are knobs here, parsed by vLLM (--lora-modules as name=path or JSON), taken only when given:
    # its defaults are not ours, or not from our layer (provenance).
    given.update(
        {
            name: getattr(args, name)
            for name in (
                *("enable_lora", "max_loras", "max_lora_rank"),
                *("tensor_parallel_size", "trust_remote_code", "scheduling_policy"),
            )
            if name in explicit
        }
    )
    if "lora_modules" in explicit:
        given["lora_modules"] = [
            {"name": m.name, "path": m.path, "base_model_name": m.base_model_name} for m in args.lora_modules or ()
        ]
    return given


def _serving_config(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str) -> ServingConfig:
    """The HTTP server's settings from vLLM's flags (host, port, API keys, CORS, TLS, ...) and the Omni group's;
    a value `ServingConfig` refuses is named by its flag."""
    try:
        profiler = profiler_config(args.profiler_config)  # vLLM's parser read the JSON or dotted form
    except ValueError as exc:
        parser.error(f"--profiler-config: {exc}")
    api_keys = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    values = dict(
        host=args.host,
        port=args.port,
        served_model_names=args.served_model_name or [model],
        api_keys=api_keys,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path or "",
        quality_steps=args.quality_steps,
        profiler_config=profiler,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        allowed_media_domains=args.allowed_media_domains,
        allowed_local_media_path=args.allowed_local_media_path or "",
        **{name: getattr(args, name) for name in _OMNI_SERVING_FLAGS},
    )
    try:
        return ServingConfig(**values)
    except ValidationError as exc:
        parser.error("; ".join(_flag_problem(e) for e in exc.errors()))


def _no_effect_flags(parser) -> list[str]:
    """The vLLM flags accepted with no effect (`_NO_EFFECT_VLLM_FLAGS`), as written."""
    return sorted(a.option_strings[0] for a in parser._actions if a.dest in _NO_EFFECT_VLLM_FLAGS)


def _flag_problem(error) -> str:
    """A `ServingConfig` error as the flag was given: ``--flag VALUE: why``, or ``--flag KEY=VALUE: why`` for a
    value inside a mapping (``--quality-steps``)."""
    flag, *inside = error["loc"]
    in_mapping = inside and isinstance(inside[0], str) and inside[-1] != "[key]"
    value = f"{inside[0]}={error.get('input')!r}" if in_mapping else repr(error.get("input"))
    return f"--{str(flag).replace('_', '-')} {value}: {error['msg']}"


def serve(argv: list[str], prog: str = "vllm serve") -> int:
    parser = make_serve_parser(prog)
    args, explicit = parse_serve_args(parser, argv)
    source, stage_configs, serving = build_serve_config(parser, args, explicit)

    from vllm_omni.entrypoints.openai.api_server import run_server

    return run_server(source, stage_configs, serving)
