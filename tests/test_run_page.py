"""The run's status: as a table, as JSON and as a page (p2p_diloco/run_page) in a real headless Chromium.

* what the page remembers stays bounded over a run of any length, and one stranger's claims cannot
  move its plots far; markup a peer writes is escaped;
* one real swarm on 127.0.0.1 (a bootstrap node that keeps the run's state and serves its page, two
  peers, and a stranger whose signed status record is markup): `status` lists the peers as a table
  and as JSON; the page in Chromium shows the two peers in its table, draws its plots (the keeper's
  held-out loss of θ_global among them), shows a new outer step without a reload, and shows the
  stranger's markup as text; `status --serve` serves the same JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest

from p2p_diloco import __version__
from p2p_diloco.process_tree import descendant_pids, stop_processes
from p2p_diloco.run_page.history import RunHistory, Series, TokenCount
from p2p_diloco.run_page.render import render_main
from tests.conftest import REPO
from tests.hostile import MARKUP
from tests.swarm_helpers import (
    FAST_TIMEOUTS, IDLING, LOOPBACK, events, last_step, peer_id_of, start_bootstrap, start_peer, tiny_config_file,
    wait_for_steps, wait_until,
)

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def row(peer_id: str, **change) -> dict:
    """A peer as `status --json` lists it."""
    value = dict(peer_id=peer_id, outer_step=5, phase="training", inner_steps=50, samples_per_s=10.0, loss=3.0,
                 reachability="direct", answers=True, version="0.1", device="cpu", uptime_s=60.0, data_shard=None,
                 fingerprint="ab" * 32, stored_step=None, ranks=1, samples=100, rounds=4, group_size=3,
                 sync_bytes=1000, utilization=0.9, rounds_not_applied=0, eval_loss=None, eval_step=None, time=0.0)
    return {**value, **change}


def test_a_series_keeps_its_whole_span_in_bounded_memory():
    series = Series(max_points=64)
    for step in range(10_000):
        series.record(step, float(step))
        series.record(step, float(step))  # a second reading of the same step replaces the first
    series.record(5, -1.0)  # a record from a peer behind the run: ignored
    assert len(series.steps) <= 64 and series.steps[0] <= 256 and series.steps[-1] == 9_999
    assert series.values == [float(s) for s in series.steps] and series.steps == sorted(set(series.steps))


def test_tokens_count_restarted_peers_and_forget_old_ones_without_losing_their_tokens():
    count = TokenCount(max_peers=2)
    for peer, samples in (("a", 10), ("a", 30), ("b", 5), ("a", 4), ("c", 1), ("d", 1)):  # a restarted: 30 -> 4
        count.observe(peer, samples)
    assert count.samples == 30 + 4 + 5 + 1 + 1


def test_one_stranger_cannot_move_the_plots_far():
    history = RunHistory("test")
    honest = [row(f"peer{i}", loss=3.0 + i / 10, group_size=3, utilization=0.9) for i in range(3)]
    stranger = row("stranger", loss=1e30, group_size=10**9, utilization=0.0, sync_bytes=10**15)
    keeper = row("keeper", phase="keeping", samples=0, samples_per_s=0.0, eval_loss=2.5, eval_step=4)
    history.observe([*honest, stranger, keeper], tokens_per_sample=16, now=1.0)
    assert history.summary["outer_step"] == 5 and history.summary["live_peers"] == 4
    point = {name: s.values[-1] for name, s in history.series.items() if s.values}
    assert 3.0 <= point["loss"] <= 3.2 and point["group_size"] == 3 and point["utilization"] == 0.9
    assert history.series["eval_loss"].steps == [4] and point["eval_loss"] == 2.5
    assert history.summary["tokens_trained"] == 4 * 100 * 16
    history.observe([], tokens_per_sample=16, now=2.0)  # every peer left: the run stays where it was
    assert history.summary["outer_step"] == 5 and history.series["peers"].values[-1] == 0
    assert history.summary["tokens_trained"] == 4 * 100 * 16


def test_the_held_out_loss_comes_from_peers_and_keepers_and_one_stranger_cannot_move_it_far():
    history = RunHistory("test")
    # the peers measured θ_global at step 10 (eval.every = 10); one of them is still at step 0's "none yet"
    peers = [row(f"peer{i}", outer_step=11, eval_loss=loss, eval_step=10) for i, loss in enumerate((2.4, 2.6, 2.5))]
    peers.append(row("peer3", outer_step=11))
    stranger = row("stranger", outer_step=11, eval_loss=0.0, eval_step=10**6)  # a step far ahead, a loss of 0
    keeper = row("keeper", phase="keeping", outer_step=8, samples=0, eval_loss=2.9, eval_step=5)
    history.observe([*peers, stranger, keeper], tokens_per_sample=16, now=1.0)
    series = history.series["eval_loss"]
    assert series.steps == [10] and series.values == [2.5] and history.summary["eval_loss"] == 2.5
    # the next measurement, once most peers have it: a new point at its own step (the line joins measurements)
    peers = [row(f"peer{i}", outer_step=20, eval_loss=2.0, eval_step=20) for i in range(3)]
    history.observe([*peers, stranger, keeper], tokens_per_sample=16, now=2.0)
    assert series.steps == [10, 20] and series.values == [2.5, 2.0]


def test_each_peer_shows_its_claimed_samples_beside_what_its_groups_counted():
    api = dict(time=1.0, runs=[dict(run="test", peers=[row("peerIsland", samples=8000, counted_samples=8000),
                                                       row("peerLiar", samples=2**48, counted_samples=1600),
                                                       row("peerOld", samples=100)], summary={}, history={})])
    page = render_main(api)
    header = re.findall(r"<th>([^<]*)</th>", page)
    cells = {peer: re.findall(r"<td>([^<]*)</td>", tr) for peer, tr in
             re.findall(r'<tr data-peer-id="(\w+)">(.*?)</tr>', page)}
    counted, samples = header.index("counted") - 1, header.index("claimed") - 1  # the first cell has a class
    assert [cells[p][samples] for p in ("peerIsland", "peerLiar", "peerOld")] == ["8k", "281T", "100"]
    assert [cells[p][counted] for p in ("peerIsland", "peerLiar", "peerOld")] == ["8k (100 %)", "1.6k (0 %)", "-"]


def test_markup_in_a_record_is_shown_as_text():
    api = dict(time=1.0, runs=[dict(run="test", peers=[row("peer0", device=MARKUP, version="<b>0</b>")],
                                    summary={}, history={})])
    page = render_main(api)
    assert "<img" not in page and "<b>" not in page and "&lt;img src=x onerror=&quot;" in page


# ----- a real swarm ---------------------------------------------------------------------------------
def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def cli(*args: str) -> subprocess.Popen:
    """A `p2p-diloco` command that ends by itself, started (two can run at once): see :func:`finished`."""
    return subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def finished(command: subprocess.Popen, timeout_s: float = 120) -> tuple[int, str, str]:
    """Its exit status, stdout and stderr; killed (by PID) if it runs past `timeout_s`."""
    try:
        out, err = command.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        command.kill()
        command.wait(10)
        raise
    return command.returncode, out, err


@pytest.fixture
def chromium():
    """A headless Chromium driven by chromedriver (Debian's chromium and chromium-driver); stopped by PID."""
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("P2P_DILOCO_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromedriver are required (apt-get install chromium chromium-driver)")
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    service = Service(CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    tree = [service.process.pid, *descendant_pids(service.process.pid)]
    try:
        yield driver
    finally:
        driver.quit()
        stop_processes(tree, grace_s=5)


def logged(processes, name: str, pattern: str, timeout_s: float = 60) -> str:
    """The first match of `pattern`'s group in process `name`'s log, once there."""
    found: list[str] = []

    def matched() -> bool:
        found.extend(re.findall(pattern, processes.log(name)))
        return bool(found)
    wait_until(matched, timeout_s, f"{pattern!r} in the log of {name}")
    return found[0]


PAGE_AT = r"the run's page is at (http://127\.0\.0\.1:\d+/)"


@pytest.mark.swarm
@pytest.mark.timeout(480)
def test_status_as_a_table_as_json_and_as_a_page_in_a_browser(processes, tmp_path, chromium):
    # the peers and the keeper measure θ_global on 4 held-out sequences after every outer step
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=FAST_TIMEOUTS,
                              eval={"every": 1, "sequences": 4})
    maddr = start_bootstrap(processes, LOOPBACK, "--keep", str(config), "--page-port", "0", "--page-refresh", "1")
    # the peers start together, as a user starts them (--wait-for-peers; the keeper is not counted): one that came 1 s
    # before the other took 4 steps alone, the keeper followed it to step 1 only, and the other, holding step 1 with
    # the keeper, would not jump to step 4 on one voucher, while the first never averaged alone again (CI, once:
    # the simulation's open defect of a lone peer ahead)
    # (the peers idle: at full speed their rounds and the keeper's downloads of each step kept CI's cores busy while
    # `status`, Chromium and the stranger started)
    metrics = [start_peer(processes, f"peer{i}", config, maddr, "--wait-for-peers", "2", faults=IDLING)
               for i in range(2)]
    served = processes.start("status-serve", "status", "--initial-peers", maddr, "--serve", "--port", "0",
                             "--refresh", "1")
    wait_for_steps(metrics, 2)
    peers = {peer_id_of(m) for m in metrics}

    # the table and the JSON of `status`
    table, as_json = cli("status", "--initial-peers", maddr), cli("status", "--initial-peers", maddr, "--json")
    code, out, err = finished(as_json)
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    by_peer = {peer["peer_id"]: peer for peer in run["peers"]}
    (keeper,) = set(by_peer) - peers  # the bootstrap node's keeper; "loading" while it downloads a step
    assert by_peer[keeper]["phase"] in ("keeping", "loading"), by_peer[keeper]
    for path in metrics:
        peer = by_peer[peer_id_of(path)]
        # published after the metrics record of the same step: never ahead of it
        assert 2 <= peer["outer_step"] <= last_step(path) and peer["rounds"] >= 1 and peer["samples"] > 0
        assert peer["answers"] is True and peer["reachability"] == "direct" and peer["version"] == __version__
        assert peer["phase"] in ("training", "syncing") and peer["inner_steps"] >= 20 and peer["device"] == "cpu"
        # its held-out loss of θ_global: measured after each outer step, written to its metrics first
        evaluations = events(path, "eval")
        steps = [e["outer_step"] for e in evaluations]
        first = events(path, "outer_step")[0]["outer_step"]  # after 1, or after the state it loaded: a late start
        assert steps == list(range(first, first + len(steps))), (first, steps)
        assert set(steps) <= {r["outer_step"] for r in events(path, "outer_step")}
        assert all(e["sequences"] == 4 and 0 < e["eval_loss"] < 10 for e in evaluations), evaluations
        assert peer["eval_step"] in steps
        assert peer["eval_loss"] == evaluations[steps.index(peer["eval_step"])]["eval_loss"]
    code, out, err = finished(table)  # every run the swarm announces, as a table
    assert code == 0, err
    assert "run test: 3 live peer(s)" in out and all(p[-8:] in out for p in by_peer)
    assert "held-out" in out.splitlines()[1] and re.search(r" \d+\.\d{3}@\d+ ", out), out  # loss@outer step

    # the page, in a browser: the peers, the plots (the keeper's held-out loss among them)
    chromium.get(logged(processes, "bootstrap", PAGE_AT))

    # read in one script each: the page swaps <main> every second, and an element found by one call may be
    # gone by the next (selenium's StaleElementReferenceException, once in CI)
    def shown_peers() -> set[str]:
        return set(chromium.execute_script(
            "return Array.from(document.querySelectorAll('table.peers tbody tr'), r => r.dataset.peerId)"))

    def plotted(series: str) -> int:
        points = chromium.execute_script(
            "const l = document.querySelector(arguments[0]); return l ? l.getAttribute('points') : ''",
            f'svg.plot[data-series="{series}"] polyline')
        return len(points.split())

    wait_until(lambda: shown_peers() == peers and plotted("eval_loss") >= 1 and plotted("loss") >= 2, 120,
               "the page to show both peers and their plots")
    assert all(plotted(s) >= 1 for s in ("loss", "group_size", "sync_bytes", "utilization", "tokens_per_s"))
    step_shown = lambda: int(chromium.execute_script(  # noqa: E731
        "return document.querySelector('[data-fact=\"outer step\"]').textContent"))
    chromium.execute_script("window.notReloaded = true")
    before = step_shown()
    wait_until(lambda: step_shown() > before, 120, "the page to show the next outer step")
    assert chromium.execute_script("return window.notReloaded") is True  # refreshed in place

    # a stranger's markup is text on the page, in its JSON and in `status --serve`'s JSON
    processes.start("hostile-markup", "markup", "--config", str(config), "--initial-peers", maddr,
                    module="tests.hostile")
    author = logged(processes, "hostile-markup", r"markup signed as (\w+)", 120)
    wait_until(lambda: author in shown_peers(), 120, "the page to show the stranger")
    cells = chromium.execute_script("return Array.from(document.querySelectorAll(arguments[0]), c => c.innerText)",
                                    f'tr[data-peer-id="{author}"] td')
    assert MARKUP in cells and "<b>0</b><script>1</script>" in cells
    assert not chromium.execute_script("return document.querySelectorAll('main img, main b, main script').length")
    assert chromium.title == "p2p-diloco run"  # the onerror never ran

    served_url = logged(processes, "status-serve", PAGE_AT, 120)
    runs: list = []

    def served_everyone() -> bool:  # each refresh is a DHT read of its own, which may miss a record (once in CI)
        runs[:] = json.loads(get(served_url + "api/status"))["runs"]
        return peers | {author} <= {p["peer_id"] for run in runs for p in run["peers"]}

    wait_until(served_everyone, 60, "status --serve to read the peers and the stranger")
    (run,) = runs
    assert run["summary"]["live_peers"] >= 2 and run["history"]["peers"]["values"]
    stranger = next(p for p in run["peers"] if p["peer_id"] == author)
    assert stranger["version"] == "<b>0</b><script>1</script>"  # JSON: the string as is
    served.terminate()
    assert served.wait(30) == 0
