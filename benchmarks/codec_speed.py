"""How fast each codec encodes and decodes: GB/s of float32 input, on 1 and 2 CPU threads, and on a GPU.

    python benchmarks/codec_speed.py                       # every codec, 4M values (16 MB), ~1 minute
    python benchmarks/codec_speed.py --codecs fp4-e3m0,nf4 --numel 1048576 --threads 1
    python benchmarks/codec_speed.py --threads 1 --clock cpu   # per core, on a machine others load too
    python benchmarks/codec_speed.py --devices cpu,cuda    # and on the GPU (CUDA), where the machine has one

The part is a pseudo-gradient-like tensor (normal, scale 1e-3, seeded). Each codec encodes it and
decodes the bytes, whole and cut into parts of ``--part`` values on the codec's block grid (as the
all-reduce sends them); the time is the median of ``--repeats`` runs after one warm-up, and GB/s is
the float32 bytes of the input over that time (16 MB for 4M values), so that every codec is on one
scale. A memory copy of the same tensor is the reference line. Prints a Markdown table.

``--clock cpu`` times each run by the CPU time of the calling thread (``time.thread_time``) instead of the
wall clock: with ``--threads 1`` torch codes in that thread alone, so this is the time one core spends,
whatever else the machine runs meanwhile (the wall clock of a shared machine counts the other processes'
turns too). It refuses more than one thread, and a GPU, whose work the host thread does not count.

On a GPU (``--devices cuda``) two rows per codec: **on the GPU**, the part already there and the decoded
part left there (encode's bytes still come back to the host, and decode's bytes go from it: the codec's
own API), and **host ↔ GPU**, the part copied from host memory first and the decoded part copied back (what
a caller whose tensors live on the host would pay). The threads column is then the CPU threads of the
host side. The memory copy row is a copy on the GPU.
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


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]  # set by main from --clock


def median_s(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """The median time of `fn` over `repeats` calls after one warm-up (the first call loads bitsandbytes and
    builds the tables); on a GPU each time ends when the device has finished."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = clock()
        fn()
        synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def parts_of(tensor: torch.Tensor, part: int, blocksize: int) -> list[torch.Tensor]:
    step = max(blocksize, part // blocksize * blocksize)
    return [tensor[i:i + step] for i in range(0, tensor.numel(), step)]


def measure(codec_name: str, tensor: torch.Tensor, part: int, repeats: int, device: torch.device,
            host_copies: bool = False) -> dict:
    """GB/s of encode and decode on `device`, of `tensor` whole and in parts; with `host_copies`, `tensor`
    (on the host) is copied to `device` before each encode and each decoded part is copied back."""
    codec = CODECS[codec_name]
    gb = tensor.numel() * 4 / 1e9
    there = (lambda p: p.to(device)) if host_copies else (lambda p: p)
    back = (lambda p: p.cpu()) if host_copies else (lambda p: p)
    result = dict(codec=codec_name)
    for label, pieces in (("whole", [tensor]), ("parts", parts_of(tensor, part, codec.blocksize))):
        encoded = [codec.encode(p) for p in pieces]
        result[f"encode_{label}"] = gb / median_s(lambda: [codec.encode(there(p)) for p in pieces], repeats, device)
        result[f"decode_{label}"] = gb / median_s(
            lambda: [back(codec.decode(data, p.numel(), device)) for data, p in zip(encoded, pieces)], repeats,
            device)
    return result


def row(threads: int, where: str, name: str, r: dict) -> str:
    return (f"| {threads} | {where} | {name} | {r['encode_whole']:.2f} | {r['encode_parts']:.2f} "
            f"| {r['decode_whole']:.2f} | {r['decode_parts']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--numel", type=int, default=4 * 2**20)
    parser.add_argument("--part", type=int, default=128 * 1024, help="values per part (cut on the block grid)")
    parser.add_argument("--threads", default="1,2", help="torch intra-op threads, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", default="cpu", help="cpu, cuda (or cuda:N), comma-separated")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: the calling thread's CPU time (one thread, CPU only)")
    args = parser.parse_args()
    devices = [torch.device(d) for d in args.devices.split(",")]
    if args.clock == "cpu" and (args.threads != "1" or any(d.type != "cpu" for d in devices)):
        parser.error("--clock cpu times the calling thread: it needs --threads 1 and --devices cpu")
    global clock
    clock = CLOCKS[args.clock]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        parser.error("--devices names a CUDA device, but CUDA is not available on this machine")
    tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    print(f"{args.numel:,} values ({args.numel * 4 / 1e6:.1f} MB of float32), parts of {args.part:,} values; "
          f"GB/s of float32 input, median of {args.repeats}, {args.clock} clock"
          + "".join(f"; {d}: {torch.cuda.get_device_name(d)}" for d in devices if d.type == "cuda") + "\n")
    print("| threads | where | codec | encode whole | encode parts | decode whole | decode parts |\n"
          "|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for device in devices:
            resident = tensor.to(device)
            copy = args.numel * 4 / 1e9 / median_s(lambda: resident.clone(), args.repeats, device)
            print(f"| {threads} | {device} | (memory copy) | {copy:.2f} | | | |")
            for name in args.codecs.split(","):
                if device.type == "cpu":
                    print(row(threads, "cpu", name, measure(name, tensor, args.part, args.repeats, device)), flush=True)
                    continue
                print(row(threads, f"on {device}", name, measure(name, resident, args.part, args.repeats, device)))
                print(row(threads, f"host ↔ {device}", name,
                          measure(name, tensor, args.part, args.repeats, device, host_copies=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
