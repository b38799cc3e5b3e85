"""The operator documentation cannot drift from the code, the manifests or itself.

- Generated parts (the option table, the PrometheusRule) match a fresh generation.
- Links between the documents resolve, anchors included; paths and commands they name exist.
- The migration tables name only gpuagent flags and environment variables that exist, and cover
  every flag of NVIDIA's device plugin and dcgm-exporter listed in the project's reference notes.
- Metric names, sizing figures and the README's set-up commands match what is shipped.
- The architecture page names modules, names in them and flags that exist, and every room.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest
import yaml
from dra.test_dra_flow import FAST_DRA, Dirs
from dra.test_dra_flow import NODE as DRA_NODE
from e2e.agentrun import RunningAgent, running_agent
from support.clock import Sleeps
from support.fake_apiserver import FakeApiServer
from support.fake_kubelet import FakeKubelet
from support.grpcstubs import StubModules
from support.metricsdoc import label_drift
from support.waiting import eventually

from gpuagent.app import agent
from gpuagent.config import FILE_KEYS, OPTIONS, load_settings
from gpuagent.config.cli import build_parser
from gpuagent.config.planning import make_plan
from gpuagent.gpu.sim import SimDriver, node_from_count
from gpuagent.gpu.sim.spec import SimLatency

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The documents this suite owns (docs/metrics.md has its own tests).
OWNED = [
    ROOT / "README.md",
    DOCS / "install.md",
    DOCS / "configuration.md",
    DOCS / "migration.md",
    DOCS / "sharing.md",
    DOCS / "troubleshooting.md",
    DOCS / "verify.md",
    DOCS / "rollback.md",
    DOCS / "uninstall.md",
    DOCS / "versions.md",
    DOCS / "architecture.md",
]
REFERENCE = ROOT.parent / "shared" / "reference"

FLAGS = {spelling for opt in OPTIONS for spelling in (f"--{opt.name}", *opt.aliases)}
ENV_NAMES = {name for opt in OPTIONS for name in opt.env_names}


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", read(path), flags=re.DOTALL)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def prose(path: Path) -> str:
    """The document without fenced code blocks."""
    return re.sub(r"```.*?```", "", read(path), flags=re.DOTALL)


def test_generated_files_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_files.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr + "\n(run scripts/gen-files and commit)"


def test_option_table_lists_every_option_once() -> None:
    table = read(DOCS / "configuration.md").split("<!-- BEGIN GENERATED")[1]
    for opt in OPTIONS:
        assert table.count(f"`--{opt.name} ") + table.count(f"`--{opt.name}[") == 1, opt.name
    # The command line's own flags too (--version, --help): every flag the parser takes.
    for spelling in (s for a in build_parser()._actions for s in a.option_strings):
        assert f"`{spelling}`" in table or f"`{spelling} " in table or f"`{spelling}[" in table


@pytest.mark.parametrize("doc", [*OWNED, DOCS / "metrics.md", DOCS / "dra.md", DOCS / "health.md"],
                         ids=lambda p: p.name)  # fmt: skip
def test_every_table_row_has_its_header_s_cells(doc: Path) -> None:
    """A ``|`` inside a cell must be escaped (``\\|``), or the row gains a column and breaks."""
    for table in _tables(doc):
        header, *rows = table
        for row in rows:
            assert len(row) == len(header), f"{doc.name}: {row[0]} has {len(row)} cells"


@pytest.mark.parametrize("doc", OWNED, ids=lambda p: p.name)
def test_links_resolve(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        assert path.exists(), f"{doc.name}: link to missing {target}"
        if anchor:
            assert path.suffix == ".md", target
            assert anchor in anchors(path), f"{doc.name}: no heading for #{anchor} in {path.name}"


@pytest.mark.parametrize("doc", OWNED, ids=lambda p: p.name)
def test_named_paths_and_overlays_exist(doc: Path) -> None:
    text = read(doc)
    for token in re.findall(r"`((?:manifests|deploy|docs|scripts|tests)/[\w./-]*)`", text):
        assert (ROOT / token).exists(), f"{doc.name} names {token}, which does not exist"
    for target in re.findall(r"kubectl apply -k (manifests/[\w/-]+)", text):
        assert (ROOT / target / "kustomization.yaml").exists(), f"{doc.name}: {target}"


@pytest.mark.parametrize("doc", OWNED, ids=lambda p: p.name)
def test_named_agent_metrics_exist(doc: Path) -> None:
    source = "\n".join(read(p) for p in (ROOT / "gpuagent").rglob("*.py"))
    # The architecture page's recipes declare a throwaway family in code (tests/test_recipes.py
    # walks it); its prose names only what exists.
    text = prose(doc) if doc == DOCS / "architecture.md" else read(doc)
    for name in set(re.findall(r"\bgpuagent_[a-z_]+[a-z]\b", text)):
        assert name in source, f"{doc.name} names metric {name}, which the agent does not export"


def test_the_architecture_page_names_what_exists() -> None:
    """docs/architecture.md's paths (from the repository or from gpuagent/), dotted names
    (``state.store.Keyed``, ``support.waiting.eventually``: a module and a name defined in it) and
    flags exist; every package and top-level module of gpuagent has its place on the page."""
    text = read(DOCS / "architecture.md")
    tokens = set(re.findall(r"`([^`\n]+)`", text))
    for token in tokens:
        if token.startswith("--"):
            assert token in FLAGS | {"--help", "--version"}, f"architecture.md: no flag {token}"
        elif re.fullmatch(r"[\w.-]+/[\w./-]*", token) and not token.startswith(".."):
            found = [p for p in (ROOT / token, ROOT / "gpuagent" / token) if p.exists()]
            assert found, f"architecture.md names {token}, which does not exist"
        elif re.fullmatch(r"[A-Za-z_0-9]+(\.[A-Za-z_0-9]+)+(\(.*\))?", token):
            dotted = token.split("(")[0]
            if not dotted.endswith((".py", ".md", ".toml")):
                assert _defined(dotted), f"architecture.md names {dotted}, which is not defined"
    for child in sorted((ROOT / "gpuagent").iterdir()):
        if child.name.startswith("__pycache__") or child.name == "__init__.py":
            continue
        if child.is_dir() and (child / "__init__.py").exists():
            assert f"`gpuagent/{child.name}/`" in text, f"architecture.md: no room for {child.name}"
        elif child.suffix == ".py":
            assert f"`gpuagent/{child.name}`" in text, f"architecture.md: no word on {child.name}"


def _defined(dotted: str) -> bool:
    """Whether ``a.b.name`` names a module (under gpuagent/ or tests/) and a name it defines (a
    function, class or assignment, at any depth: ``a.b.Class.method`` checks ``Class``), or
    ``Class.method`` a class of gpuagent's with that method in its module."""
    parts = dotted.split(".")
    if parts[0][:1].isupper():
        cls, method = parts[0], parts[1]
        return any(
            re.search(rf"^class {cls}\b", code := read(path), re.MULTILINE)
            and re.search(rf"^\s+(?:async\s+)?def {method}\b", code, re.MULTILINE)
            for path in (ROOT / "gpuagent").rglob("*.py")
        )
    for cut in range(len(parts) - 1, 0, -1):
        for base in (ROOT / "gpuagent", ROOT / "tests"):
            path = base.joinpath(*parts[:cut]).with_suffix(".py")
            if path.exists():
                name = parts[cut]
                pattern = rf"^\s*(?:(?:async\s+)?def|class)\s+{name}\b|^\s*{name}\s*[:=]"
                return re.search(pattern, read(path), re.MULTILINE) is not None
    return False


def test_nvidia_environment_names_are_listed_in_one_place() -> None:
    """The option table names every alias beside its option; prose elsewhere links to it rather
    than keep a list of its own (three lists had drifted apart)."""
    aliases = {name for opt in OPTIONS for name in opt.env_aliases}
    for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = prose(doc).split("<!-- BEGIN GENERATED")[0]
        for paragraph in re.split(r"\n\s*\n", text):
            lines = [line for line in paragraph.splitlines() if not line.startswith("|")]
            named = aliases & set(re.findall(r"`([A-Z][A-Z0-9_]+)`", "\n".join(lines)))
            assert len(named) < 3, f"{doc.name} lists aliases {sorted(named)}: link to the table"


def test_readme_keeps_its_two_setup_commands() -> None:
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", read(ROOT / "README.md"), re.DOTALL))
    lines = [line.strip() for line in blocks.splitlines()]
    assert any(
        line.startswith(
            "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/gpuagent --simulate 8 "
        )
        for line in lines
    )
    assert "scripts/test" in lines


def _tables(path: Path) -> list[list[list[str]]]:
    """Every Markdown table in the document, as rows of cells (header row first)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in read(path).splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r"-+", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def test_migration_tables_name_only_real_gpuagent_settings() -> None:
    tables = [t for t in _tables(DOCS / "migration.md") if t[0][-1] == "gpuagent"]
    assert len(tables) == 3
    for table in tables:
        config_table = table[0][0] == "NVIDIA config key"
        for row in table[1:]:
            ours = row[-1]
            for token in re.findall(r"`([^`]+)`", ours):
                if token.startswith("--"):
                    assert token in FLAGS, f"migration.md: no flag {token} ({row[0]})"
                elif re.fullmatch(r"[A-Z][A-Z0-9_]+", token):
                    assert token in ENV_NAMES, f"migration.md: no env name {token} ({row[0]})"
                elif config_table and re.fullmatch(r"[a-z][a-z-]+", token):
                    assert token in FILE_KEYS, f"migration.md: no config key {token}"
            if "same env name" in ours:
                for env in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[1]):
                    assert env in ENV_NAMES, f"migration.md: {env} is not accepted"


def _reference_section(name: str, start: str, end: str) -> str:
    path = REFERENCE / name
    if not path.exists():
        pytest.skip(f"the project's reference notes are not beside the repository ({path})")
    text = read(path)
    return text[text.index(start) : text.index(end, text.index(start))]


@pytest.mark.parametrize(
    ("name", "start", "end"),
    [
        pytest.param("deviceplugin-api.md", "### 3.2 ", "### 3.3 ", id="nvidia-device-plugin"),
        pytest.param("metrics.md", "## 5. ", "## 6. ", id="dcgm-exporter"),
    ],
)
def test_migration_covers_every_flag_they_have(name: str, start: str, end: str) -> None:
    section = _reference_section(name, start, end)
    migration = read(DOCS / "migration.md")
    theirs: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| Flag"):
            first = line.split("|")[1]
            theirs.update(re.findall(r"--[a-z][\w-]*", first))
            theirs.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[2]))
    assert theirs
    missing = sorted(t for t in theirs if f"`{t}`" not in migration)
    assert not missing, f"migration.md does not map {missing}"


def test_sizing_in_the_docs_is_the_manifests() -> None:
    daemonset = yaml.safe_load(read(ROOT / "manifests" / "base" / "daemonset.yaml"))
    resources = daemonset["spec"]["template"]["spec"]["containers"][0]["resources"]
    install = read(DOCS / "install.md")
    requests, limits = resources["requests"], resources["limits"]
    expected = (
        f"requests `cpu: {requests['cpu']}`, `memory: {requests['memory']}`; "
        f"limit `memory: {limits['memory']}`"
    )
    assert expected in " ".join(install.split()), expected


def _example_configs() -> list[tuple[str, str]]:
    """Every agent config the project ships or shows: overlay and deploy files, doc snippets."""
    found = [
        (str(p.relative_to(ROOT)), read(p))
        for p in [
            *sorted((ROOT / "manifests").glob("**/config.yaml")),
            *sorted((ROOT / "deploy").glob("**/config.yaml")),
        ]
    ]
    for doc in sorted(DOCS.glob("*.md")):
        for n, block in enumerate(re.findall(r"```yaml\n(.*?)```", read(doc), re.DOTALL)):
            loaded = yaml.safe_load(block)
            # Agent configs only: not Kubernetes objects, not simulated nodes.
            if isinstance(loaded, dict) and loaded.get("version") == "v1" and "gpus" not in loaded:
                found.append((f"{doc.name} yaml block {n}", block))
    return found


@pytest.mark.parametrize(
    ("where", "text"), [pytest.param(w, t, id=w) for w, t in _example_configs()]
)
def test_every_example_config_loads(where: str, text: str, tmp_path: Path) -> None:
    """``gpuagent --check-config FILE`` accepts it: parsed and validated, exit code 0 (not 2)."""
    config = tmp_path / "config.yaml"
    config.write_text(text, encoding="utf-8")
    effective = check_config(config)
    make_plan(load_settings(["--config", str(config)], {}), control_nodes=())
    assert effective["config_file"] == str(config)


def check_config(config: Path, *args: str) -> dict[str, object]:
    """Run ``gpuagent [args] --check-config config``; its effective settings (exit code 0)."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuagent", *args, "--check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = json.loads(result.stdout)
    assert isinstance(loaded, dict)
    return loaded


def _off_kubernetes_command_lines() -> list[tuple[str, list[str]]]:
    """The agent's arguments in install.md's container recipes and the standalone drop-in."""
    found = []
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", read(DOCS / "install.md"), re.DOTALL))
    for command in blocks.replace("\\\n", " ").splitlines():
        words = command.split()
        if words[:2] in (["docker", "run"], ["podman", "run"]) and IMAGE in words:
            found.append((" ".join(words[:2]), words[words.index(IMAGE) + 1 :]))
    dropin = ROOT / "deploy" / "systemd" / "standalone" / "gpuagent.service.d" / "standalone.conf"
    (exec_start,) = [v for v in re.findall(r"^ExecStart=(.*)$", read(dropin), re.M) if v]
    argv = exec_start.split()
    assert argv[0] == "/usr/local/bin/gpuagent"
    found.append(("systemd drop-in", argv[1:]))
    return found


IMAGE = "ghcr.io/gpuagent/gpuagent"


def test_off_kubernetes_recipes_are_valid(tmp_path: Path) -> None:
    """Docker, podman and systemd without Kubernetes: the documented command lines are valid and
    switch Kubernetes off."""
    recipes = _off_kubernetes_command_lines()
    assert [name for name, _ in recipes] == ["docker run", "podman run", "systemd drop-in"]
    standalone = ROOT / "deploy" / "systemd" / "standalone" / "config.yaml"
    for name, argv in recipes:
        # The config file is the standalone one, checked with them.
        args = [a for a in argv if a not in ("--config", "/etc/gpuagent/config.yaml")]
        effective = check_config(standalone, *args)
        assert effective["kubernetes"] is False, name
    assert check_config(standalone)["node_labels"] is False


def test_the_example_configs_are_found() -> None:
    where = {w for w, _ in _example_configs()}
    assert {
        "manifests/base/config.yaml",
        "manifests/overlays/time-slicing/config.yaml",
        "manifests/overlays/cdi/config.yaml",
        "deploy/systemd/config.yaml",
    } <= where
    assert any(w.startswith("configuration.md") for w in where)


# ----- what the docs quote the agent answering ---------------------------------------------------
LOGGED = re.compile(r"\blog says `([^`]+)`|\blogs `([^`]+)`|`([^`]+)` in the log")


def test_quoted_log_lines_are_what_the_agent_logs() -> None:
    """A log event the docs tell operators to look for is one the agent's code writes (``…``
    stands for what varies)."""
    source = "\n".join(read(p) for p in (ROOT / "gpuagent").rglob("*.py"))
    quotes = {
        next(q for q in match.groups() if q): doc.name
        for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
        for match in LOGGED.finditer(" ".join(prose(doc).split()))
    }
    assert "waiting for the kubelet socket" in quotes  # the parser finds them
    missing = {
        quote: where
        for quote, where in quotes.items()
        if not all(part.strip() in source for part in quote.split("…"))
    }
    assert missing == {}


SAYS = re.compile(r"`/readyz` (?:\(503\) )?(?:says|answers|names it)[^`]{0,40}`([^`]+)`")
IN_PARENTHESES = re.compile(r"`/readyz` \((?:503, )?`([^`]+)`")


def quoted_readyz_answers() -> dict[str, str]:
    """Each ``/readyz`` answer the documents quote (``… says `X```, ``(503, `X`)``, the
    troubleshooting table), by where it is quoted."""
    found: dict[str, str] = {}
    for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = " ".join(prose(doc).split())
        for quote in [*SAYS.findall(text), *IN_PARENTHESES.findall(text)]:
            found[quote] = doc.name
        for table in _tables(doc):
            if table[0][0].startswith("`/readyz`"):
                for row in table[1:]:
                    found[row[0].strip("`")] = f"{doc.name} table"
    return found


def answer_pattern(quote: str) -> re.Pattern[str]:
    """A quoted answer as a pattern for real ones: ``…`` stands for anything, a number for any
    number (the docs' example GPU, seconds, error code)."""
    parts = re.split(r"(…|\d+(?:\.\d+)?)", quote)
    pattern = "".join(
        ".*" if part == "…" else r"\d+(?:\.\d+)?" if re.fullmatch(r"[\d.]+", part)
        else re.escape(part)
        for part in parts
    )  # fmt: skip
    return re.compile(pattern + ("" if quote.endswith("…") else r"\n?\Z|" + pattern + ": "))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_quoted_probe_answers_are_what_the_agent_answers(
    short_tmp_path: Path, grpc_stubs: StubModules, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent is run into each state the docs quote /readyz about, and every quote must match
    an answer it really gave (and /metrics' labels, scraped there, the metrics reference)."""
    answers: list[str] = []
    scrapes: list[str] = []

    async def look(run: RunningAgent, status: int = 503) -> None:
        code, body = await run.get("/readyz")
        assert code == status, body
        answers.append(body)
        scrapes.append((await run.get("/metrics"))[1])

    sockets = short_tmp_path / "dp"
    # Not registered, then registered: ready.
    async with running_agent(sockets, ("--simulate", "2")) as run:
        await eventually(lambda: "not registered" in (run.agent.readiness() or ""), what="503")
        await look(run)
        with FakeKubelet(sockets, grpc_stubs):
            await run.ready()
            await look(run, 200)
            assert (await run.get("/healthz")) == (200, "ok\n")

    # The driver does not answer (fail-on-init-error: false serves probes meanwhile).
    unloadable = SimDriver(node_from_count(1))
    unloadable.fail("nvmlInitWithFlags", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    async with running_agent(sockets, ("--fail-on-init-error=false",), simulator=unloadable) as run:
        await look(run)

    # Discovery held in a driver call (the rest starts without waiting the usual 2 s for it).
    monkeypatch.setattr(agent, "REGISTER_FIRST_SECONDS", 0.05)
    sleeps = Sleeps(hold=0.05)
    held = replace(node_from_count(1), latency=SimLatency(0.0, {"nvmlDeviceGetName": 0.05}))
    try:
        async with running_agent(sockets, simulator=SimDriver(held, sleep=sleeps)) as run:
            await eventually(lambda: "in nvmlDevice" in (run.agent.readiness() or ""), what="call")
            await look(run)
            sleeps.release()
    finally:
        sleeps.release()

    # The CDI spec cannot be written.
    blocked = short_tmp_path / "not-a-dir"
    blocked.write_text("")
    cdi = ("--simulate", "1", "--device-list-strategy", "cdi-cri", "--cdi-spec-dir", str(blocked))
    with FakeKubelet(sockets, grpc_stubs):
        async with running_agent(sockets, cdi) as run:
            await eventually(lambda: "CDI" in (run.agent.readiness() or ""), what="CDI reason")
            await look(run)

    # DRA: the API server down from the start, then up, then down again.
    apiserver = FakeApiServer(node=DRA_NODE, port=0)
    await apiserver.start()
    await apiserver.stop()  # its port stays in the kubeconfig
    dirs = Dirs(short_tmp_path / "dra")
    dirs.root.mkdir()
    options = {"node_name": DRA_NODE, "dra_options": FAST_DRA}
    with FakeKubelet(sockets, grpc_stubs):
        async with running_agent(sockets, dirs.args(apiserver), agent_options=options) as run:
            dra = run.dra
            await eventually(lambda: (run.agent.readiness() or "").startswith("DRA"), what="DRA")
            await look(run)
            await apiserver.start()
            await eventually(lambda: dra.publisher.up, what="the slices published")
            await apiserver.stop()
            await run.fault({"gpu": 2, "fault": "xid", "xid": 79})  # a change to publish
            await eventually(lambda: not dra.publisher.up, what="the next failure")
            await look(run)
            scrapes.append((await run.get("/metrics"))[1])

    quotes = quoted_readyz_answers()
    assert "not registered with the kubelet: …" in quotes  # the parser finds them
    unmatched = {
        quote: where
        for quote, where in quotes.items()
        if not any(answer_pattern(quote).match(answer) for answer in answers)
    }
    assert unmatched == {}, f"quoted but never answered; the agent answered: {answers}"
    for text in scrapes:
        assert label_drift(text, complete=False) == []
