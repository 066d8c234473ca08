"""``vllm-omni`` command line, and the target of vLLM's ``--omni`` hand-off (``vllm serve MODEL --omni``)."""

from __future__ import annotations

import argparse
import functools
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        _serve(argv[1:], via_vllm="--omni" in argv)
    args = _make_parser().parse_args(argv)
    args.func(args)


def _serve(argv: list[str], via_vllm: bool) -> None:
    """``serve`` parses its own arguments (the serving flags are many, and vLLM hands its own over), so it is
    dispatched before the parser below is built, and exits with the server's status."""
    from vllm_omni.entrypoints.cli.serve import serve

    sys.exit(serve(argv, prog="vllm serve" if via_vllm else "vllm-omni serve"))


def _make_parser() -> argparse.ArgumentParser:
    """The ``vllm-omni`` parser: one sub-parser per subcommand, each naming the function that runs it
    (``set_defaults(func=...)``, as vLLM's CLI does)."""
    parser = argparse.ArgumentParser(prog="vllm-omni", description="Serve diffusion models with vLLM.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Listed for --help only: `main` hands `serve` to its own parser before this one runs.
    commands.add_parser("serve", help="Serve a diffusers model folder (see `vllm-omni serve --help`).")
    _add_make_tiny_model(commands)
    return parser


def _add_make_tiny_model(commands: argparse._SubParsersAction) -> None:
    """The ``make-tiny-model`` subcommand's arguments: the family, and the extra files to write beside it."""
    from vllm_omni.testing.models.gguf_files import GGUF_TYPES
    from vllm_omni.testing.models.tiny import MODEL_FAMILIES

    tiny = commands.add_parser(
        "make-tiny-model",
        help="Write a tiny random-weight diffusers pipeline, an llm stage's tiny Llama, or a speech family's talker "
        "and codec (offline demo and test models).",
    )
    tiny.add_argument("dir", help="Folder to write the pipeline to.")
    tiny.add_argument(
        "--family",
        choices=sorted(MODEL_FAMILIES),
        default="flux",
        help="Pipeline family; llm: a Llama with a byte-level BPE tokenizer for an llm stage; orpheus or llasa: a "
        "speech family's DIR/talker and DIR/codec (default: flux).",
    )
    tiny.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="Also write N random LoRA adapters for it, to DIR/loras/lora-<i> (i = 0..N-1, the random seed).",
    )
    tiny.add_argument(
        "--lora-text-encoder",
        action="store_true",
        help="The --lora adapters also carry weights for the CLIP text encoder (sd, sdxl, sd3, flux, kontext).",
    )
    tiny.add_argument(
        "--single-file",
        action="store_true",
        help="Also write DIR.safetensors, a single-file checkpoint in the original (non-diffusers) key layout: the "
        "whole pipeline for sd, the transformer alone for flux, flux-schnell, sd3 and wan. Serve it with "
        "--model-config DIR.",
    )
    tiny.add_argument(
        "--gguf",
        action="append",
        choices=GGUF_TYPES,
        default=[],
        metavar="TYPE",
        help="Also write DIR-TYPE.gguf (Q8_0 or Q4_0; may be repeated): the transformer alone (flux, flux-schnell, "
        "sd3, wan) in the original key layout, quantized by the gguf package, as city96's GGUFs. Serve it with "
        "--model-config DIR.",
    )
    _add_full_size_args(tiny)
    tiny.add_argument("--omni", action="store_true", help=argparse.SUPPRESS)
    tiny.set_defaults(func=functools.partial(_make_tiny_model, tiny))


def _add_full_size_args(tiny: argparse.ArgumentParser) -> None:
    """``--full-size`` and ``--configs-only``: the published configuration instead of the tiny one."""
    tiny.add_argument(
        "--full-size",
        action="store_true",
        help="Write the published configuration instead (flux: FLUX.1-dev, qwen-image: Qwen-Image, wan: "
        "Wan2.1-T2V-14B) with random bfloat16 weights drawn on the GPU where there is one (FLUX.1-dev: 34 GB of "
        "files); for speed measured at full size.",
    )
    tiny.add_argument(
        "--configs-only",
        action="store_true",
        help="With --full-size: write the configs, tokenizers and scheduler alone (no weights, under a MB), to serve "
        "with --load-format dummy, which draws the random weights on the stage's device.",
    )


def _make_tiny_model(tiny: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``vllm-omni make-tiny-model``: the pipeline, then each extra file asked for, printing each path written."""
    _check_lora_args(tiny, args)
    _check_layout_args(tiny, args)
    if _check_full_size_args(tiny, args):
        from vllm_omni.testing.models.full_size import make_full_size_model

        print(make_full_size_model(args.dir, args.family, configs_only=args.configs_only), flush=True)
        return

    from vllm_omni.testing.models.tiny import make_tiny_model

    print(make_tiny_model(args.dir, args.family), flush=True)
    if args.single_file:
        from vllm_omni.testing.models.single_file import write_single_file

        print(write_single_file(args.dir, args.family, args.dir.rstrip("/") + ".safetensors"), flush=True)
    for qtype in dict.fromkeys(args.gguf):
        from vllm_omni.testing.models.gguf_files import write_gguf

        print(write_gguf(args.dir, args.family, f"{args.dir.rstrip('/')}-{qtype}.gguf", qtype), flush=True)
    if args.lora:
        import os

        from vllm_omni.testing.models.lora import write_random_lora

        for i in range(args.lora):
            path = os.path.join(args.dir, "loras", f"lora-{i}")
            print(write_random_lora(args.dir, path, seed=i, text_encoder=args.lora_text_encoder), flush=True)


def _check_lora_args(tiny: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--lora`` and ``--lora-text-encoder`` refused, before anything is written, where the family cannot take
    them (argparse's usage error, exit status 2)."""
    from vllm_omni.testing.models.lora import CLIP_TEXT_ENCODER_FAMILIES

    if args.lora < 0:
        tiny.error(f"argument --lora: N must be 0 or more, not {args.lora}")
    if args.lora and args.family == "llm":
        tiny.error("argument --lora: the adapters are for diffusers pipelines; family 'llm' takes none")
    if args.lora_text_encoder and not args.lora:
        tiny.error("argument --lora-text-encoder: needs --lora N with N > 0")
    if args.lora_text_encoder and args.family not in CLIP_TEXT_ENCODER_FAMILIES:
        tiny.error(
            f"argument --lora-text-encoder: family {args.family!r} has no CLIP text encoder "
            f"(families with one: {', '.join(CLIP_TEXT_ENCODER_FAMILIES)})"
        )


def _check_layout_args(tiny: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--single-file`` and ``--gguf`` refused, before anything is written, for a family with no original
    (non-diffusers) key layout here."""
    from vllm_omni.testing.models.single_file import DENOISER_ONLY_FAMILIES, SINGLE_FILE_FAMILIES

    if args.single_file and args.family not in SINGLE_FILE_FAMILIES:
        tiny.error(
            f"argument --single-file: family {args.family!r} has no single-file layout here "
            f"(families with one: {', '.join(SINGLE_FILE_FAMILIES)})"
        )
    if args.gguf and args.family not in DENOISER_ONLY_FAMILIES:
        tiny.error(
            f"argument --gguf: a GGUF holds a denoiser alone in its original layout, and family {args.family!r} has "
            f"no such layout here (families with one: {', '.join(DENOISER_ONLY_FAMILIES)})"
        )


def _check_full_size_args(tiny: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether ``--full-size`` is asked for, refused, before anything is written, for a family without one and
    beside the options that write the tiny model's extra files; ``--configs-only`` needs it."""
    if args.configs_only and not args.full_size:
        tiny.error("argument --configs-only: needs --full-size")
    if not args.full_size:
        return False
    from vllm_omni.testing.models.full_size import FULL_SIZE

    if args.family not in FULL_SIZE:
        tiny.error(
            f"argument --full-size: family {args.family!r} has none here (families with one: {', '.join(FULL_SIZE)})"
        )
    extras = [
        flag
        for flag, given in (("--lora", args.lora), ("--single-file", args.single_file), ("--gguf", args.gguf))
        if given
    ]
    if extras:
        tiny.error(f"argument --full-size: {', '.join(extras)} write the tiny model's extra files; leave them out")
    return True


if __name__ == "__main__":
    main()
