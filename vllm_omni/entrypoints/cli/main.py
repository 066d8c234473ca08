"""``vllm-omni`` command line (also the target of ``vllm ... --omni``)."""

from __future__ import annotations

import sys


def _make_tiny_model(args) -> None:
    from vllm_omni.testing.tiny_models import make_tiny_model

    print(make_tiny_model(args.dir, args.family))


def main(argv: list[str] | None = None) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_omni.testing.tiny_models import FAMILIES

    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if a != "--omni"]  # vLLM hands us its whole command line
    parser = FlexibleArgumentParser(prog="vllm-omni", description="Serve diffusion models with vLLM.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tiny = commands.add_parser(
        "make-tiny-model", help="Write a tiny random-weight diffusers pipeline (offline demo and test model)."
    )
    tiny.add_argument("dir", help="Folder to write the pipeline to.")
    tiny.add_argument("--family", choices=sorted(FAMILIES), default="flux", help="Pipeline family (default: flux).")
    tiny.set_defaults(func=_make_tiny_model)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
