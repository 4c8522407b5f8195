"""docker/, checked without a Docker engine: every command that an image or a compose service runs is a
valid `p2p-diloco` invocation, names only files that the image has (or that live in a volume), and the
compose files hang together."""

from __future__ import annotations

import fnmatch
import json
import posixpath
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
import yaml

from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.node import parse_initial_peers
from tests.cli_parse import subcommand_context

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
BASE_COMPOSE = DOCKER / "compose.yaml"
CPU_COMPOSE = DOCKER / "compose.cpu.yaml"


@dataclass
class Image:
    workdir: str = "/"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    copies: list[tuple[str, str]] = field(default_factory=list)  # (path in the image, path in the repo)
    volumes: list[str] = field(default_factory=list)


def read_dockerfile(path: Path) -> Image:
    image = Image()
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "WORKDIR":
            image.workdir = posixpath.join(image.workdir, rest.strip())
        elif instruction in ("ENTRYPOINT", "CMD"):
            # the shell form would run p2p-diloco under `sh -c`, which does not pass SIGTERM on
            assert rest.lstrip().startswith("["), f"{path.name}: {instruction} must be in exec form"
            setattr(image, instruction.lower(), json.loads(rest))
        elif instruction == "VOLUME":
            image.volumes += json.loads(rest) if rest.lstrip().startswith("[") else rest.split()
        elif instruction == "COPY":
            *sources, dest = [word for word in shlex.split(rest) if not word.startswith("--")]
            into_dir = dest.endswith("/") or len(sources) > 1
            dest = posixpath.normpath(posixpath.join(image.workdir, dest))
            for source in sources:
                image.copies.append((posixpath.join(dest, posixpath.basename(source)) if into_dir else dest, source))
    return image


IMAGES = {path.relative_to(REPO).as_posix(): read_dockerfile(path) for path in DOCKERFILES}


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: `!reset` deletes the attribute, `!override` replaces it."""


RESET = object()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_object(node, deep=True))


def merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if value is RESET:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_compose(*files: Path) -> dict:
    config: dict = {}
    for path in files:
        config = merge(config, yaml.load(path.read_text(), Loader=ComposeLoader))
    return config


COMPOSES = {"compose.yaml": load_compose(BASE_COMPOSE),
            "compose.yaml + compose.cpu.yaml": load_compose(BASE_COMPOSE, CPU_COMPOSE)}


@dataclass
class Invocation:
    where: str
    image: Image
    argv: list[str]  # entrypoint + command
    volumes: list[str]  # where volumes are mounted

    @property
    def args(self) -> list[str]:
        return self.argv[1:]


def service_dockerfile(service: dict) -> str:
    build = service["build"]
    return posixpath.normpath(posixpath.join("docker", build["context"], build["dockerfile"]))


def invocations() -> list[Invocation]:
    found = [Invocation(name, image, image.entrypoint + image.cmd, image.volumes) for name, image in IMAGES.items()]
    for compose_name, compose in COMPOSES.items():
        for name, service in compose["services"].items():
            image = IMAGES[service_dockerfile(service)]
            argv = service.get("entrypoint", image.entrypoint) + service.get("command", image.cmd)
            mounts = [volume.split(":")[1] for volume in service.get("volumes", [])]
            found.append(Invocation(f"{compose_name}: {name}", image, argv, image.volumes + mounts))
    return found


INVOCATIONS = invocations()


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda invocation: invocation.where)
def test_invocation_parses(invocation):
    # the entrypoint is the CLI, so that a service's command is just the CLI's arguments
    assert invocation.argv[0] == "p2p-diloco"
    subcommand_context(invocation.args)


@pytest.mark.parametrize("args", sorted({tuple(invocation.args) for invocation in INVOCATIONS}), ids=" ".join)
def test_invocation_help_runs(args):
    done = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout


def image_paths(invocation: Invocation) -> list[str]:
    """The paths inside the image that the invocation reads or writes."""
    ctx = subcommand_context(invocation.args)
    paths = [value for param in ctx.command.params
             if isinstance(param.type, click.Path) and (value := ctx.params.get(param.name)) is not None]
    manifest = ctx.params.get("manifest")
    if manifest is not None and "/" not in manifest:  # a shipped name, in peers/ beside the package: manifest.py
        package_dir = next(dest for dest, source in invocation.image.copies if source == "p2p_diloco")
        manifest = posixpath.join(posixpath.dirname(package_dir), "peers", f"{manifest.removesuffix('.toml')}.toml")
    paths += [manifest] if manifest is not None else []
    return [posixpath.join(invocation.image.workdir, path) for path in paths]


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` (relative to the repo) out of the build context: the last pattern
    that matches it or a folder above it decides; `**/` patterns match a name at any depth."""
    parts = path.split("/")
    ignored = False
    for pattern in (REPO / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated, pattern = pattern.startswith("!"), pattern.lstrip("!")
        if pattern.startswith("**/"):
            candidates, pattern = parts, pattern[3:]
        else:
            candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda invocation: invocation.where)
def test_paths_are_in_the_image(invocation):
    for path in image_paths(invocation):
        if any(path == volume or path.startswith(volume.rstrip("/") + "/") for volume in invocation.volumes):
            continue  # written at run time
        copied = [REPO / source / posixpath.relpath(path, dest) for dest, source in invocation.image.copies
                  if path == dest or path.startswith(dest + "/")]
        assert any(file.is_file() for file in copied), f"{invocation.where}: {path} is neither copied nor in a volume"
        repo_path = next(file for file in copied if file.is_file()).relative_to(REPO).as_posix()
        assert not dockerignored(repo_path), f"{invocation.where}: {repo_path} is left out by .dockerignore"


def test_copied_files_reach_the_build_context():
    for name, image in IMAGES.items():
        for _, source in image.copies:
            assert (REPO / source).exists() and not dockerignored(source), f"{name}: COPY {source}"


@pytest.mark.parametrize("compose_name", COMPOSES)
def test_compose_swarm_is_consistent(compose_name):
    compose = COMPOSES[compose_name]
    services = compose["services"]
    demo_peer_id = Identity.load_or_create(str(REPO / "bootstrap" / "demo-bootstrap.key")).peer_id
    bootstrap_ctx = subcommand_context(services["bootstrap"]["command"])
    assert bootstrap_ctx.params["identity_path"] == "/app/bootstrap/demo-bootstrap.key"
    port = bootstrap_ctx.params["port"]
    assert str(port) in " ".join(services["bootstrap"]["healthcheck"]["test"])  # it probes the node's port
    images: dict[str, str] = {}
    for name, service in services.items():
        assert (DOCKER / service["build"]["context"]).is_dir(), f"{name}: build context"
        assert (REPO / service_dockerfile(service)).is_file(), f"{name}: {service_dockerfile(service)}"
        # services that share an image tag must build it from the same Dockerfile, or they overwrite it
        assert images.setdefault(service["image"], service_dockerfile(service)) == service_dockerfile(service), name
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name}: volume {volume} is not declared"
        if name == "bootstrap":
            continue
        assert "bootstrap" in service["depends_on"], name
        peers = subcommand_context(service["command"]).params["initial_peers"]
        assert peers and parse_initial_peers(peers) == list(peers)
        assert all(maddr == f"/dns4/bootstrap/tcp/{port}/p2p/{demo_peer_id}" for maddr in peers), peers
    state_volumes = [service["volumes"][0] for name, service in services.items() if name != "bootstrap"]
    assert len(set(state_volumes)) == len(state_volumes), "two peers would share a state directory"
    gpu = {name: "deploy" in service for name, service in services.items() if name != "bootstrap"}
    assert all(gpu.values()) if compose_name == "compose.yaml" else not any(gpu.values()), gpu
