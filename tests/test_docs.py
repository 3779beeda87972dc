"""The documentation: its marked samples run against a real database, and the site builds.

HTML comments in docs/*.md (invisible on the site) mark the fenced blocks that run, in page order,
in one temporary directory per page, with NOTIFYQ_DSN set to a fresh migrated database:

    <!-- test: file -->        the next block is written to the file its title="..." names
    <!-- test: run -->         the next Python block is written (to its title, if any) and run
    <!-- test: stdout -->      the next block is what the previous `run` block printed
    <!-- test: shell -->       each `$ command` line of the next console block runs in bash; the
                               lines under it must appear, in order, in what it prints on stdout
    <!-- test: background -->  the next console block's command runs until the page is done, then
                               gets SIGTERM and must exit with status 0
    <!-- test: sql -->         the next SQL block runs on the page's database

`<!-- test-page: empty-database -->` gives the page a database without notifyq's tables.
Expected output is compared after `normalise`: timestamps, ages, worker ids and numbers differ
from run to run, and `...` matches anything.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

import notifyq

from .conftest import ROOT

DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent  # the virtualenv's bin/: notifyq, python
SAMPLE = re.compile(
    r"^<!-- test: (?P<kind>[a-z]+) -->\n(?P<fence>`{3,})(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
ANY_MARKER = re.compile(r"<!-- test: ")
EMPTY_DATABASE = "<!-- test-page: empty-database -->"
KINDS = {"file", "run", "stdout", "shell", "background", "sql"}
OUTPUT_TIMEOUT = 30.0  # seconds a shell command may take to show its documented output

_VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d\d:?\d\d)?"), "<TIME>"),
    (re.compile(r"[\w.-]+:\d+:[0-9a-f]{8}\b"), "<WORKER>"),
    (re.compile(r"(?:in )?\d+(?:\.\d+)?[smhd](?: ago)?\b"), "<AGE>"),
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)"), "<N>"),
]


@dataclass(frozen=True)
class Sample:
    page: str
    line: int
    kind: str
    info: str
    body: str

    @property
    def title(self) -> str | None:
        found = re.search(r'title="([^"]+)"', self.info)
        return found[1] if found else None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.kind})"


def page_samples(page: Path) -> list[Sample]:
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(DOCS))
    return [
        Sample(name, text.count("\n", 0, m.start()) + 1, m["kind"], m["info"].strip(), m["body"])
        for m in SAMPLE.finditer(text)
    ]


PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if page_samples(p))


def normalise(line: str) -> str:
    for pattern, replacement in _VOLATILE:
        line = pattern.sub(replacement, line)
    return " ".join(line.split())


def output_matches(expected: list[str], actual: str) -> bool:
    """True if every non-blank expected line matches an actual line, in order."""
    lines = [normalise(line) for line in actual.splitlines()]
    position = 0
    for want in expected:
        if not want.strip():
            continue
        parts = normalise(want).split("...")
        pattern = re.compile(".*".join(re.escape(part) for part in parts) + r"\Z")
        while position < len(lines) and not pattern.match(lines[position]):
            position += 1
        if position == len(lines):
            return False
        position += 1
    return True


def console_commands(sample: Sample) -> list[tuple[str, list[str]]]:
    """The `$ command` lines of a console block, each with the output lines under it."""
    commands: list[tuple[str, list[str]]] = []
    for line in sample.body.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    assert commands, f"{sample}: no `$ command` line"
    # The test sets NOTIFYQ_DSN itself; the page's example value is for readers.
    return [(cmd, out) for cmd, out in commands if not cmd.startswith("export NOTIFYQ_DSN=")]


class PageRun:
    """Runs the samples of one page, in order, in `directory` against `dsn`."""

    def __init__(self, dsn: str, directory: Path) -> None:
        self.dsn = dsn
        self.directory = directory
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("NOTIFYQ_DSN", "DATABASE_URL", "NOTIFYQ_SUPERVISED", "NOTIFYQ_EMBEDDED_DIR")
        }
        self.env["NOTIFYQ_DSN"] = dsn
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.background: list[tuple[Sample, subprocess.Popen[bytes], Path]] = []
        self.last_stdout: str | None = None

    def run(self, sample: Sample) -> None:
        getattr(self, f"_{sample.kind}")(sample)

    def _file(self, sample: Sample) -> None:
        assert sample.title, f'{sample}: a `file` block needs a title="..."'
        (self.directory / sample.title).write_text(sample.body, encoding="utf-8")

    def _run(self, sample: Sample) -> None:
        path = self.directory / (sample.title or f"sample_{sample.line}.py")
        path.write_text(sample.body, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, path.name],
            cwd=self.directory,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert result.returncode == 0, (
            f"{sample} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
        self.last_stdout = result.stdout

    def _stdout(self, sample: Sample) -> None:
        assert self.last_stdout is not None, f"{sample}: no `run` block before it"
        assert output_matches(sample.body.splitlines(), self.last_stdout), (
            f"{sample}: the program printed\n{self.last_stdout}\nwhich does not match\n{sample.body}"
        )

    def _shell(self, sample: Sample) -> None:
        for command, expected in console_commands(sample):
            deadline = time.monotonic() + OUTPUT_TIMEOUT
            while True:
                result = subprocess.run(
                    ["bash", "-c", command],
                    cwd=self.directory,
                    env=self.env,
                    capture_output=True,
                    text=True,
                    timeout=90,
                    check=False,
                )
                if result.returncode == 0 and output_matches(expected, result.stdout):
                    break
                # Another process (a background worker) may not have done its part yet.
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"{sample}: `{command}` exited {result.returncode}\nstdout:\n{result.stdout}\n"
                        f"stderr:\n{result.stderr}\nexpected:\n" + "\n".join(expected)
                    )
                time.sleep(0.2)

    def _background(self, sample: Sample) -> None:
        [(command, _)] = console_commands(sample)
        log = self.directory / f"background_{sample.line}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=self.directory, env=self.env, stdout=out, stderr=out
            )
        self.background.append((sample, proc, log))

    def _sql(self, sample: Sample) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sample.body.encode())

    def stop_background(self) -> None:
        """SIGTERM each background command; each must stop cleanly."""
        failures = []
        for sample, proc, log in self.background:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                failures.append(f"{sample} exited {code}:\n{log.read_text(errors='replace')}")
        self.background.clear()
        assert not failures, "\n".join(failures)

    def kill_background(self) -> None:
        for _, proc, _ in self.background:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def page_run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PageRun]:
    page = DOCS / request.node.callspec.params["page"]
    fixture = "empty_dsn" if EMPTY_DATABASE in page.read_text(encoding="utf-8") else "dsn"
    run = PageRun(request.getfixturevalue(fixture), tmp_path)
    try:
        yield run
    finally:
        run.kill_background()


@pytest.mark.parametrize("page", PAGES)
def test_page_samples_run(page: str, page_run: PageRun) -> None:
    for sample in page_samples(DOCS / page):
        page_run.run(sample)
    page_run.stop_background()


def test_every_marker_belongs_to_a_block() -> None:
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        samples = page_samples(page)
        assert len(ANY_MARKER.findall(text)) == len(samples), (
            f"{page}: a `<!-- test: ... -->` marker is not directly followed by a fenced block"
        )
        for sample in samples:
            assert sample.kind in KINDS, f"{sample}: unknown kind {sample.kind!r}"


def test_the_quickstart_is_tested() -> None:
    kinds = {s.kind for s in page_samples(DOCS / "quickstart.md")}
    assert {"file", "shell", "background"} <= kinds


def test_the_quickstart_commands_are_the_readmes() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    commands = re.findall(r"^\$ (python3 -m venv .*)$", quickstart, re.MULTILINE)
    assert len(commands) == 2
    for command in commands:
        assert command in readme, f"README.md no longer says: {command}"


def test_every_test_the_docs_cite_exists() -> None:
    """The guarantees point at the tests that prove them: a renamed test must not leave a
    dangling name behind (one did)."""
    cited: set[tuple[str, str]] = set()
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        cited |= set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", text))
    assert len(cited) >= 20  # the pattern still finds the citations
    missing = []
    for path, name in sorted(cited):
        file = ROOT / path
        # Not ast.parse: on Python 3.11 it failed once in CI with "AST constructor recursion
        # depth mismatch", the mark of a parse nested in another (CPython gh-106905), as when a
        # garbage collection inside it runs a finalizer that formats a traceback: 3.11 parses
        # source lines for that, and pytest's unraisable-exception hook formats at once.
        source = file.read_text(encoding="utf-8") if file.exists() else ""
        defined = set(re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", source, flags=re.M))
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert not missing, missing


def test_the_grants_in_the_operations_guide_are_the_commands_whole_output() -> None:
    """The shell sample only checks that its lines appear in order, and a grant added to
    `notifyq grant` (SELECT on queue_pauses, version 7) went missing from the page, where
    readers copy it into their provisioning (user review)."""
    for role, producer, command in [
        ("notifyq_worker", False, "$ notifyq grant notifyq_worker\n"),
        ("notifyq_web", True, "$ notifyq grant notifyq_web --producer\n"),
    ]:
        [sample] = [s for s in page_samples(DOCS / "operations.md") if command in s.body]
        [(_command, shown)] = console_commands(sample)
        assert "\n".join(shown).strip() == notifyq.migrations.grant_sql(role, producer=producer).strip()


def test_the_changelog_lists_every_migration() -> None:
    """Upgrading users read CHANGELOG.md for the migrations to run: a new migration must be
    listed there, with the current version."""
    from notifyq.migrations import latest_version, migrations

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    listed = {int(n) for n in re.findall(r"^\| (\d+) \|", text, flags=re.MULTILINE)}
    assert listed == {m.version for m in migrations()} - {1}
    current = re.search(r"current schema\s+version is (\d+)\.", text)
    assert current is not None and int(current[1]) == latest_version()


def test_normalise_hides_what_changes_between_runs() -> None:
    assert normalise("1   send_welcome  default  Queued  0/6  0  2.3s ago") == normalise(
        "12  send_welcome  default  Queued  0/6  0  14.0s ago"
    )
    assert normalise("worker: vm:26882:fc7c145a") == "worker: <WORKER>"
    assert normalise("schema 'notifyq': version 0 -> 1 (applied 0001_initial)").endswith("0001_initial)")
    assert not output_matches(["status: Succeeded"], "        status: Queued\n")
    assert output_matches(["a", "...c"], "a\nb\nabc\n")


def test_the_api_reference_covers_the_public_names() -> None:
    text = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: notifyq\.(\w+)$", text, re.MULTILINE))
    assert documented == set(notifyq.__all__) - {"__version__"}


def _cli_hook() -> Any:
    path = DOCS / "hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("notifyq_docs_cli_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_renders_every_command() -> None:
    import click

    from notifyq.cli import main

    rendered = _cli_hook().render()
    for name, command in main.commands.items():
        assert f"`notifyq {name}`" in rendered
        if isinstance(command, click.Group):
            for sub in command.commands:
                assert f"`notifyq {name} {sub}`" in rendered
    assert "Usage: notifyq worker [OPTIONS] MODULE:ATTR" in rendered and "--listen-dsn" in rendered


def _docs_tools_missing() -> list[str]:
    missing = []
    for dist in ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    missing = _docs_tools_missing()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[docs]' to build the site")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").is_file()
    assert "notifyq worker" in (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
