"""Criteo's command line: converts TSV logs once (torchrec's npy layout or Parquet, also on Ray).

It also generates a file of Kaggle's format from the planted-model generator (criteo_generate).

Command line::

    python -m mlkv_torch.data.criteo convert FILE... --out DIR [--days N] [--format npy|parquet] [--ray [HEAD:PORT]]
    python -m mlkv_torch.data.criteo generate OUT --rows N [--seed S] [--cardinalities criteo_kaggle|N,N,...]
        [--scale K]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence, Tuple

from .criteo_convert import convert_file
from .criteo_generate import generate
from .criteo_parquet import convert_to_parquet, convert_to_parquet_on_ray
from .synthetic import CRITEO_KAGGLE_CARDINALITIES

__all__ = ["main"]


def _cardinalities_argument(text: str, scale: int) -> Tuple[int, ...]:
    try:
        base = CRITEO_KAGGLE_CARDINALITIES if text == "criteo_kaggle" else tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--cardinalities must be criteo_kaggle or a comma-separated list of ints, got {text!r}")
    if scale < 1:
        raise ValueError(f"--scale must be positive, got {scale}")
    return tuple(max(2, n // scale) for n in base)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status (2 on any error, reported on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m mlkv_torch.data.criteo", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    converting = commands.add_parser("convert", help="convert TSV files into torchrec's npy layout, once")
    converting.add_argument("files", nargs="+", metavar="FILE")
    converting.add_argument("--out", required=True, help="the cache directory")
    converting.add_argument("--days", type=int, default=None, help="split each file into N consecutive days")
    converting.add_argument("--format", choices=("npy", "parquet"), default="npy",
                            help="parquet: also write each day as <out>/parquet/<day>.parquet (data.kind parquet)")
    converting.add_argument("--ray", metavar="ADDRESS", nargs="?", const="", default=None,
                            help="with --format parquet: convert the files as Ray tasks on the cluster whose head is "
                                 "at ADDRESS (host:port; none: a local Ray)")
    generating = commands.add_parser("generate", help="write a Criteo TSV file from the planted-model generator")
    generating.add_argument("out", metavar="OUT", help="the file to write (gzip when it ends in .gz)")
    generating.add_argument("--rows", type=int, required=True)
    generating.add_argument("--seed", type=int, default=0)
    generating.add_argument("--cardinalities", default="criteo_kaggle", help="criteo_kaggle or N,N,... (26 of them)")
    generating.add_argument("--scale", type=int, default=1, help="divide every cardinality by K (at least 2 rows)")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert" and args.ray is not None:
            if args.format != "parquet":
                raise ValueError("--ray converts to Parquet: add --format parquet")
            started = time.perf_counter()
            converted = convert_to_parquet_on_ray(args.files, args.out, days=args.days, address=args.ray)
            seconds = time.perf_counter() - started
            print("\n".join(f for done in converted for f in done.files))
            rows = sum(done.rows for done in converted)
            print(f"{rows} rows, {seconds:.2f} s, {rows / seconds:.0f} rows/s (on Ray, "
                  f"{len({done.pid for done in converted})} workers)", flush=True)
        elif args.command == "convert":
            for path in args.files:
                if args.format == "parquet":
                    days = convert_to_parquet(path, args.out, days=args.days, progress=True)
                    print("\n".join(days.prefixes + days.files))
                    print(f"{days.rows} rows, {days.seconds:.2f} s, {days.rows / days.seconds:.0f} rows/s", flush=True)
                    continue
                done = convert_file(path, args.out, days=args.days, progress=True)
                rows = sum(done.rows)
                print("\n".join(done.prefixes))
                rate = f"{rows / done.seconds:.0f} rows/s (converted)" if done.converted else "(cached)"
                print(f"{rows} rows, {done.seconds:.2f} s, {rate}", flush=True)
        else:
            started = time.perf_counter()
            rows = generate(args.out, args.rows, seed=args.seed,
                            cardinalities=_cardinalities_argument(args.cardinalities, args.scale))
            seconds = time.perf_counter() - started
            print(f"{args.out}: {rows} rows, {seconds:.2f} s, {rows / seconds:.0f} rows/s", flush=True)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
