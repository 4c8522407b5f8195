"""The run's page: a screenshot from a real run, and what the page costs.

    python benchmarks/run_page.py                      # the demo config, 3 peers, 10 outer steps, ~3 min
    python benchmarks/run_page.py --screenshot docs/img/run_page.png

1. **A real run** on 127.0.0.1 with ``--config`` (default peers/demo.toml): a bootstrap node that keeps
   the run's state and serves its page (``bootstrap --keep --page-port``), ``--peers`` peers that take
   ``--outer-steps`` outer steps, and a ``status --serve`` process beside them. Before the peers stop,
   headless Chromium (Debian's chromium and chromedriver, driven by selenium) loads the bootstrap
   node's page, saves a screenshot, and times the load (Navigation Timing: navigation start to the
   load event). Reported: the memory of the ``status --serve`` process tree (the sum of its
   proportional set sizes: the node, its p2pd) at the end of the run.
2. **A long history, in this process**: a :class:`~p2p_diloco.run_page.server.RunPage` fed 1,000
   readings of a run of ``--history-peers`` peers, one outer step each (records as ``status --json``
   has them). Reported: the bytes the page's history holds (tracemalloc), the growth of this process's
   resident memory, the sizes of the page and of ``/api/status``, and Chromium's load time of that page.

Every process it starts is stopped at the end, by PID. Prints a Markdown table; writes results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.run_history import peer, pss_mib, stop_all  # noqa: E402
from p2p_diloco.demo import DEFAULT_CONFIG, cli_command, start_bootstrap  # noqa: E402
from p2p_diloco.metrics import read_metrics  # noqa: E402
from p2p_diloco.run_page.server import RunPage  # noqa: E402


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1150", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))


def load_ms(driver, url: str, times: int = 5) -> float:
    """The median of `times` loads of `url`: navigation start to the end of the load event, ms."""
    loads = []
    for _ in range(times):
        driver.get(url)
        loads.append(driver.execute_script(
            "const t = performance.getEntriesByType('navigation')[0]; return t.loadEventEnd - t.startTime;"))
    return sorted(loads)[len(loads) // 2]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def real_run(args, driver, started: list) -> dict:
    out = args.out / "run"
    out.mkdir(parents=True, exist_ok=True)
    node, maddr = start_bootstrap(out, 120.0, "--keep", str(args.config), "--page-port", "0", "--page-refresh", "2")
    started.append(node)
    peers = [peer(args.config, maddr, out, f"peer{i}", "--wait-for-peers", str(args.peers), "--max-outer-steps",
                  str(args.outer_steps)) for i in range(args.peers)]
    started.extend(peers)
    served = subprocess.Popen(cli_command("status", "--initial-peers", maddr, "--serve", "--port", "0", "--refresh",
                                          "2"), stdout=subprocess.PIPE, stderr=open(out / "status-serve.log", "w"),
                              text=True)
    started.append(served)
    served.stdout.readline()  # its URL: it is serving
    deadline = time.monotonic() + args.timeout_s
    log = out / "bootstrap.log"
    while time.monotonic() < deadline:  # the peers near their last step: the page shows them all, live
        steps = [max((r["outer_step"] for r in read_metrics(out / f"peer{i}.jsonl") if r["event"] == "outer_step"),
                     default=0) if (out / f"peer{i}.jsonl").exists() else 0 for i in range(args.peers)]
        if min(steps) >= args.outer_steps - 1:
            break
        time.sleep(1)
    url = next(line.split("the run's page is at ")[1].split()[0] for line in log.read_text().splitlines()
               if "the run's page is at " in line)
    time.sleep(3)  # one more reading of the swarm
    driver.get(url)
    time.sleep(1)
    if args.screenshot:
        args.screenshot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.screenshot))
    result = dict(peers=args.peers, outer_steps=min(steps), load_ms=load_ms(driver, url),
                  status_serve_pss_mib=round(pss_mib(served.pid), 1),
                  page_bytes=len(urllib.request.urlopen(url).read()))
    for p in peers:
        p.wait(args.timeout_s)
    return result


def synthetic_runs(step: int, peers: int) -> list[dict]:
    """One reading of a run of `peers` peers at outer step `step`, as read_runs returns it."""
    rows = [dict(peer_id=f"12D3KooW{i:044d}", outer_step=step, phase="training", inner_steps=step * 500,
                 samples_per_s=40.0 + i, loss=6.0 / (1 + step / 200) + i / 100, reachability="direct", answers=True,
                 version="0.3.0", device="cuda (NVIDIA H100 80GB HBM3)", uptime_s=step * 60.0, data_shard=i,
                 fingerprint="ab" * 32, stored_step=step - step % 50, ranks=1, samples=step * 8000, rounds=step,
                 group_size=peers, sync_bytes=30_000_000, utilization=0.93, rounds_not_applied=0, eval_loss=None,
                 eval_step=None, time=time.time()) for i in range(peers)]
    rows.append(dict(rows[0], peer_id="12D3KooWkeeper" + "0" * 38, phase="keeping", samples_per_s=0.0, samples=0,
                     eval_loss=6.0 / (1 + step / 200), eval_step=step, device="cpu"))
    return [dict(run="long-run", peers=rows, tokens_per_sample=1024)]


def long_history(args, driver) -> dict:
    step = [0]
    page = RunPage(lambda: synthetic_runs(step[0], args.history_peers), "127.0.0.1", 0, refresh_s=3600)
    try:
        tracemalloc.start()
        rss_before = rss_mib()
        before = tracemalloc.take_snapshot()
        for step[0] in range(1, args.history_steps + 1):
            page.read_swarm()
        after = tracemalloc.take_snapshot()
        held = sum(s.size_diff for s in after.compare_to(before, "filename"))
        rss_after = rss_mib()
        tracemalloc.stop()
        api = urllib.request.urlopen(page.url + "api/status").read()
        html = urllib.request.urlopen(page.url).read()
        return dict(history_steps=args.history_steps, history_peers=args.history_peers,
                    history_kib=round(held / 1024, 1), rss_growth_mib=round(rss_after - rss_before, 1),
                    page_kib=round(len(html) / 1024, 1), api_kib=round(len(api) / 1024, 1),
                    load_ms=load_ms(driver, page.url))
    finally:
        page.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--outer-steps", type=int, default=10)
    parser.add_argument("--history-steps", type=int, default=1000)
    parser.add_argument("--history-peers", type=int, default=16)
    parser.add_argument("--screenshot", type=Path, default=None, help="save the real run's page here (PNG)")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "run_page")
    parser.add_argument("--skip-run", action="store_true", help="only the long history")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    driver = browser()
    started: list = []
    try:
        run = None if args.skip_run else real_run(args, driver, started)
        history = long_history(args, driver)
    finally:
        driver.quit()
        left = stop_all(started)
    results = dict(run=run, history=history, left_running=left)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("| what | value |\n|---|---|")
    if run:
        print(f"| real run: {run['peers']} peers + keeper, outer step {run['outer_steps']} | page load "
              f"{run['load_ms']:.0f} ms, page {run['page_bytes'] / 1024:.1f} KiB; `status --serve` process tree "
              f"{run['status_serve_pss_mib']:.0f} MiB PSS |")
    print(f"| {history['history_steps']} outer steps of history, {history['history_peers']} peers | history "
          f"{history['history_kib']:.0f} KiB (tracemalloc), resident memory +{history['rss_growth_mib']:.1f} MiB; "
          f"page {history['page_kib']:.0f} KiB, /api/status {history['api_kib']:.0f} KiB; load "
          f"{history['load_ms']:.0f} ms |")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
