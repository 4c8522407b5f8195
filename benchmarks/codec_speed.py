"""How fast each codec encodes and decodes on the CPU: GB/s of float32 input, on 1 and 2 threads.

    python benchmarks/codec_speed.py                       # every codec, 4M values (16 MB), ~1 minute
    python benchmarks/codec_speed.py --codecs fp4-e3m0,nf4 --numel 1048576 --threads 1

The part is a pseudo-gradient-like tensor (normal, scale 1e-3, seeded). Each codec encodes it and
decodes the bytes, whole and cut into parts of ``--part`` values on the codec's block grid (as the
all-reduce sends them); the time is the median of ``--repeats`` runs after one warm-up, and GB/s is
the float32 bytes of the input over that time (16 MB for 4M values), so that every codec is on one
scale. A memory copy of the same tensor is the reference line. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2p_diloco.sync.codecs import CODECS  # noqa: E402


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first calls load bitsandbytes and build tables
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parts_of(tensor: torch.Tensor, part: int, blocksize: int) -> list[torch.Tensor]:
    step = max(blocksize, part // blocksize * blocksize)
    return [tensor[i:i + step] for i in range(0, tensor.numel(), step)]


def measure(codec_name: str, tensor: torch.Tensor, part: int, repeats: int) -> dict:
    codec = CODECS[codec_name]
    gb = tensor.numel() * 4 / 1e9
    result = dict(codec=codec_name)
    for label, pieces in (("whole", [tensor]), ("parts", parts_of(tensor, part, codec.blocksize))):
        encoded = [codec.encode(p) for p in pieces]
        result[f"encode_{label}"] = gb / median_s(lambda: [codec.encode(p) for p in pieces], repeats)
        result[f"decode_{label}"] = gb / median_s(
            lambda: [codec.decode(data, p.numel()) for data, p in zip(encoded, pieces)], repeats)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--numel", type=int, default=4 * 2**20)
    parser.add_argument("--part", type=int, default=128 * 1024, help="values per part (cut on the block grid)")
    parser.add_argument("--threads", default="1,2", help="torch intra-op threads, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    print(f"{args.numel:,} values ({args.numel * 4 / 1e6:.1f} MB of float32), parts of {args.part:,} values; "
          f"GB/s of float32 input, median of {args.repeats}\n")
    print("| threads | codec | encode whole | encode parts | decode whole | decode parts |\n|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        copy = args.numel * 4 / 1e9 / median_s(lambda: tensor.clone(), args.repeats)
        print(f"| {threads} | (memory copy) | {copy:.2f} | | | |")
        for name in args.codecs.split(","):
            r = measure(name, tensor, args.part, args.repeats)
            print(f"| {threads} | {name} | {r['encode_whole']:.2f} | {r['encode_parts']:.2f} | {r['decode_whole']:.2f} "
                  f"| {r['decode_parts']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
