"""The docs build as a site with no broken link, and README's links reach real files and anchors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def build_site(site: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_docs_build_strict_and_readme_links_resolve(tmp_path):
    build_site(tmp_path)  # --strict: a missing page, file or anchor in docs/ fails it
    broken = []
    for target in LINK.findall((ROOT / "README.md").read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            broken.append(f"{target}: no file {path}")
        elif anchor:
            assert path.startswith("docs/") and path.endswith(".md"), target
            page = tmp_path / path.removeprefix("docs/").removesuffix(".md") / "index.html"
            if f'id="{anchor}"' not in page.read_text():
                broken.append(f"{target}: {page.name} of {path} has no anchor {anchor!r}")
    assert broken == []


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 350


def test_ci_runs_exactly_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in (ROOT / "README.md").read_text()
