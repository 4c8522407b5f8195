"""A run outlives its peers: what the keeper costs, and how soon a newcomer goes on after the last peer left.

    python benchmarks/run_history.py                       # the demo config, 4 outer steps, ~3 min
    python benchmarks/run_history.py --outer-steps 6 --out bench-out/run_history
    python benchmarks/run_history.py --config big.toml --scenarios keeper   # the keeper's memory alone

On 127.0.0.1 with ``--config`` (default peers/demo.toml; ``--steps-per-outer`` replaces its H), three times:

1. **keeper**: a bootstrap node with ``--keep`` and 2 peers that take ``--outer-steps`` outer steps and
   leave (``--max-outer-steps``); then a newcomer, started as the last of them exits. Reported: seconds
   from that exit to the newcomer's ``state_loaded`` and to its first ``outer_step``, where its state
   came from (the metrics' ``source``), and that it went on from the run's last step with the run's
   hash. The keeper's cost: the memory of the bootstrap node's process tree (the node, its averager
   processes and p2pd: the sum of their proportional set sizes, so that shared-memory tensors count
   once) after the run against a node without ``--keep`` started beside it the same way, and the bytes of the state it downloads per outer step of the run (θ_global and the
   momentum in fp32), as its log reports each load.
2. **store**: no keeper; the first 2 peers write every outer step to a checkpoint store (a local
   directory); the newcomer reads it.
3. **neither**: no keeper, no store; the newcomer must stop with exit status 5 within its
   ``swarm.state_wait_timeout`` (``--wait-timeout-s``, default 20) having trained nothing.

Every process it starts is stopped at the end (SIGTERM, then SIGKILL of its tree), and it checks by PID
that none is left. Prints a Markdown table; writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.churn import prepare_tokenizer, write_run_config  # noqa: E402
from p2p_diloco.demo import DEFAULT_CONFIG, cli_command, start_bootstrap, stop_process  # noqa: E402
from p2p_diloco.metrics import read_metrics  # noqa: E402
from p2p_diloco.process_tree import descendant_pids, kill_tree, wait_gone  # noqa: E402

PEERS = 2


def pss_mib(pid: int) -> float:
    """Memory of a process and its descendants, MiB: the sum of their proportional set sizes (/proc's
    smaps_rollup), so that the shared-memory tensors of a peer and its averager process count once."""
    total = 0
    for p in [pid, *descendant_pids(pid)]:
        try:
            fields = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        match = re.search(r"^Pss:\s+(\d+) kB", fields, re.M)
        total += int(match.group(1)) if match else 0
    return total / 1024


def with_swarm(config: Path, dest: Path, **values) -> Path:
    """A copy of `config` with `values` set in its [swarm] table."""
    text = config.read_text()
    for key, value in values.items():
        text = re.sub(rf"(?m)^{key}\s*=.*\n", "", text)
        text = text.replace("[swarm]\n", f"[swarm]\n{key} = {json.dumps(value)}\n", 1)
    dest.write_text(text)
    return dest


def peer(config: Path, maddr: str, out: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(out / f"{name}.log", "w")
    return subprocess.Popen(cli_command("peer", "--config", str(config), "--host", "127.0.0.1", "--initial-peers", maddr,
                                        "--metrics-file", str(out / f"{name}.jsonl"), *extra),
                            stdout=log, stderr=subprocess.STDOUT)


def scenario(name: str, config: Path, args: argparse.Namespace, started: list[subprocess.Popen]) -> dict:
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    keep = ("--keep", str(config)) if name == "keeper" else ()
    node, maddr = start_bootstrap(out, 120.0, *keep)
    started.append(node)
    bare = None
    if name == "keeper":  # the same node without --keep, beside it, for the memory the keeper adds
        bare, _ = start_bootstrap(out, 120.0, log_name="bare-bootstrap.log")
        started.append(bare)
    first = [peer(config, maddr, out, f"peer{i}", "--wait-for-peers", str(PEERS), "--max-outer-steps",
                  str(args.outer_steps)) for i in range(PEERS)]
    started.extend(first)
    codes = [p.wait(args.timeout_s) for p in first]
    left_at = time.time()
    run_hash = {r["global_sha256"] for i in range(PEERS) for r in read_metrics(out / f"peer{i}.jsonl")
                if r["event"] == "outer_step" and r["outer_step"] == args.outer_steps}
    newcomer = peer(config if name != "neither" else with_swarm(config, out / "no-store.toml", checkpoint_store=""),
                    maddr, out, "newcomer", "--max-outer-steps", str(args.outer_steps + 1))
    started.append(newcomer)
    code = newcomer.wait(args.timeout_s)
    records = read_metrics(out / "newcomer.jsonl") if (out / "newcomer.jsonl").exists() else []
    loaded = next((r for r in records if r["event"] == "state_loaded"), None)
    stepped = next((r for r in records if r["event"] == "outer_step"), None)
    result = dict(scenario=name, first_exit_codes=codes, newcomer_exit=code, run_hashes=len(run_hash),
                  source=loaded and loaded.get("source"), loaded_step=loaded and loaded["outer_step"],
                  loaded_run_state=bool(loaded and loaded["global_sha256"] in run_hash),
                  s_to_loaded=loaded and loaded["time"] - left_at, s_to_first_step=stepped and stepped["time"] - left_at,
                  first_step=stepped and stepped["outer_step"], outer_steps=sum(r["event"] == "outer_step" for r in records))
    if name == "keeper":
        result["keeper_pss_mib"], result["bare_pss_mib"] = pss_mib(node.pid), pss_mib(bare.pid)
        loads = re.findall(r"loaded global state at outer step (\d+)", (out / "bootstrap.log").read_text())
        result["keeper_loads"] = len(loads)
    return result


def stop_all(started: list[subprocess.Popen]) -> list[int]:
    children = [pid for proc in started if proc.poll() is None for pid in descendant_pids(proc.pid)]
    for proc in started:
        stop_process(proc, grace_s=30.0)
    left = wait_gone(children, 15)
    for pid in left:
        kill_tree(pid)
    return left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--outer-steps", type=int, default=4)
    parser.add_argument("--steps-per-outer", type=int, default=10)
    parser.add_argument("--wait-timeout-s", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on each process's run")
    parser.add_argument("--scenarios", default="keeper,store,neither", help="which of them to run")
    parser.add_argument("--out", type=Path, default=Path("bench-out/run_history"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = write_run_config(args.config, args.steps_per_outer, args.out / "base.toml")
    prepare_tokenizer(base)
    store = args.out / "store"
    configs = {
        "keeper": with_swarm(base, args.out / "keeper.toml", state_wait_timeout=args.wait_timeout_s),
        "store": with_swarm(base, args.out / "store.toml", state_wait_timeout=args.wait_timeout_s,
                            checkpoint_store=str(store), checkpoint_every=1),
        "neither": with_swarm(base, args.out / "neither.toml", state_wait_timeout=args.wait_timeout_s),
    }
    results, leftovers = [], []
    for name, config in configs.items():
        if name not in args.scenarios.split(","):
            continue
        started: list[subprocess.Popen] = []
        try:
            results.append(scenario(name, config, args, started))
        finally:
            leftovers += stop_all(started)
    from p2p_diloco.config import load_config
    from p2p_diloco.train.model import build_run_model
    from p2p_diloco.train.data import TextData
    cfg = load_config(base)
    params = sum(p.numel() for p in build_run_model(cfg, TextData(cfg.data).tokenizer).parameters())
    print(f"\n{params:,} parameters; state {8 * params / 1e6:.2f} MB (θ_global and momentum, fp32)\n")
    print("| newcomer | exit | state from | loaded step (the run's hash) | s after the last peer left: loaded / first outer step | outer steps it took |")
    print("|---|---|---|---|---|---|")
    for r in results:
        fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {r['scenario']} | {r['newcomer_exit']} | {r['source'] or '–'} | "
              f"{'–' if r['loaded_step'] is None else r['loaded_step']} ({'yes' if r['loaded_run_state'] else 'no'}) | "
              f"{fmt(r['s_to_loaded'])} / {fmt(r['s_to_first_step'])} | {r['outer_steps']} |")
    keeper = results[0]
    if "keeper_pss_mib" in keeper:
        print(f"\nkeeper: process tree {keeper['keeper_pss_mib']:.0f} MiB (PSS) against {keeper['bare_pss_mib']:.0f} MiB "
              f"without --keep; {keeper['keeper_loads']} state loads of {8 * params / 1e6:.2f} MB for "
              f"{args.outer_steps} outer steps")
    (args.out / "results.json").write_text(json.dumps(dict(params=params, results=results), indent=2))
    if leftovers:
        print(f"processes left running and killed: {leftovers}")
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
