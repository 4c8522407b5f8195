"""Codecs and Streaming DiLoCo at equal tokens: held-out loss and bytes on the wire for each way of syncing.

    python benchmarks/codec_quality.py                        # 7 codecs, about 3 minutes each on 2 cores
    python benchmarks/codec_quality.py --codecs none,nf4 --outer-steps 14 --inner-steps 50 --peers 4
    python benchmarks/codec_quality.py --codecs none \
        --variants "codec=fp4-e3m0 error_feedback=true; codec=fp4-e3m0 fragments=2 sync_delay=1 merge_alpha=0.5"

Each --variants entry is a set of [outer] settings (p2p_diloco/config.py) over DiLoCo's blocking fp32
sync; an overlap (sync_delay) is Streaming DiLoCo's fixed τ there unless the entry says
fixed_sync_delay=false, as the shipped defaults do. With P fragments a run takes P·K outer steps, each
syncing one fragment, so that every run trains the same K·H inner steps. "τ run" is the mean of the
inner steps that ran beside each sync.

The same setup as benchmarks/quality.py (its DiLoCo run, on the shipped tinyshakespeare), once per
codec. Every run takes the same inner steps on the same data from the same initial weights, so the
only difference is how the pseudo-gradients travel (p2p_diloco/sync/codecs.py). The table gives the
final held-out loss, its gap to fp32 (`none`), the bytes each peer sent and received per parameter
per outer step (a butterfly all-reduce moves 4·(M−1)/M · bytes_per_parameter of the codec: a peer
sends and receives (M−1)/M of its Δ and of the mean), and whether every peer held one θ_global
after every outer step.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

import torch

from p2p_diloco.node_runner import setup_logging
from p2p_diloco.sync.codecs import CODECS, bytes_per_parameter
from p2p_diloco.train.data import TextData
from quality import (
    add_model_arguments, add_run_arguments, benchmark_config, checked_run_arguments, count_trainable_params,
    percent_gap, run_diloco,
)

# each with DiLoCo's own sync, no error feedback: the mask and the 1- and 2-bit codecs need it (run them as
# --variants, with error_feedback=true)
DEFAULT_CODECS = ("none", "fp16", "int8", "nf4", "fp4-e3m0")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="comma-separated outer.codec values")
    parser.add_argument("--variants", default="",
                        help="more runs, separated by ';': each a space-separated list of outer settings, "
                             "e.g. 'codec=fp4-e3m0 fragments=2 sync_delay=1 merge_alpha=0.5'")
    add_run_arguments(parser, out="bench-out/codecs")
    add_model_arguments(parser)
    args = checked_run_arguments(parser)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in args.codecs if c not in CODECS]
    if unknown:
        parser.error(f"unknown codec(s) {', '.join(unknown)}; valid: {', '.join(CODECS)}")
    if "none" not in args.codecs:
        args.codecs.insert(0, "none")  # the reference every gap is measured against
    args.variants = [{"codec": codec} for codec in args.codecs] + [
        parse_variant(parser, text) for text in args.variants.split(";") if text.strip()]
    return args


def parse_variant(parser: argparse.ArgumentParser, text: str, option: str = "--variants") -> dict:
    """'codec=fp4-e3m0 fragments=2' -> {"codec": "fp4-e3m0", "fragments": 2}: TOML values, or bare words."""
    values = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"{option}: {item!r} is not key=value")
        try:
            values[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = value  # a bare word: a string such as a codec name
    return values


def label(variant: dict) -> str:
    return " ".join(f"{k}={v}" if k != "codec" else str(v) for k, v in variant.items())


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    setup_logging(verbose=False)
    torch.set_num_threads(1)  # one thread per peer, as benchmarks/quality.py
    cfg = benchmark_config(args.text, args.seed, args.inner_steps, args.outer_steps * args.inner_steps, args.model,
                           args.batch_size)
    data = TextData(cfg.data)
    num_params = count_trainable_params(cfg, data.vocab_size)
    rows = []
    for variant in args.variants:
        run_cfg = cfg.replace(outer=variant)  # validated: a bad setting stops here with the config's message
        syncs = args.outer_steps * run_cfg.outer.fragments
        result = run_diloco(run_cfg, data, args.peers, syncs)
        rows.append(dict(codec=label(variant), final_eval_loss=result.final_eval_loss,
                         wire_bytes_per_param_per_step=result.bytes_per_peer / num_params / args.outer_steps,
                         codec_bytes_per_param=bytes_per_parameter(run_cfg.outer.codec),
                         peak_bytes_per_param_per_sync=result.bytes_per_peer / num_params / syncs,
                         train_seconds=result.train_seconds,
                         # θ_global's held-out loss after each outer step: how a sync ages the agreed model
                         eval_losses=result.curve.eval_losses,
                         overlap_steps=result.details["overlap_steps"],
                         one_global_state=result.details["identical_global_model_every_step"],
                         full_group_rounds=f"{result.details['rounds_with_full_group']}/"
                                           f"{result.details['rounds_recorded']}"))
    reference = rows[0]["final_eval_loss"]
    print(f"\n{num_params / 1e6:.2f}M-parameter Llama, M = {args.peers}, H = {args.inner_steps}, "
          f"K = {args.outer_steps}, batch {args.batch_size}, on {Path(args.text).name}\n")
    print("| sync | bytes/param (codec) | sent+received per param per H inner steps | per sync (peak) | "
          "τ run | final eval loss | vs fp32 | one θ_global every step | rounds in the full group |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['codec']} | {r['codec_bytes_per_param']:.4g} | {r['wire_bytes_per_param_per_step']:.3f} | "
              f"{r['peak_bytes_per_param_per_sync']:.3f} | {r['overlap_steps']:.1f} | "
              f"{r['final_eval_loss']:.4f} | {percent_gap(r['final_eval_loss'], reference):+.2f}% | "
              f"{r['one_global_state']} | {r['full_group_rounds']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(args=vars(args), num_params=num_params, rows=rows), indent=2))
    print(f"\nwrote {out / 'results.json'}; benchmark wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
