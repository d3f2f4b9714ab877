"""The documentation: the site in docs/ builds with ``mkdocs build --strict`` (no broken link, no
missing anchor, no docstring mkdocstrings cannot read, the Results pages generated from
bench/results), every page in docs/ is in mkdocs.yml's nav (mkdocs itself only mentions a page
left out), the README stays short and its relative links lead to files that exist, and the API
reference lists every public name."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 250


def _mkdocs_yml():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        return f.read()


def _nav_pages():
    """The .md files mkdocs.yml's nav names (the nav is the file's last top-level key)."""
    text = _mkdocs_yml()
    nav = re.search(r"^nav:\s*\n(.*?)(?=^\S|\Z)", text, re.M | re.S)
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r"([\w./-]+\.md)\s*$", nav.group(1), re.M)


def _doc_pages():
    pages = []
    for dirpath, dirnames, filenames in os.walk(DOCS):
        dirnames[:] = [d for d in dirnames if d not in ("hooks", "__pycache__")]   # mkdocs.yml excludes hooks/
        pages += [os.path.relpath(os.path.join(dirpath, n), DOCS).replace(os.sep, "/")
                  for n in filenames if n.endswith(".md")]
    return sorted(pages)


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (scripts/setup_env.sh installs it with the docs extra: "
                    "mkdocs, mkdocs-material, mkdocstrings[python])")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + out[-6000:]
    site = tmp_path / "site"
    for page in ("index.html", "results/parity/index.html", "reference/stella_mpi/index.html"):
        assert (site / page).is_file(), "%s not built:\n%s" % (page, out[-3000:])
    # the hook generated the Results pages from bench/results (a kept JSON is named on its page)
    parity = (site / "results/parity/index.html").read_text(encoding="utf-8")
    assert "parity_seed0.json" in parity and "Provenance" in parity


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav, pages = _nav_pages(), _doc_pages()
    assert not sorted(set(pages) - set(nav)), "pages in docs/ missing from mkdocs.yml's nav: %s" % sorted(
        set(pages) - set(nav))
    assert not sorted(set(nav) - set(pages)), "mkdocs.yml's nav names pages docs/ lacks: %s" % sorted(
        set(nav) - set(pages))


def test_the_readme_is_short_and_its_links_lead_somewhere():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    lines = readme.count("\n") + (not readme.endswith("\n"))
    assert lines <= README_MAX_LINES, "README.md has %d lines; at most %d (the details go in docs/)" % (
        lines, README_MAX_LINES)
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t.split("#")[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert relative, "the README links to no docs page"
    broken = [t for t in relative if not os.path.exists(os.path.normpath(os.path.join(ROOT, t)))]
    assert not broken, "README.md links to files that do not exist: %s" % broken
    outside = [t for t in relative if os.path.relpath(os.path.normpath(os.path.join(ROOT, t)), ROOT).startswith("..")]
    assert not outside, "README.md links outside the repository: %s" % outside


def test_the_api_reference_lists_every_public_name():
    with open(os.path.join(ROOT, "tests", "unit", "test_public_names.py"), encoding="utf-8") as f:
        pinned = f.read().split("PUBLIC = ")[1].split("}")[0]   # the names test_public_names pins
    public = set(re.findall(r'"(\w+)"', pinned))
    assert len(public) > 50
    with open(os.path.join(DOCS, "reference", "stella_mpi.md"), encoding="utf-8") as f:
        page = f.read()
    missing = sorted(n for n in public if not re.search(r"stella_mpi\.%s\b" % re.escape(n), page))
    assert not missing, "docs/reference/stella_mpi.md does not list: %s" % missing
