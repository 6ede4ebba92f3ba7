"""``python -m fusion.native.build [--verbose] [--no-cuda]``: compile the fused-op libraries."""
import argparse

from . import library as _native


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA library")
    ap.add_argument("--jobs", "-j", type=int, default=None)
    args = ap.parse_args(argv)
    for p in _native.build(verbose=args.verbose, cuda=False if args.no_cuda else None,
                           jobs=args.jobs):
        print("built", p)


if __name__ == "__main__":
    main()
