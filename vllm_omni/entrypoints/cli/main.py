"""``vllm-omni`` command line, and the target of vLLM's ``--omni`` hand-off (``vllm serve MODEL --omni``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    via_vllm = "--omni" in argv
    if argv[:1] == ["serve"]:
        from vllm_omni.entrypoints.cli.serve import serve

        sys.exit(serve(argv[1:], prog="vllm serve" if via_vllm else "vllm-omni serve"))

    from vllm_omni.testing.tiny_models import FAMILIES

    parser = argparse.ArgumentParser(prog="vllm-omni", description="Serve diffusion models with vLLM.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("serve", help="Serve a diffusers model folder (see `vllm-omni serve --help`).")
    tiny = commands.add_parser(
        "make-tiny-model", help="Write a tiny random-weight diffusers pipeline (offline demo and test model)."
    )
    tiny.add_argument("dir", help="Folder to write the pipeline to.")
    tiny.add_argument("--family", choices=sorted(FAMILIES), default="flux", help="Pipeline family (default: flux).")
    tiny.add_argument("--omni", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from vllm_omni.testing.tiny_models import make_tiny_model

    print(make_tiny_model(args.dir, args.family))


if __name__ == "__main__":
    main()
