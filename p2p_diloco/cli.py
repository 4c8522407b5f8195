"""The `p2p-diloco` command: bootstrap a swarm, join it as a training peer, or run the offline demo.

Only argument parsing and wiring live here; the work is done in p2p_diloco.node_runner and
p2p_diloco.demo.
"""

from __future__ import annotations

import sys

import click

from p2p_diloco import __version__


def _network_options(default_port: int):
    """Flags shared by `bootstrap` and `peer` (see docs and Petals' CLI for the conventions)."""

    def decorate(fn):
        options = [
            click.option("--host", default="0.0.0.0", show_default=True,
                         help="Address to listen on. 0.0.0.0 = all interfaces; use 127.0.0.1 for a local test."),
            click.option("--port", default=default_port, show_default=True, type=click.IntRange(0, 65535),
                         help="TCP port to listen on (0 = any free port)."),
            click.option("--announce-ip", default=None,
                         help="Public IP to announce to other peers (needs a fixed --port), e.g. behind a port forward."),
            click.option("--identity-path", default=None, type=click.Path(dir_okay=False),
                         help="Private key file; created if missing. Keeps the same peer ID (and multiaddr) "
                              "across restarts."),
            click.option("--initial-peers", multiple=True, metavar="MULTIADDR",
                         help="Multiaddr of a swarm member, as printed by `p2p-diloco bootstrap` or a peer. "
                              "Repeat for several."),
            click.option("-v", "--verbose", is_flag=True, help="Debug logging."),
        ]
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2p-diloco")
def main():
    """Train a transformers language model with DiLoCo across peers that meet on a hivemind DHT.

    \b
    Host a swarm:    p2p-diloco bootstrap --port 31337 --identity-path bootstrap.key
    Join it:         p2p-diloco peer --config peers/demo.toml --initial-peers /ip4/.../p2p/...
    Try it offline:  p2p-diloco demo
    """


@main.command()
@_network_options(default_port=31337)
@click.option("--assist/--no-assist", default=True, show_default=True,
              help="Reduce for the peers of a run when every one of them is unreachable (behind NAT). Costs "
                   "bandwidth and memory: see docs/network.md.")
@click.option("--assist-max-params", default=50_000_000, show_default=True, type=click.IntRange(0),
              help="Assist runs whose averaged parameters add up to at most this many (an fp32 copy each).")
def bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose, assist, assist_max_params):
    """Host a DHT node that peers use to find each other.

    Prints every multiaddr it can be reached at, one per line: give one of them to peers as
    --initial-peers. Runs until Ctrl+C or SIGTERM, then stops its p2pd daemon too.
    """
    from p2p_diloco.node_runner import run_bootstrap

    sys.exit(run_bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose, assist, assist_max_params))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="Run config (TOML); every peer of a run must use the same file. See peers/.")
@_network_options(default_port=0)
@click.option("--metrics-file", default=None, type=click.Path(dir_okay=False),
              help="Append one JSON record per event (join, outer_step, state_loaded, exit) to this file.")
@click.option("--checkpoint-dir", default=None, type=click.Path(file_okay=False),
              help="Save a checkpoint here at every outer step and resume from it on restart "
                   "(overrides swarm.checkpoint_dir).")
@click.option("--max-outer-steps", default=None, type=click.IntRange(1),
              help="Exit cleanly once the global model has taken this many outer steps.")
@click.option("--device", default="auto", show_default=True,
              help="Torch device for the inner loop: auto (cuda if available), cpu, cuda, cuda:1, ...")
@click.option("--wait-for-peers", default=1, show_default=True, type=click.IntRange(1),
              help="Before training, wait until this many peers (this one included) are in the swarm, at "
                   "most swarm.start_wait_timeout seconds; for peers started together, so none trains alone.")
def peer(config_path, host, port, announce_ip, identity_path, initial_peers, verbose, metrics_file,
         checkpoint_dir, max_outer_steps, device, wait_for_peers):
    """Join a swarm and train with DiLoCo until stopped (Ctrl+C / SIGTERM leaves cleanly).

    At start-up the peer asks its initial peers to dial it back. If they cannot (NAT, firewall), it
    averages as a client, dialing every connection itself, and says so in one line with the flags
    that would make it reachable (docs/network.md).
    """
    from p2p_diloco.node_runner import run_peer

    sys.exit(run_peer(config_path, host, port, announce_ip, identity_path, initial_peers, verbose,
                      metrics_file, checkpoint_dir, max_outer_steps, device, wait_for_peers))


@main.command()
@click.option("--peers", "num_peers", default=3, show_default=True, type=click.IntRange(1, 16),
              help="Number of peer processes to start.")
@click.option("--outer-steps", default=16, show_default=True, type=click.IntRange(1),
              help="Outer steps to train for.")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Run config (default: peers/demo.toml).")
@click.option("--out", "out_dir", default="demo-out", show_default=True, type=click.Path(file_okay=False),
              help="Where summary.json, loss.png, metrics and logs are written.")
@click.option("--timeout", "timeout_s", default=1800, show_default=True, type=click.IntRange(10),
              help="Give up (and stop every process) after this many seconds.")
def demo(num_peers, outer_steps, config_path, out_dir, timeout_s):
    """Run a whole swarm on this machine, offline: a bootstrap node and N peer processes on 127.0.0.1.

    Trains the small model of peers/demo.toml on Python's own help texts (no download), then writes
    summary.json (per-peer results, held-out loss before and after) and loss.png to --out.
    """
    from p2p_diloco.demo import run_demo

    sys.exit(run_demo(num_peers, outer_steps, config_path, out_dir, timeout_s))


if __name__ == "__main__":
    main()
