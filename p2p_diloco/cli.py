"""The `p2p-diloco` command: bootstrap a swarm, join it as a training peer, or run the offline demo.

Only argument parsing and wiring live here; the work is done in p2p_diloco.node_runner and
p2p_diloco.demo.
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from p2p_diloco.version import __version__
from p2p_diloco.metrics import EVENTS


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
            click.option("-v", "--verbose", is_flag=True, help="Debug logging (and hivemind's INFO lines)."),
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
    Try it offline:  p2p-diloco demo
    Join a run:      p2p-diloco join demo   (a run manifest, by path or shipped name: settings + bootstrap nodes)
    Start a run:     copy the template peers/llama-150m-c4.toml, fill in run.name and swarm.initial_peers, publish it
    See a swarm:     p2p-diloco status --initial-peers /ip4/.../p2p/...
    Host a swarm:    p2p-diloco bootstrap --port 31337 --identity-path bootstrap.key
    Any config:      p2p-diloco peer --config my-run.toml --initial-peers /ip4/.../p2p/...
    Bug report:      p2p-diloco env
    Export a model:  p2p-diloco export --checkpoint-dir ~/.local/share/p2p-diloco/demo/checkpoint --out demo-model
    """


def _page_options(host_flag: str, port_flag: str, refresh_flag: str, default_port: Optional[int]):
    """Where and how often the run's page is served (`status --serve`; `bootstrap --page-port`, off by default)."""
    port_help = ("TCP port of the run's page (0: any free port, logged)." if default_port is not None else
                 "Serve the run's page on this TCP port (0: any free port, logged); see `status --serve`.")
    options = [
        click.option(host_flag, "page_host", default="127.0.0.1", show_default=True,
                     help="Address the run's page listens on; another than 127.0.0.1 lets other machines read it "
                          "(the page is read-only)."),
        click.option(port_flag, "page_port", default=default_port, show_default=default_port is not None,
                     type=click.IntRange(0, 65535), help=port_help),
        click.option(refresh_flag, "refresh_s", default=10.0, show_default=True, type=click.FloatRange(0.5, 3600),
                     help="Seconds between two reads of the swarm for the run's page."),
    ]

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


@main.command()
@_network_options(default_port=31337)
@click.option("--assist/--no-assist", default=True, show_default=True,
              help="Reduce for the peers of a run when every one of them is unreachable (behind NAT). Costs "
                   "bandwidth and memory: see docs/network.md.")
@click.option("--assist-max-params", default=50_000_000, show_default=True, type=click.IntRange(0),
              help="Assist runs whose averaged parameters add up to at most this many (an fp32 copy each).")
@click.option("--keep", "keep", default=None, type=click.Path(exists=True, dir_okay=False), metavar="RUN.toml",
              help="Keep the state of this run for it: follow the run step by step, serve its latest agreed "
                   "state to joiners (also when all of its peers are gone), and write it to the run's "
                   "swarm.checkpoint_store every swarm.checkpoint_every outer steps. Holds the model on the CPU.")
@click.option("--keep-eval-sequences", default=None, type=click.IntRange(0),
              help="With --keep: evaluate the state it keeps on this many of the run's held-out sequences, every "
                   "eval.every outer steps of the run's config, for `status` and the run's page (default: the "
                   "config's eval.sequences; 0: never).")
@_page_options("--page-host", "--page-port", "--page-refresh", default_port=None)
def bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose, assist, assist_max_params, keep,
              keep_eval_sequences, page_host, page_port, refresh_s):
    """Host a DHT node that peers use to find each other.

    Prints every multiaddr it can be reached at, one per line: give one of them to peers as
    --initial-peers. Runs until Ctrl+C or SIGTERM, then stops its p2pd daemon too. With --page-port it
    also serves the page of the runs it sees (see `status --serve`).
    """
    from p2p_diloco.node_runner import BootstrapOptions, run_bootstrap

    page = None if page_port is None else (page_host, page_port, refresh_s)
    sys.exit(run_bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose,
                           BootstrapOptions(assist, assist_max_params, keep, keep_eval_sequences, page)))


def _training_options(fn):
    """Flags shared by `peer` and `join`: what a training peer writes, how long it runs, where it computes."""
    options = [
        click.option("--metrics-file", default=None, type=click.Path(dir_okay=False),
                     help=f"Append one JSON record per event to this file; the events: {', '.join(EVENTS)} "
                          f"(README.md, Metrics)."),
        click.option("--checkpoint-dir", default=None, type=click.Path(file_okay=False),
                     help="Save a checkpoint here at every outer step and resume from it on restart "
                          "(overrides swarm.checkpoint_dir)."),
        click.option("--max-outer-steps", default=None, type=click.IntRange(1),
                     help="Exit cleanly once the global model has taken this many outer steps."),
        click.option("--device", default="auto", show_default=True,
                     help="Torch device for the inner loop: auto (cuda if available), cpu, cuda, cuda:1, ..."),
        click.option("--wait-for-peers", default=1, show_default=True, type=click.IntRange(1),
                     help="Before training, wait until this many peers (this one included) are in the swarm, at "
                          "most swarm.start_wait_timeout seconds; for peers started together, so none trains alone."),
        click.option("--ignore-other-settings", is_flag=True,
                     help="Train even if the run's live peers publish other settings (a stranger's records can "
                          "claim so); peers on other settings never average with this one."),
        click.option("--tensorboard", default=None, type=click.Path(file_okay=False), metavar="DIR",
                     help="Also log the metrics' numbers as TensorBoard scalars in DIR "
                          "(needs: pip install 'p2p-diloco[tensorboard]')."),
        click.option("--wandb", default=None, metavar="PROJECT",
                     help="Also log the metrics' numbers to this Weights & Biases project, one wandb run per peer, "
                          "grouped by run.name (needs: pip install 'p2p-diloco[wandb]', and `wandb login`; "
                          "WANDB_MODE=offline logs to local files)."),
        # [compute]: each overrides the config's value when given
        click.option("--precision", default=None, type=click.Choice(["auto", "bf16", "fp32"]),
                     help="bf16 autocast or fp32 (overrides compute.precision; auto: bf16 on a GPU that supports it)."),
        click.option("--compile/--no-compile", default=None,
                     help="torch.compile the model; the first steps are slow (overrides compute.compile)."),
        click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None,
                     help="Recompute activations in the backward pass: far less memory, about a third more compute "
                          "(overrides compute.gradient_checkpointing)."),
        click.option("--micro-batch-size", default=None, type=click.IntRange(0), metavar="N",
                     help="Sequences per forward/backward pass, a divisor of inner.batch_size; 0: the largest that "
                          "fits the memory on a GPU or with --max-memory, else the whole batch (overrides "
                          "compute.micro_batch_size)."),
        click.option("--max-memory", "max_memory_gib", default=None, type=click.FloatRange(0), metavar="GIB",
                     help="GiB of device memory this peer may use (on a GPU, also a cap on torch's allocator); "
                          "0: on a GPU, what is free at start-up; on a CPU, no limit (overrides "
                          "compute.max_memory_gib)."),
        click.option("--shard/--no-shard", default=None,
                     help="Under torchrun: shard the model over the ranks with FSDP2, for a model larger than one "
                          "device; else each rank holds the whole model (DDP) (overrides compute.shard)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _peer_options(**values):
    from p2p_diloco.node_runner import PeerOptions

    return PeerOptions(**values)


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="Run config (TOML); every peer of a run must use the same file. See peers/.")
@_network_options(default_port=0)
@_training_options
def peer(config_path, **options):
    """Join a swarm and train with DiLoCo until stopped (Ctrl+C / SIGTERM leaves cleanly).

    Bootstrap addresses come from --initial-peers, or else from the config's swarm.initial_peers. At
    start-up the peer asks its initial peers to dial it back. If they cannot (NAT, firewall), it
    averages as a client, dialing every connection itself, and says so in one line with the flags
    that would make it reachable (docs/network.md). It exits with status 4 when the run's peers
    train with other settings (it names the ones that differ): it could never average with them
    (--ignore-other-settings trains anyway). It exits with status 5 when the run is ahead of it and
    no peer, keeper or checkpoint store (swarm.checkpoint_store) serves the run's state within
    swarm.state_wait_timeout: it never trains from outer step 0 under the name of a run that has a
    history.

    On a terminal, a progress bar shows the inner steps toward the next sync; otherwise a log line
    every 30 s does.

    \b
    One peer on several GPUs or machines (an island: docs/design.md):
      torchrun --nproc-per-node 8 $(which p2p-diloco) peer --config run.toml
    Rank 0 is the peer in the swarm; each rank trains on its own part of the peer's data, data-parallel
    (DDP), or sharded with --shard (FSDP2). If any rank fails, the peer leaves the swarm and torchrun
    stops every rank; restarted, it resumes from its checkpoint. A failed collective between ranks
    exits with status 6.
    """
    from p2p_diloco.node_runner import run_peer

    sys.exit(run_peer(config_path, _peer_options(**options)))


@main.command()
@click.argument("manifest")
@click.option("--state-dir", default=None, type=click.Path(file_okay=False),
              help="Where this peer keeps its identity key, checkpoint and metrics, so that a restart continues "
                   "(default: ~/.local/share/p2p-diloco/<run name>). Two peers on one machine need two.")
@_network_options(default_port=0)
@_training_options
def join(manifest, state_dir, **options):
    """Join the public run described by MANIFEST and train until stopped.

    MANIFEST is a run file (a path), or the name of one shipped in peers/ (`demo` or `demo.toml`):
    the run's settings, its name on the DHT and its bootstrap addresses (swarm.initial_peers;
    --initial-peers replaces them). Run it again with the same --state-dir to continue where the peer stopped.

    \b
    Try it on one machine (the demo run's bootstrap node listens on 127.0.0.1:31337):
      p2p-diloco bootstrap --host 127.0.0.1 --port 31337 --identity-path bootstrap/demo-bootstrap.key
      p2p-diloco join demo --host 127.0.0.1
      p2p-diloco join demo --host 127.0.0.1 --state-dir /tmp/second-peer

    \b
    One peer on all the GPUs of a machine (see `peer --help`):
      torchrun --nproc-per-node 8 $(which p2p-diloco) join MANIFEST
    """
    from p2p_diloco.node_runner import run_join

    sys.exit(run_join(manifest, state_dir, _peer_options(**options)))


@main.command()
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR", required=True,
              help="Multiaddr of a swarm member (a bootstrap node). Repeat for several.")
@click.option("--run", "run_name", default=None, help="Only this run (its run.name); default: every run found.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--serve", is_flag=True, help="Serve the run's page over HTTP instead of printing once.")
@_page_options("--host", "--port", "--refresh", default_port=8080)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def status(initial_peers, run_name, as_json, serve, page_host, page_port, refresh_s, verbose):
    """Show the peers of a swarm: outer step, phase, throughput, loss, reachability, device, version.

    Reads the status records the peers publish on the DHT (signed; a malformed one is skipped with a
    warning) and asks each peer that others can dial whether it answers now. Starts a DHT client that
    stores nothing and leaves when done.

    With --serve it stays, reads the swarm every --refresh seconds and serves the run's page until
    Ctrl+C: the peers, their contribution, and plots of loss, held-out loss, group size, bytes and
    utilization over outer steps, at http://127.0.0.1:8080/ (the same as JSON at /api/status).

    \b
    Example:
      p2p-diloco status --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... --serve --port 8080
    """
    from p2p_diloco.status_command import run_status, serve_status

    if serve:
        sys.exit(serve_status(initial_peers, run_name, page_host, page_port, refresh_s, verbose))
    sys.exit(run_status(initial_peers, run_name, as_json, verbose))


@main.command()
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR",
              help="Also check whether the swarm can dial this machine back, asking this swarm member (a bootstrap "
                   "node). Repeat for several.")
@click.option("--host", default="0.0.0.0", show_default=True, help="With --initial-peers: address to listen on.")
@click.option("--port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="With --initial-peers: the TCP port to check (a peer's --port; 0 = any free port).")
@click.option("--announce-ip", default=None, help="With --initial-peers: the public IP a peer here would announce.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def env(initial_peers, host, port, announce_ip, as_json):
    """Print this machine's setup for a bug report: versions, OS, CPU cores, RAM, GPUs, reachability.

    Versions of p2p-diloco, Python, torch (and its CUDA), hivemind, transformers, bitsandbytes and
    datasets. With --initial-peers it also runs the dial-back check a peer runs at start-up: whether
    the swarm can dial this machine (else it would average as a client; docs/network.md).
    """
    from p2p_diloco.env_report import run_env

    sys.exit(run_env(initial_peers, host, port, announce_ip, as_json))


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


@main.command()
@click.option("--checkpoint-dir", required=True, type=click.Path(file_okay=False),
              help="A peer's checkpoint directory: its --checkpoint-dir, or for a joined peer <state dir>/checkpoint "
                   "(by default ~/.local/share/p2p-diloco/<run name>/checkpoint).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder to write the model to; created if missing.")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Build the model and tokenizer from this run config instead of what the peer saved beside its "
                   "checkpoint (for a checkpoint written before peers saved them). It must be the run's: a "
                   "checkpoint trained with other settings is refused.")
@click.option("--force", is_flag=True, help="Write into --out even if it is not empty (files of the same names "
                                            "are replaced).")
@click.option("--push-to-hub", "push_to_hub", default=None, metavar="REPO",
              help="Then upload the folder to this Hugging Face model repo (NAME or ORG/NAME; created if missing) "
                   "with the token of `hf auth login` or HF_TOKEN.")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private (an existing repo keeps "
                                              "its visibility).")
def export(checkpoint_dir, out_dir, config_path, force, push_to_hub, private):
    """Write the global model θ_global of a peer's checkpoint as a transformers model folder.

    The folder holds the model (save_pretrained: config.json, model.safetensors), the run's tokenizer
    and p2p_diloco_export.json (run name, outer step and sha256 of the global state it came from).
    Load it with AutoModelForCausalLM.from_pretrained(FOLDER) and AutoTokenizer.from_pretrained(FOLDER).
    The model's config and tokenizer come from the model/ folder a peer writes beside its checkpoint at
    start-up, or from --config. Works while the peer runs: checkpoints are replaced whole. With
    --push-to-hub REPO the folder is then uploaded to that Hugging Face model repo.

    \b
    Examples:
      p2p-diloco export --checkpoint-dir ~/.local/share/p2p-diloco/demo/checkpoint --out demo-model
      p2p-diloco export --checkpoint-dir demo-out/peer-0 --out demo-model
      p2p-diloco export --checkpoint-dir demo-out/peer-0 --out demo-model --push-to-hub my-org/demo-model
    """
    from p2p_diloco.export import run_export

    sys.exit(run_export(checkpoint_dir, out_dir, config_path, force, push_to_hub, private))


if __name__ == "__main__":
    main()
