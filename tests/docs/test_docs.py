"""The documentation: a README that fits on a few screens, a site that builds without a warning, links that
resolve, and a configuration reference that matches the config models."""

import re
import subprocess
import sys
from pathlib import Path

from tests_support import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_fits_on_a_few_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    # not -q: with it, mkdocs 1.6.1 passed --strict with a link to an anchor no page has (tried by hand)
    out = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_relative_links_of_the_readme_and_the_pages_resolve():
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to a missing {target}"


def test_the_configuration_reference_is_the_config_models():
    out = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_setting_says_what_it_does():
    sys.path.insert(0, str(REPO / "scripts"))
    import gen_docs

    missing = gen_docs.missing_help()
    assert not missing, f"settings without help in schemas/config/ (a description, or a comment beside it): {missing}"


def test_every_built_in_registry_entry_says_what_it_is():
    """The registries page's "what it is" column is each entry's docstring: none of ours is left blank."""
    import importlib

    sys.path.insert(0, str(REPO / "scripts"))
    import gen_docs

    from rlstage.engines.registry import REGISTRIES

    for module in gen_docs.BUILTINS:
        importlib.import_module(module)
    blank = [
        f"{kind}: {name}"
        for kind, registry in REGISTRIES.items()
        for name in registry
        if registry.entry(name).module.startswith("rlstage.") and not (registry.entry(name).obj.__doc__ or "").strip()
    ]
    assert not blank, f"registered without a docstring (the registries page's 'what it is'): {blank}"


def test_a_config_error_links_the_reference_entry_of_its_setting() -> None:
    from rlstage.schemas.docs_site import site
    from rlstage.schemas.settings_help import reference_link

    page = (REPO / "docs" / "reference" / "config.md").read_text()
    for message, anchor in [
        ("config error: rollout.n: rollout.n=1: algorithm.adv_estimator=grpo needs groups", "rollout.n"),
        ("config error: data.source_settings.task: reasoning_gym has no task 'x'", "data.source_settings"),
        ("config error: agent.tools.0.callable: not importable", "agent.tools"),
        ("config error: rollout.nn: Extra inputs are not permitted", "rollout"),  # unknown key: its section
        ("config error: plugins.0: plugin 'p' failed to import", "plugins"),
    ]:
        assert reference_link(message) == f"{site()}reference/config/#{anchor}", message
        assert f'<a id="{anchor}"></a>' in page, anchor
    assert reference_link("config error: run 'x' does not exist under /s; runs there: y") is None


def test_help_and_errors_link_the_documentation_site_the_package_names() -> None:
    """A wheel user has no docs/ folder: links go to the project's Documentation URL, which mkdocs builds for."""
    import tomllib

    import yaml

    from rlstage.schemas.docs_site import page_url, site

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]["Documentation"]
    assert site() == declared and yaml.safe_load((REPO / "mkdocs.yml").read_text())["site_url"] == declared
    assert page_url("docs/index.md") == declared and page_url("reference/config.md", "rollout.n") == f"{declared}reference/config/#rollout.n"


def test_the_reading_path_of_concepts_is_the_one_counted():
    """docs/concepts.md's reading list names the files bench/reading_path.py counts, in its order, and says how many
    lines they are within a tenth."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reading_path", REPO / "bench" / "reading_path.py")
    reading_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reading_path)
    page = (REPO / "docs" / "concepts.md").read_text()
    listed = page[page.index("To follow one iteration in the code") :].split("\n\n")[1]
    files = re.findall(r"^\d+\. `([^`]+)`", listed, flags=re.M)
    assert files == [rel for rel, _ in reading_path.PATH]
    claimed = int(re.search(r"read these \w+ files in order \(about ([\d,]+) lines", page).group(1).replace(",", ""))
    counted = sum(n for _, n in reading_path.measure())
    assert abs(counted - claimed) <= claimed / 10, (counted, claimed)
