"""README.md and docs/ stay true to the repository: what they quote exists and parses.

- every `make TARGET` exists in the Makefile, and every `VAR=... make` sets one of its variables;
- every `manage.py COMMAND ...` (or a command's synopsis, `register_model NAME PATH [...]`)
  names a command whose parser takes those arguments, each alternative of `a|b` included;
- every ORCHARD_* / DJANGO_* / DATABASE_URL / REDIS_URL variable named is one the code reads
  (config/ through config/env.py; engine/kernels/ reads its own before MLX loads, as the engine
  may not import config/), and every one the code reads is a row of the settings reference;
- every command of accounts/ and inference/, and each of its options, is in docs/administering.md;
- every repository path (`engine/...`, `inference/...`, `bench/...`, `docs/...`) and dotted
  module (`engine.protocol`, `config.settings_production`) exists;
- every /v1 path named resolves, and every /v1 route is described in docs/using-the-api.md;
- every relative link (and its #anchor) resolves inside the repository, and every `*.md` named
  is a file of the repository (no documents from outside it);
- docs/index.md and mkdocs.yml list every page; docs/benchmarks.md every bench/ script (a
  file with a `__main__`).

Fast: no server, no model; Django is set up (pytest-django) for the commands and URLs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from django.core.management import BaseCommand, CommandError, get_commands, load_command_class
from django.urls import Resolver404, resolve

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SETTINGS_PAGE = DOCS / "deploying.md"
API_PAGE = DOCS / "using-the-api.md"
ADMIN_PAGE = DOCS / "administering.md"
BENCH_PAGE = DOCS / "benchmarks.md"

# Shell variables of the reader's own in client examples (where to keep a key), not settings.
CLIENT_VARIABLES = {"ORCHARD_API_KEY", "ORCHARD_USAGE_KEY"}
SETTING_NAME = re.compile(
    r"\b(ORCHARD_[A-Z0-9_]*[A-Z0-9]|DJANGO_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL|REDIS_URL)\b"
)
PATH_ROOTS = "accounts|bench|common|config|docs|engine|inference|scripts|templates|tests"
REPO_PATH = re.compile(rf"(?<![\w/.$~-])((?:{PATH_ROOTS})/[\w./-]*)")
MODULE_ROOTS = "accounts|common|config|engine|inference"
DOTTED = re.compile(rf"(?<![\w./$-])((?:{MODULE_ROOTS})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])")
FILE_SUFFIXES = {"json", "toml", "py", "md", "txt", "yml", "yaml", "env", "sqlite3", "service"}
V1_PATH = re.compile(r"(?<![\w])(/v1/[\w{}/.-]*[\w}])")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_NAME = re.compile(r"(?<![\w/.-])((?:\.\./|[\w-]+/)*[\w.-]+\.md)\b")
NOT_SOURCES = {".git", "node_modules", "var", "__pycache__"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def prose(text: str) -> str:
    """The text outside code blocks and code spans (where links are links)."""
    return INLINE.sub("", FENCE.sub("", text))


def snippets(text: str) -> list[str]:
    """Every line of a fenced block and every code span; a table's escaped `\\|` is a `|`."""
    found = [line for block in FENCE.findall(text) for line in block.splitlines()]
    found += INLINE.findall(FENCE.sub("", text))
    return [snippet.replace("\\|", "|") for snippet in found]


@cache
def makefile() -> tuple[set[str], set[str]]:
    text = text_of(ROOT / "Makefile")
    targets = set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M))
    return targets, variables


@cache
def variables_read() -> dict[str, str]:
    """Environment variable -> the file that reads it."""
    found = {}
    for path in sorted((ROOT / "config").glob("*.py")):
        text = text_of(path)
        readers = r"env_(?:str|bool|int|float|list|share_or_bytes|bytes)"
        names = re.findall(readers + r"\(\s*\"([A-Z0-9_]+)\"", text)
        names += re.findall(r"environ\.setdefault\(\s*\"([A-Z0-9_]+)\"", text)
        found.update(dict.fromkeys(names, page_id(path)))
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for name in re.findall(r"\"(ORCHARD_[A-Z0-9_]+)\"", text_of(path)):
            found[name] = page_id(path)
    return found


@cache
def markdown_files() -> set[str]:
    """The repository's Markdown files by name (virtual environments and data left out)."""
    found = set()
    for _, subfolders, files in os.walk(ROOT):
        subfolders[:] = [
            d for d in subfolders if d not in NOT_SOURCES and not d.startswith(".venv")
        ]
        found.update(name for name in files if name.endswith(".md"))
    return found


def orchard_commands() -> set[str]:
    return {name for name, app in get_commands().items() if app in ("accounts", "inference")}


def command_quotes(text: str) -> list[tuple[str, str]]:
    """(command, its arguments as written) for every command line the page quotes."""
    commands = get_commands()
    own = "|".join(sorted(orchard_commands()))
    quotes = []
    for snippet in snippets(text):
        snippet = re.split(r"\s#|\s\|\s|&&|;|\s>", snippet)[0]
        match = re.search(r"manage\.py\s+([a-z_]+)(.*)", snippet) or re.match(
            rf"\s*({own})\b(.*)", snippet
        )
        # A bare name is a reference to the command, not a use of it.
        if match and match.group(1) in commands and match.group(2).strip():
            quotes.append((match.group(1), match.group(2).strip()))
    return quotes


def is_placeholder(token: str) -> bool:
    return re.fullmatch(r"[A-Z][A-Z0-9_]*(,[A-Z][A-Z0-9_]*)*", token) is not None


def argument_lists(parser: argparse.ArgumentParser, written: str) -> list[list[str]]:
    """The argument lists a synopsis stands for: `[--x N]` is `--x N` with N a value the
    option takes, `a|b` is each of a and b in turn, `...` nothing."""
    tokens = [t.strip("[]") for t in shlex.split(written)]
    tokens = [t for t in tokens if t and t not in ("...", "…")]
    options = parser._option_string_actions

    def concrete(index: int, token: str) -> str:
        action = options.get(tokens[index - 1]) if index else None
        if not is_placeholder(token) or action is None:
            return token
        if action.choices:
            return next(str(choice) for choice in action.choices if choice)
        return "1" if action.type is not None else token

    def one(choice_at: int | None, alternative: int) -> list[str]:
        args = []
        for index, token in enumerate(tokens):
            alternatives = token.split("|") if not token.startswith("--") else [token]
            pick = alternatives[alternative] if index == choice_at else alternatives[0]
            args.append(concrete(index, pick))
        return args

    lists = [one(None, 0)]
    for index, token in enumerate(tokens):
        if "|" in token and not token.startswith("--"):
            lists += [one(index, k) for k in range(1, len(token.split("|")))]
    return lists


def resolves(path: str) -> bool:
    try:
        resolve(re.sub(r"\{[^}]*\}", "x", path))
    except Resolver404:
        return False
    return True


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[`*_]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", text_of(path)), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


pages = pytest.mark.parametrize("page", PAGES, ids=page_id)


@pages
def test_make_targets_exist(page):
    targets, variables = makefile()
    problems = []
    for snippet in snippets(text_of(page)):
        for match in re.finditer(r"((?:\b[A-Z_]+=\S*\s+)*)\bmake\b((?:\s+[A-Z_]+=\S*)*)", snippet):
            rest = snippet[match.end() :].split()
            target = rest[0] if rest and re.fullmatch(r"[a-z][\w-]*", rest[0]) else None
            if target and target not in targets:
                problems.append(f"`make {target}`: no such target in the Makefile")
            assigned = re.findall(r"\b([A-Z_]+)=", match.group(1) + match.group(2))
            problems += [
                f"`{name}=`: not a Makefile variable" for name in assigned if name not in variables
            ]
    assert not problems, "\n".join(problems)


@pages
def test_management_commands_parse(page):
    problems = []
    for command, written in command_quotes(text_of(page)):
        parser = load_command_class(get_commands()[command], command).create_parser(
            "manage.py", command
        )
        for args in argument_lists(parser, written):
            try:
                parser.parse_args(args)
            except (CommandError, SystemExit) as exc:
                problems.append(f"`manage.py {command} {' '.join(args)}`: {exc}")
    assert not problems, "\n".join(problems)


def test_every_command_and_option_is_documented():
    text = text_of(ADMIN_PAGE)
    django_options = set(BaseCommand().create_parser("manage.py", "x")._option_string_actions)
    missing = []
    for command in sorted(orchard_commands()):
        if not re.search(rf"`(?:manage\.py )?{command}\b", text):
            missing.append(command)
        parser = load_command_class(get_commands()[command], command).create_parser(
            "manage.py", command
        )
        for option in sorted(set(parser._option_string_actions) - django_options):
            if option.startswith("--") and not re.search(rf"{option}(?![\w-])", text):
                missing.append(f"{command} {option}")
    assert not missing, f"{page_id(ADMIN_PAGE)} does not document {missing}"


@pages
def test_named_settings_are_read(page):
    read = variables_read()
    named = set(SETTING_NAME.findall(text_of(page))) - CLIENT_VARIABLES
    unknown = sorted(named - set(read))
    assert not unknown, f"named but read nowhere in config/ or engine/: {unknown}"


def test_every_setting_is_in_the_reference():
    rows = set(re.findall(r"^\|\s*`([A-Z][A-Z0-9_]+)`\s*\|", text_of(SETTINGS_PAGE), re.M))
    missing = {name: reader for name, reader in variables_read().items() if name not in rows}
    assert not missing, f"read but not in {page_id(SETTINGS_PAGE)}'s settings table: {missing}"


@pages
def test_repository_paths_exist(page):
    problems = []
    for found in REPO_PATH.findall(text_of(page)):
        path = found.rstrip(".,:;")
        if not (ROOT / path).exists():
            problems.append(path)
    assert not problems, f"no such path in the repository: {sorted(set(problems))}"


@pages
def test_dotted_modules_exist(page):
    problems = []
    for name in set(DOTTED.findall(text_of(page))):
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue
        depth = 1
        while depth < len(parts) and (
            (ROOT.joinpath(*parts[: depth + 1])).is_dir()
            or ROOT.joinpath(*parts[:depth], parts[depth] + ".py").exists()
        ):
            depth += 1
        if depth == len(parts):
            continue
        value = importlib.import_module(".".join(parts[:depth]))
        for attribute in parts[depth:]:
            if not hasattr(value, attribute):
                problems.append(name)
                break
            value = getattr(value, attribute)
    assert not problems, f"no such module or name: {sorted(problems)}"


@pages
def test_v1_paths_resolve(page):
    unknown = sorted({p for p in V1_PATH.findall(text_of(page)) if not resolves(p)})
    assert not unknown, f"no such route: {unknown}"


def test_every_v1_route_is_described():
    from inference.urls import urlpatterns

    text = text_of(API_PAGE)
    missing = []
    for pattern in urlpatterns:
        route = re.escape("/v1/" + str(pattern.pattern))
        route = re.sub(r"<[^>]+>", r"\\{[^}]+\\}", route.replace(r"\<", "<").replace(r"\>", ">"))
        if not re.search(route + r"(?![\w/])", text):
            missing.append("/v1/" + str(pattern.pattern))
    assert not missing, f"routes {page_id(API_PAGE)} does not describe: {missing}"


@pages
def test_links_resolve(page):
    problems = []
    for target in LINK.findall(prose(text_of(page))):
        if re.match(r"[a-z][a-z+]*:", target):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if ROOT not in path.parents and path != ROOT:
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            problems.append(f"{target}: no heading #{anchor} in {page_id(path)}")
    assert not problems, "\n".join(problems)


@pages
def test_named_documents_exist(page):
    problems = []
    for name in set(MD_NAME.findall(text_of(page))):
        here, there = (page.parent / name).resolve(), (ROOT / name).resolve()
        if name.startswith("../") and ROOT not in here.parents:
            problems.append(f"{name}: outside the repository")
        elif not (
            here.exists() or there.exists() or ("/" not in name and name in markdown_files())
        ):
            problems.append(f"{name}: no such document in the repository")
    assert not problems, "\n".join(problems)


def test_index_and_site_list_every_page():
    names = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(text_of(DOCS / "index.md"))}
    assert names <= linked, f"docs/index.md does not link {sorted(names - linked)}"
    assert "docs/index.md" in LINK.findall(text_of(ROOT / "README.md")), "README: no docs/ map"
    site = ROOT / "mkdocs.yml"
    if site.exists():
        nav = set(re.findall(r"([\w-]+\.md)\b", text_of(site)))
        assert nav == names | {"index.md"}, f"mkdocs.yml's nav differs from docs/: {nav}"


def test_every_benchmark_is_described():
    text = text_of(BENCH_PAGE)
    scripts = [p for p in sorted((ROOT / "bench").glob("*.py")) if "__main__" in text_of(p)]
    missing = [page_id(p) for p in scripts if page_id(p) not in text]
    assert not missing, f"{page_id(BENCH_PAGE)} does not describe {missing}"
