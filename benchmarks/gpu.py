"""One GPU peer's inner loop: tokens/s, model FLOPs utilization and peak memory, and the outer step's device transfers.

    python benchmarks/gpu.py                               # the 150M Llama of peers/llama-150m-c4.toml on CUDA
    python benchmarks/gpu.py --variants bf16,bf16-compile --steps 20 --micro-batch-size 8
    python benchmarks/gpu.py --tiny                        # a 5.3M model, a few steps: checks the script on a CPU

The model is the run config's (--config; default the 150M Llama of peers/llama-150m-c4.toml: hidden 768,
12 layers, seq_len 1024), freshly initialised, with the vocabulary of the config's tokenizer when it is
in the local Hugging Face cache and 32000 (Llama-2's) otherwise; the output says which. It trains on
synthetic random tokens, already on the device, through the peer's own
:class:`~p2p_diloco.train.inner.InnerTrainer` with the config's [inner] settings (batch_size ×
grad_accumulation sequences per inner step), once per variant (--variants):

- ``fp32``: no autocast (and no TF32: torch's default for matmuls), AdamW (fused on CUDA);
- ``bf16``: bf16 autocast, AdamW;
- ``bf16-compile``: bf16 autocast, ``torch.compile`` (:func:`~p2p_diloco.train.inner.prepare_for_compute`);
- ``bf16-adamw8bit``: bf16 autocast, bitsandbytes' 8-bit AdamW.

Per variant: --warmup-steps inner steps (compilation, allocator and cuDNN warm-up) are run and not
timed, then --steps inner steps between two ``torch.cuda.synchronize()``. tokens/s is their tokens
over their seconds. MFU (model FLOPs utilization, PaLM, Chowdhery et al. 2022, appendix B) is

    MFU = (6·N + 12·L·h·s) · tokens/s / peak FLOP/s

with N the parameters that multiply (all but the input embedding, a lookup), L layers, h the hidden
size and s the sequence length (the attention scores' and values' matmuls); a gradient-checkpointed
step's recomputation is not counted. The peak is the device's dense bf16 FLOP/s (--peak-tflops, else
:data:`PEAK_BF16_FLOPS` by device name); fp32 runs are measured against the same bf16 peak. Peak
memory is ``torch.cuda.max_memory_allocated`` from the model's creation to the last step. On a CPU,
MFU is given only with --peak-tflops, and peak memory is not measured.

The transfers: the whole model as one fragment (the most a peer moves in one outer step), θ_local on
the device and θ_global in fp32 on the CPU, --transfer-repeats times after one untimed round: the
device → host copy of θ_local (for Δ = θ_global − θ_local; the subtraction itself is not timed) and
the host → device copy back (θ_local ← θ_global), through :class:`~p2p_diloco.train.transfer.FlatTransfer`
(one page-locked buffer, one copy each way) and one ``.to()`` / ``copy_`` per parameter. The host →
device row gives the time until the call returns (how long the host is blocked) and until the copy
and merge are done on the device. Medians. The flat path is the one a GPU peer takes; on a CPU the table
still times it (it checks the code), but a CPU peer takes :class:`~p2p_diloco.train.transfer.DirectTransfer`,
which does what the per-parameter row does.

Prints two Markdown tables and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2p_diloco.config import Config, load_config  # noqa: E402
from p2p_diloco.train.data import largest_token_id  # noqa: E402
from p2p_diloco.train.inner import InnerTrainer, prepare_for_compute  # noqa: E402
from p2p_diloco.train.model import build_model, trainable_parameters  # noqa: E402
from p2p_diloco.train.transfer import FlatTransfer  # noqa: E402

DEFAULT_CONFIG = REPO / "peers" / "llama-150m-c4.toml"
FALLBACK_VOCAB = 32000  # Llama-2's tokenizer, the 150M config's
# dense bf16 tensor-core FLOP/s by device name, first match wins (NVIDIA's datasheets; half the sparse figures)
PEAK_BF16_FLOPS = (("NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12))
VARIANTS = {  # name -> ([compute] settings, [inner] settings)
    "fp32": ({"precision": "fp32"}, {}),
    "bf16": ({"precision": "bf16"}, {}),
    "bf16-compile": ({"precision": "bf16", "compile": True}, {}),
    "bf16-adamw8bit": ({"precision": "bf16"}, {"optimizer": "adamw8bit"}),
}
# --tiny: 5.3M parameters, 4 × 128 tokens per inner step; a few seconds per variant on 2 CPU cores
TINY_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 688,
              "max_position_embeddings": 128}
TINY_VOCAB = 4096
TINY_RUN = {"seq_len": 128, "batch_size": 4, "grad_accumulation": 1, "warmup_steps": 1, "steps": 3,
            "transfer_repeats": 3}
SYNTHETIC_BATCHES = 4  # distinct random batches, cycled
BYTES_PER_GB = 1e9
BYTES_PER_GIB = 2 ** 30


# ----- setup --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config whose model and [inner] are used")
    parser.add_argument("--tiny", action="store_true", help="a 5.3M-parameter model and a few steps (CPU check)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed inner steps per variant")
    parser.add_argument("--steps", type=int, default=10, help="timed inner steps per variant")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="sequences per forward/backward pass (default: [compute] of the config, else the batch)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 TFLOP/s for MFU (default: by device name, H100 SXM/H200: 989)")
    parser.add_argument("--transfer-repeats", type=int, default=5, help="timed outer-step transfers per path")
    parser.add_argument("--compile-on-cpu", action="store_true", help="run bf16-compile on a CPU too (minutes)")
    parser.add_argument("--out", default="bench-out/gpu", help="folder for results.json")
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    if args.tiny:
        args.warmup_steps, args.steps = TINY_RUN["warmup_steps"], TINY_RUN["steps"]
        args.transfer_repeats = TINY_RUN["transfer_repeats"]
    return args


def benchmark_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    if not args.tiny:
        return cfg
    return cfg.replace(model=TINY_MODEL, data={"seq_len": TINY_RUN["seq_len"]},
                       inner={"batch_size": TINY_RUN["batch_size"], "grad_accumulation": TINY_RUN["grad_accumulation"]})


def vocabulary(cfg: Config, tiny: bool) -> tuple[int, str]:
    """The vocabulary the model embeds, and where it comes from: the tokenizer if it is cached locally."""
    if tiny:
        return TINY_VOCAB, "tiny model's"
    if cfg.data.tokenizer == "local-bpe":
        return cfg.data.vocab_size, "the config's local BPE size"
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer, local_files_only=True)
    except (OSError, ValueError) as e:
        return FALLBACK_VOCAB, f"{cfg.data.tokenizer} not in the local cache ({type(e).__name__}): Llama-2's 32000"
    return largest_token_id(tokenizer) + 1, f"{cfg.data.tokenizer}'s"


def peak_flops(device: torch.device, peak_tflops: Optional[float]) -> tuple[Optional[float], str]:
    """The device's dense bf16 FLOP/s for MFU, and its name."""
    if device.type != "cuda":
        name = "CPU"
        return (peak_tflops * 1e12 if peak_tflops else None), name
    name = torch.cuda.get_device_name(device)
    if peak_tflops:
        return peak_tflops * 1e12, name
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None), name


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B): forward and
    backward of every weight matmul, plus attention's QKᵀ and scores·V; N leaves out the input embedding."""
    embedded = model.get_input_embeddings().weight.numel()
    multiplying = sum(p.numel() for p in trainable_parameters(model)) - embedded
    config = model.config
    return 6 * multiplying + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def synthetic_batches(vocab: int, batch_size: int, seq_len: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Random tokens, already on the device: the loop measures compute, not the data pipeline."""
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch_size, seq_len), generator=generator).to(device)
               for _ in range(SYNTHETIC_BATCHES)]
    return itertools.cycle(batches)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----- the inner loop -----------------------------------------------------------------------------
def skip_reason(name: str, device: torch.device, args: argparse.Namespace) -> Optional[str]:
    if name == "bf16-compile" and device.type == "cpu" and not args.compile_on_cpu:
        return "compiling takes minutes on a CPU (--compile-on-cpu runs it)"
    return None


def measure_inner(cfg: Config, vocab: int, device: torch.device, args: argparse.Namespace) -> dict:
    """tokens/s and peak memory of --steps inner steps after --warmup-steps, with cfg's [inner] and [compute]."""
    free_device_memory(device)
    model = build_model(cfg.model, vocab, cfg.run.seed).to(device)
    prepare_for_compute(model, cfg.compute)
    batches = synthetic_batches(vocab, cfg.inner.batch_size, cfg.data.seq_len, device)
    trainer = InnerTrainer(model, cfg.inner, batches, compute=cfg.compute, micro_batch_size=args.micro_batch_size)
    trainer.run(args.warmup_steps)
    synchronize(device)
    started = time.perf_counter()
    trainer.run(args.steps)
    synchronize(device)
    seconds = time.perf_counter() - started
    tokens = args.steps * cfg.inner.batch_size * cfg.inner.grad_accumulation * cfg.data.seq_len
    result = dict(tokens_per_s=tokens / seconds, seconds=seconds, micro_batch_size=trainer.micro_batch_size,
                  flops_per_token=flops_per_token(model, cfg.data.seq_len),
                  peak_memory_gib=(torch.cuda.max_memory_allocated(device) / BYTES_PER_GIB
                                   if device.type == "cuda" else None))
    del trainer, model, batches
    if cfg.compute.compile:
        torch._dynamo.reset()  # drop the compiled graphs with the model
    free_device_memory(device)
    return result


def run_variant(name: str, cfg: Config, vocab: int, device: torch.device, args: argparse.Namespace) -> dict:
    compute, inner = VARIANTS[name]
    row = dict(variant=name, precision=compute["precision"], optimizer=inner.get("optimizer", cfg.inner.optimizer),
               compiled=compute.get("compile", False))
    reason = skip_reason(name, device, args)
    if reason:
        return {**row, "skipped": reason}
    try:
        return {**row, **measure_inner(cfg.replace(compute=compute, inner=inner), vocab, device, args)}
    except (ImportError, RuntimeError) as e:  # no bitsandbytes, its CPU path, out of memory at micro-batch 1
        free_device_memory(device)
        return {**row, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def mfu(row: dict, peak: Optional[float]) -> Optional[float]:
    if peak is None or "tokens_per_s" not in row:
        return None
    return row["flops_per_token"] * row["tokens_per_s"] / peak


def inner_table(rows: list[dict], peak: Optional[float]) -> str:
    lines = ["| variant | precision | inner optimizer | compiled | micro-batch | tokens/s | MFU | peak memory GiB |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['variant']} | {r['precision']} | {r['optimizer']} | {'yes' if r['compiled'] else 'no'} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} | | | |")
            continue
        utilization = mfu(r, peak)
        memory = r["peak_memory_gib"]
        lines.append(f"{head} {r['micro_batch_size']} | {r['tokens_per_s']:,.0f} | "
                     f"{'–' if utilization is None else f'{100 * utilization:.1f}%'} | "
                     f"{'–' if memory is None else f'{memory:.2f}'} |")
    return "\n".join(lines)


# ----- the outer step's transfers -----------------------------------------------------------------
def per_parameter_gather(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float32) for p in params]


@torch.no_grad()
def per_parameter_scatter(global_params: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    for p, g in zip(params, global_params):
        p.copy_(g)


def time_round_trip(gather: Callable[[], object], scatter: Callable[[], None], device: torch.device,
                    repeats: int) -> dict:
    """Median ms of the device → host copy, and of the host → device copy until it returns and until done."""
    timings = []
    for _ in range(repeats + 1):  # the first round is warm-up
        synchronize(device)
        started = time.perf_counter()
        gather()
        gathered = time.perf_counter()
        scatter()
        returned = time.perf_counter()
        synchronize(device)
        timings.append((gathered - started, returned - gathered, time.perf_counter() - gathered))
    to_ms = lambda column: 1e3 * statistics.median(t[column] for t in timings[1:])  # noqa: E731
    return dict(device_to_host_ms=to_ms(0), host_to_device_returned_ms=to_ms(1), host_to_device_done_ms=to_ms(2))


def measure_transfers(cfg: Config, vocab: int, device: torch.device, repeats: int) -> dict:
    """The whole model's outer-step transfers, flat and per parameter."""
    free_device_memory(device)
    params = trainable_parameters(build_model(cfg.model, vocab, cfg.run.seed).to(device))
    global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
    started = time.perf_counter()
    transfer = FlatTransfer(params)
    allocation_ms = 1e3 * (time.perf_counter() - started)
    flat = time_round_trip(lambda: transfer.gather(params), lambda: transfer.scatter(global_params, params, 0.0),
                           device, repeats)
    per_parameter = time_round_trip(lambda: per_parameter_gather(params),
                                    lambda: per_parameter_scatter(global_params, params), device, repeats)
    return dict(bytes=transfer.host.numel() * 4, tensors=len(params), pinned=transfer.host.is_pinned(),
                host_buffer_allocation_ms=allocation_ms, flat=flat, per_parameter=per_parameter)


def transfer_table(result: dict) -> str:
    gigabytes = result["bytes"] / BYTES_PER_GB
    lines = ["| path | copies each way | device → host ms (GB/s) | host → device ms, host blocked | "
             "host → device ms, done on device (GB/s) |",
             "|---|---:|---:|---:|---:|"]
    paths = (("flat: one pinned buffer" if result["pinned"] else "flat: one buffer", "flat", 1),
             ("per parameter", "per_parameter", result["tensors"]))
    for label, key, copies in paths:
        t = result[key]
        lines.append(f"| {label} | {copies} | {t['device_to_host_ms']:.2f} "
                     f"({gigabytes / (t['device_to_host_ms'] / 1e3):.1f}) | {t['host_to_device_returned_ms']:.2f} | "
                     f"{t['host_to_device_done_ms']:.2f} ({gigabytes / (t['host_to_device_done_ms'] / 1e3):.1f}) |")
    return "\n".join(lines)


# ----- main ---------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    cfg = benchmark_config(args)
    vocab, vocab_source = vocabulary(cfg, args.tiny)
    peak, device_name = peak_flops(device, args.peak_tflops)
    rows = [run_variant(name, cfg, vocab, device, args) for name in args.variants]
    transfers = measure_transfers(cfg, vocab, device, args.transfer_repeats)
    num_params = transfers["bytes"] // 4
    model, inner = cfg.model, cfg.inner
    print(f"\n{num_params / 1e6:.1f}M-parameter Llama (hidden {model.hidden_size}, {model.num_layers} layers), "
          f"vocabulary {vocab} ({vocab_source}), seq_len {cfg.data.seq_len}, {inner.batch_size} × "
          f"{inner.grad_accumulation} sequences per inner step, synthetic tokens; {device_name}; "
          f"{args.warmup_steps} untimed + {args.steps} timed inner steps per variant")
    print("MFU against " + (f"{peak / 1e12:.0f} TFLOP/s dense bf16 (fp32 too)" if peak else
                            "no known peak (give --peak-tflops)") + "\n")
    print(inner_table(rows, peak))
    print(f"\nOuter-step transfers of the whole model ({transfers['bytes'] / BYTES_PER_GB:.3f} GB in fp32, "
          f"{transfers['tensors']} tensors), median of {args.transfer_repeats}; the flat host buffer is "
          f"allocated once: {transfers['host_buffer_allocation_ms']:.1f} ms\n")
    print(transfer_table(transfers))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(args=vars(args), device=device_name, vocab=vocab, vocab_source=vocab_source, peak_flops=peak,
                   num_params=num_params, inner=[{**r, "mfu": mfu(r, peak)} for r in rows], transfers=transfers,
                   config=dataclasses.asdict(cfg))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out / 'results.json'}; benchmark wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
